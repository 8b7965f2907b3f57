"""Cross-instance prefix pulls between kvherd agents: serve cached blocks, fetch a prefix.

Contract:
- Every agent serves its GPU prefix cache over `kvherd.kv_pull`'s block protocol at `address`:
  the blocks of the longest cached prefix of the hashes asked for are pinned on the engine
  thread (a reference under a pull owner: no eviction takes them), read off it and sent, then
  unpinned, so the holder's running requests keep stepping meanwhile.
- `pull(...)` runs on the destination before a request is added (the proxy asks with
  `kvherd.kv_pull.PULL_HEADER`: the holder's address and its depth in prompt blocks). On the engine thread it
  hashes the prompt as the request will be, holds its own leading GPU hits and reserves blocks
  for the rest up to the holder's depth (never the last prompt token's block); the holder's
  blocks are written straight into them off the engine thread; what landed joins the prefix
  cache under the engine core's `pull_carrier`, and `Pulled.release` (called in the command that
  adds the request) lets the carrier go. The request then hits them as a local prefix: its
  output is that of a local hit, bit-identical to recomputing.
- A holder that refuses, stalls past `timeout_s`, dies or sends a short stream costs a
  recompute of what did not land, never an error; nothing stays reserved (`Pulled.outcome`).
- With a fleet token both ends authenticate the block wire with it (`kvherd.kv_pull`'s trust
  rules): a request to this server without its MAC is refused, a pulled block whose MAC fails is
  dropped with the rest of the pull, each counted (``kvherd_kv_untrusted_total``), and
  `authorized` says whether a request's ``Authorization`` may ask for a pull at all.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from instance_agent.engine.core.request import Request, SamplingParams, pull_carrier
from kvherd.fleet_token import authorized
from kvherd.kv_pull import BlockServer, PullAsk, PullError, fetch_blocks

if TYPE_CHECKING:
    from instance_agent.engine.llm_engine import LLMEngine
    from instance_agent.engine_loop import EngineLoop

log = logging.getLogger(__name__)

_HASH_BYTES = 32  # a block hash on the wire (xxh3-64 or sha256)


@dataclass(slots=True)
class Pulled:
    """What a pull did and what landed."""

    outcome: str  # one of `kvherd.kv_pull.PULL_OUTCOMES`
    owner: str | None = None  # the carrier holding the landed blocks until `release`
    num_blocks: int = 0
    num_bytes: int = 0
    seconds: float = 0.0

    def release(self, engine: LLMEngine) -> None:
        """Engine thread: the request was added (it holds its hits now), or will not be."""
        if self.owner is not None:
            engine.free_reservation(self.owner)
            self.owner = None

    def header(self) -> str:
        """`kvherd.kv_pull.PULL_OUTCOME_HEADER`'s value."""
        return (
            f"{self.outcome} blocks={self.num_blocks} bytes={self.num_bytes} "
            f"seconds={self.seconds:.6f}"
        )


def kv_views(engine: LLMEngine) -> list[torch.Tensor]:
    """The KV cache as one tensor per layer and K/V, indexed by block id on dim 0."""
    cache = engine.runner.kv_cache  # [layers, 2, blocks, block_size, kv_heads, head_dim]
    return [cache[layer, kv] for layer in range(cache.shape[0]) for kv in range(2)]


def layout_key(engine: LLMEngine) -> str:
    """What two agents must share for one's block bytes to be the other's KV."""
    cache = engine.runner.kv_cache
    return (
        f"kvherd:{engine.config.model}:{engine.config.seed}:{engine.config.hash_algo}:{cache.dtype}:"
        f"{tuple(cache.shape[:2])}:{tuple(cache.shape[3:])}"
    )


class PrefixPulls:
    """An agent's block server and its pulls (module contract)."""

    def __init__(
        self,
        engine_loop: EngineLoop,
        host: str,
        advertise_host: str,
        port: int = 0,
        timeout_s: float = 10.0,
        fleet_token: str | None = None,
    ) -> None:
        self.engine_loop = engine_loop
        self.fleet_token = fleet_token
        engine = engine_loop.engine
        self.views = kv_views(engine)
        self.block_bytes = sum(v[0].numel() * v.element_size() for v in self.views)
        self.layout = layout_key(engine)
        self.timeout_s = timeout_s
        self._owners = itertools.count()
        self._releases: set[asyncio.Future[None]] = set()  # of pulls whose client left
        self._server = BlockServer(
            self,
            self.layout,
            host,
            port,
            io_timeout_s=timeout_s,
            token=fleet_token,
            on_refused=lambda: self._untrusted("block_request"),
        )
        self.address = f"tcp://{advertise_host}:{self._server.port}"

    def close(self) -> None:
        self._server.close()

    def authorized(self, presented: str | None) -> bool:
        """May a request with this ``Authorization`` value ask this agent to pull?"""
        if self.fleet_token is None:
            return True
        return authorized(presented.encode() if presented else None, self.fleet_token)

    def _untrusted(self, kind: str) -> None:
        if self.engine_loop.metrics is not None:
            self.engine_loop.metrics.untrusted(kind)

    # -- the holder (`kvherd.kv_pull.BlockSource`, on the block server's threads) ----------------
    def prefix(self, hashes: Sequence[bytes]) -> list[bytes]:
        owner = f"pull-out:{next(self._owners)}"
        wanted = [int.from_bytes(h, "big") for h in hashes]

        def pin(engine: LLMEngine) -> list[int]:
            block_manager = engine.block_manager
            hits = block_manager.lookup_cached_prefix(wanted)
            block_manager.share_cached_blocks(owner, hits)
            return hits

        loop = self.engine_loop
        try:
            hits = loop.call_threadsafe(pin, self.timeout_s)
            blocks = [self._read(block_id) for block_id in hits]
            if loop.metrics is not None:
                loop.metrics.pull_served_blocks.inc(len(blocks))
            return blocks
        finally:  # queued after the pin, so it runs after it even if the pin timed out here
            with contextlib.suppress(TimeoutError):
                loop.call_threadsafe(lambda engine: engine.free_reservation(owner), self.timeout_s)

    def _read(self, block_id: int) -> bytes:
        return b"".join(v[block_id].view(torch.uint8).cpu().numpy().tobytes() for v in self.views)

    # -- the destination ----------------------------------------------------------------------
    async def pull(
        self,
        request_id: str,
        prompt_ids: Sequence[int],
        cache_salt: str | None,
        ask: PullAsk,
        lora_name: str | None = None,
    ) -> Pulled:
        """Pull `ask`'s blocks for the prompt (module contract), run with LoRA adapter
        `lora_name` (its blocks hash with it). Cancelled, it lets the pull run to its end and
        then frees what it holds."""
        task = asyncio.ensure_future(self._pull(request_id, prompt_ids, cache_salt, ask, lora_name))
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            task.add_done_callback(self._abandoned)
            raise

    def _abandoned(self, task: asyncio.Future[Pulled]) -> None:
        if not task.cancelled() and task.exception() is None:
            release = asyncio.ensure_future(self.engine_loop.call(task.result().release))
            self._releases.add(release)
            release.add_done_callback(self._releases.discard)

    async def _pull(
        self,
        request_id: str,
        prompt_ids: Sequence[int],
        cache_salt: str | None,
        ask: PullAsk,
        lora_name: str | None,
    ) -> Pulled:
        started = time.perf_counter()
        loop = self.engine_loop
        request: Request | None = None
        owner = ""

        def reserve(engine: LLMEngine) -> tuple[int, int, list[int]]:
            """(the holder's depth here, this instance's GPU hits, now held by the carrier, the
            blocks reserved past them up to that depth)."""
            nonlocal request, owner
            request = Request(
                request_id,
                prompt_ids,
                SamplingParams(max_tokens=1, seed=0),
                engine.config.block_size,
                cache_salt=cache_salt,
                hash_algo=engine.config.hash_algo,
                lora_name=lora_name,
            )
            owner = pull_carrier(request, 0).request_id
            upto = min(ask.num_blocks, (len(prompt_ids) - 1) // request.block_size)
            block_manager = engine.block_manager
            hits = block_manager.lookup_cached_prefix(request.block_hashes[:upto])
            if len(hits) >= upto:
                return upto, len(hits), []
            block_manager.share_cached_blocks(owner, hits)
            reserved = engine.reserve_blocks(owner, upto - len(hits))
            if reserved is None:
                engine.free_reservation(owner)
            return upto, len(hits), reserved or []

        upto, local, reserved = await loop.call(reserve)
        assert request is not None
        if not reserved:
            return Pulled("nothing_to_pull" if local >= upto else "no_room")
        hashes = [h.to_bytes(_HASH_BYTES, "big") for h in request.block_hashes[local:upto]]
        landed = 0

        def sink(i: int, block: memoryview) -> None:
            nonlocal landed
            offset = 0
            for view in self.views:
                row = view[reserved[i]].view(torch.uint8).reshape(-1)
                size = row.numel()
                row.copy_(torch.frombuffer(block, dtype=torch.uint8, count=size, offset=offset))
                offset += size
            landed = i + 1

        fetch = asyncio.to_thread(
            fetch_blocks,
            ask.address,
            self.layout,
            hashes,
            self.block_bytes,
            sink,
            self.timeout_s,
            self.fleet_token,
        )
        outcome = "landed"
        try:
            await fetch
        except PullError as exc:
            log.warning("pull of %s from %s: %s (recomputing)", request_id, ask.address, exc)
            outcome = "failed"
            if exc.reason == "untrusted":
                self._untrusted("pulled_block")
        except Exception:
            log.exception("pull of %s from %s failed (recomputing)", request_id, ask.address)
            outcome = "failed"
        if outcome == "landed" and landed < len(hashes):
            outcome = "partial"
        carrier = pull_carrier(request, local + landed)
        carrier.num_computed_tokens = (local + landed) * request.block_size
        await loop.call(lambda engine: engine.block_manager.cache_full_blocks(carrier))
        return Pulled(
            outcome, owner, landed, landed * self.block_bytes, time.perf_counter() - started
        )
