"""kvherd's KV connector for vLLM (0.32 API): whole-block prefix pulls between vLLM instances.

Contract (loaded by vLLM's own python; see vllm_connector.md for the flags and the verified facts):
- Every worker copies each full block its engine computes or loads into a bounded host
  `kv_pull.BlockStore` (``kv_connector_extra_config.store_mib``, default 512) after the forward
  that wrote it, and serves the store on ``port`` (0 or absent: serves nothing) to other workers.
- Host tier (``host_tier``, default on): the scheduler mirrors the store (`kv_pull.BlockIndex`),
  announces it with vLLM's own events on vLLM's KV event stream (``BlockStored`` and
  ``BlockRemoved``, ``medium`` "CPU"), and a request whose prefix vLLM's pool lost but the store
  holds loads it from there (``{"kvherd_host": ...}`` in its response) instead of recomputing.
- A request whose ``kv_transfer_params`` carry ``{"kvherd_pull": {"from": "tcp://host:port",
  "tokens": N}}`` loads, asynchronously, the full prompt blocks past its local hit (up to N tokens,
  never the block of the last prompt token) from that server into the blocks vLLM allocated,
  waits in WAITING_FOR_REMOTE_KVS meanwhile, and then prefills only the rest.
- Any failure (refused, unreachable, short stream, a block the source lacks, ``pull_timeout_s``
  passing) reports the load failed: vLLM frees the blocks and recomputes (``kv_load_failure_policy``
  must be "recompute"); a request pulls at most once. Nothing stays pinned on either side.
- The response of a request that loaded says so in its ``kv_transfer_params``: ``{"kvherd_pull"
  (or "kvherd_host"): {"outcome": "loaded"|"failed", "tokens": n}}``. Blocks move only between
  servers of one model, dtype, block size and CPU ISA (the layout key of every pull says which).
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from vllm.distributed.kv_events import MEDIUM_CPU, BlockRemoved, BlockStored, KVCacheEvent
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
)
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

from kvherd.kv_pull import BlockIndex, BlockServer, BlockStore, Pull, PullError, fetch_blocks

logger = logging.getLogger("vllm.kvherd_connector")  # under vLLM's logger, so it reaches its log

DEFAULT_STORE_MIB = 512
DEFAULT_PULL_TIMEOUT_S = 10.0
PARALLEL_PULLS = 2  # loader threads per worker: a slow source does not hold up the next pull


@dataclass(frozen=True, slots=True)
class BlockLoad:
    """Load `hashes` from `source` (None: this worker's own store) into its `block_ids`."""

    request_id: str
    source: str | None
    hashes: list[bytes]
    block_ids: list[int]


@dataclass
class KvherdConnectorMetadata(KVConnectorMetadata):
    """One step's work for the workers: loads to start, and (hash, block id) to keep."""

    loads: list[BlockLoad] = field(default_factory=list)
    saves: list[tuple[bytes, int]] = field(default_factory=list)


@dataclass(slots=True)
class _Tracked:
    """The scheduler side's view of one live request."""

    request: Any  # vllm.v1.request.Request
    pull: Pull | None
    saved_blocks: int = 0  # blocks already handed to the workers to keep
    planned: tuple[int, int] | None = None  # (first block, blocks) the last match offered
    kind: str | None = None  # the load it got: "kvherd_pull" (a peer) or "kvherd_host" (its store)
    loaded_tokens: int = 0
    outcome: str | None = None  # "loading", then "loaded" or "failed"


class KvherdConnector(KVConnectorBase_V1):
    """Scheduler and worker sides of the kvherd connector (see the module contract)."""

    def __init__(
        self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        transfer = vllm_config.kv_transfer_config
        if transfer.kv_load_failure_policy != "recompute":
            raise ValueError(
                'kvherd connector: set "kv_load_failure_policy": "recompute" in '
                "--kv-transfer-config (a failed pull must recompute, not fail the request)"
            )
        extra = transfer.kv_connector_extra_config or {}
        self._block_size: int = vllm_config.cache_config.block_size
        # Both sides size the store from vLLM's KV config, so the scheduler's mirror is exact.
        block_bytes = sum(t.size for t in kv_cache_config.kv_cache_tensors) // max(
            1, kv_cache_config.num_blocks
        )
        capacity = (int(extra.get("store_mib", DEFAULT_STORE_MIB)) << 20) // max(1, block_bytes)
        # Scheduler side.
        self._tracked: dict[str, _Tracked] = {}
        self._ready_loads: list[BlockLoad] = []
        self._host_tier = bool(extra.get("host_tier", True))
        self._host_index = BlockIndex(capacity)
        self._events: list[KVCacheEvent] = []  # drained by vLLM every step (take_events)
        # Worker side.
        self._store = BlockStore(capacity)
        self._host = str(extra.get("host", "127.0.0.1"))
        self._port = int(extra.get("port", 0))
        self._pull_timeout_s = float(extra.get("pull_timeout_s", DEFAULT_PULL_TIMEOUT_S))
        self._layers: list[torch.Tensor] = []
        self._layout = ""
        self._block_bytes = 0
        self._server: BlockServer | None = None
        self._loader: ThreadPoolExecutor | None = None
        self._done_lock = threading.Lock()
        self._done: dict[str, bool] = {}  # request id -> loaded (False: failed)

    # ---- scheduler side -------------------------------------------------------------------

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        tracked = self._tracked.get(request.request_id)
        if tracked is None:
            tracked = _Tracked(request, Pull.from_params(request.kv_transfer_params))
            self._tracked[request.request_id] = tracked
        tracked.planned = None
        if tracked.outcome is not None:
            return 0, False  # one load per request: a failed one recomputes
        size = self._block_size
        first = num_computed_tokens // size
        wanted = min((request.num_prompt_tokens - 1) // size, len(request.block_hashes))
        if tracked.pull is not None:
            if tracked.pull.tokens is not None:
                wanted = min(wanted, tracked.pull.tokens // size)
        elif self._host_tier:
            wanted = first + self._host_index.prefix_len(request.block_hashes[first:wanted])
        else:
            return 0, False
        if wanted <= first:
            return 0, False
        tracked.planned = (first, wanted - first)
        return (wanted - first) * size, True

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        tracked = self._tracked.get(request.request_id)
        if num_external_tokens == 0 or tracked is None or tracked.planned is None:
            return
        first, count = tracked.planned
        block_ids = blocks.get_block_ids()[0][first : first + count]
        hashes = [bytes(h) for h in request.block_hashes[first : first + count]]
        source = tracked.pull.source if tracked.pull is not None else None
        self._ready_loads.append(BlockLoad(request.request_id, source, hashes, list(block_ids)))
        tracked.kind = "kvherd_host" if source is None else "kvherd_pull"
        tracked.outcome, tracked.loaded_tokens = "loading", count * self._block_size

    def build_connector_meta(self, scheduler_output: Any) -> KvherdConnectorMetadata:
        meta = KvherdConnectorMetadata(loads=self._ready_loads)
        self._ready_loads = []
        manager = self._kv_cache_manager
        assert manager is not None
        for request_id, scheduled in scheduler_output.num_scheduled_tokens.items():
            tracked = self._tracked.get(request_id)
            if tracked is None:
                continue
            request = tracked.request
            # Blocks full once this step's tokens are written; vLLM hashed them at allocation.
            full = min(
                (request.num_computed_tokens + scheduled) // self._block_size,
                len(request.block_hashes),
            )
            if full <= tracked.saved_blocks:
                continue
            block_ids = manager.get_block_ids(request_id)[0]
            for i in range(tracked.saved_blocks, full):
                block_hash = bytes(request.block_hashes[i])
                meta.saves.append((block_hash, block_ids[i]))
                self._mirror_put(request, i, block_hash)
            tracked.saved_blocks = full
        return meta

    def _mirror_put(self, request: Any, i: int, block_hash: bytes) -> None:
        """The worker keeps this block: mirror it, and announce it (and any eviction) as vLLM
        would a tier of its own, on vLLM's event stream."""
        added, evicted = self._host_index.put(block_hash)
        if evicted and self._host_tier:
            hashes = [maybe_convert_block_hash(h) for h in evicted]
            self._events.append(BlockRemoved(block_hashes=hashes, medium=MEDIUM_CPU))
        if not added or not self._host_tier:
            return
        size = self._block_size
        parent = request.block_hashes[i - 1] if i else None
        lora = request.lora_request
        self._events.append(
            BlockStored(
                block_hashes=[maybe_convert_block_hash(block_hash)],
                parent_block_hash=None if parent is None else maybe_convert_block_hash(parent),
                token_ids=list(request.all_token_ids[i * size : (i + 1) * size]),
                block_size=size,
                lora_id=lora.adapter_id if lora else None,
                medium=MEDIUM_CPU,
                lora_name=lora.name if lora else None,
            )
        )

    def take_events(self) -> list[KVCacheEvent]:
        events, self._events = self._events, []
        return events

    def update_connector_output(self, connector_output: Any) -> None:
        failed = connector_output.failed_recving or set()
        for request_id in connector_output.finished_recving or ():
            tracked = self._tracked.get(request_id)  # gone when aborted while it loaded
            if tracked is not None:
                tracked.outcome = "failed" if request_id in failed else "loaded"

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict | None]:
        tracked = self._tracked.pop(request.request_id, None)
        if tracked is None or tracked.kind is None:
            return False, None
        loaded = tracked.outcome == "loaded"
        report = {"outcome": tracked.outcome, "tokens": tracked.loaded_tokens * loaded}
        return False, {tracked.kind: report}

    # ---- worker side ----------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        # Per layer [num_blocks, ...]; block i of every layer is contiguous (checked), so a
        # block's KV is the concatenation of one slice per layer, in layer-name order.
        self._layers = [kv_caches[name] for name in sorted(kv_caches)]
        first = self._layers[0]
        for layer in self._layers:
            if not layer[0].is_contiguous() or layer.shape != first.shape:
                raise ValueError(f"kvherd connector: unsupported KV layout {tuple(layer.shape)}")
        per_layer = first[0].numel() * first.element_size()
        self._block_bytes = per_layer * len(self._layers)
        isa = torch.backends.cpu.get_cpu_capability() if first.device.type == "cpu" else ""
        shape = "x".join(str(d) for d in first.shape[1:])
        self._layout = f"{first.dtype}:{shape}:{len(self._layers)}:{first.device.type}:{isa}"
        self._loader = ThreadPoolExecutor(PARALLEL_PULLS, thread_name_prefix="kvherd-pull")
        if self._port:
            self._server = BlockServer(self._store, self._layout, self._host, self._port)
            logger.info("kvherd connector serving blocks on %s:%d", self._host, self._port)

    def _block_bytes_of(self, block_id: int) -> bytes:
        parts = [layer[block_id].reshape(-1).view(torch.uint8) for layer in self._layers]
        return torch.cat(parts).numpy().tobytes()

    def _write_block(self, block_id: int, data: memoryview) -> None:
        # Through numpy views: one copy, and a read-only source (a stored block) is fine.
        source = np.frombuffer(data, dtype=np.uint8)
        per_layer = self._block_bytes // len(self._layers)
        for i, layer in enumerate(self._layers):
            target = layer[block_id].reshape(-1).view(torch.uint8).numpy()
            target[:] = source[i * per_layer : (i + 1) * per_layer]

    def _load(self, load: BlockLoad) -> None:
        started = time.monotonic()

        def sink(i: int, data: memoryview) -> None:
            self._write_block(load.block_ids[i], data)

        try:
            if load.source is None:  # the host tier: this worker's own store
                blocks = self._store.prefix(load.hashes)
                for i, block in enumerate(blocks):
                    sink(i, memoryview(block))
                count = len(blocks)
            else:
                count = fetch_blocks(
                    load.source,
                    self._layout,
                    load.hashes,
                    self._block_bytes,
                    sink,
                    self._pull_timeout_s,
                )
            if count < len(load.hashes):
                raise PullError(f"{load.source} holds {count} of {len(load.hashes)} blocks")
            loaded = True
            logger.info(
                "kvherd pull %s: %d blocks (%d bytes) from %s in %.3fs",
                load.request_id,
                count,
                count * self._block_bytes,
                load.source or "the host tier",
                time.monotonic() - started,
            )
        except PullError as exc:
            loaded = False
            logger.warning("kvherd pull %s failed, recomputing: %s", load.request_id, exc)
        except Exception:  # a bug must not strand the request: report it failed
            loaded = False
            logger.exception("kvherd pull %s crashed, recomputing", load.request_id)
        with self._done_lock:
            self._done[load.request_id] = loaded

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KvherdConnectorMetadata) and self._loader is not None
        for load in meta.loads:
            self._loader.submit(self._load, load)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads finish before vLLM schedules the request; nothing is layer-pipelined

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kw: Any) -> None:
        return  # blocks are kept whole in wait_for_save, once every layer is written

    def wait_for_save(self) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KvherdConnectorMetadata)
        for block_hash, block_id in meta.saves:
            if block_hash not in self._store:
                self._store.put(block_hash, self._block_bytes_of(block_id))

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        with self._done_lock:
            done, self._done = self._done, {}
        return KVConnectorTransferResults(
            finished_recving=set(done),
            failed_recving={request_id for request_id, ok in done.items() if not ok},
        )

    def shutdown(self) -> None:
        if self._server is not None:
            self._server.close()
        if self._loader is not None:
            self._loader.shutdown(wait=False, cancel_futures=True)
