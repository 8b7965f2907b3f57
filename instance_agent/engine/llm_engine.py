"""`LLMEngine`: the built-in paged-attention engine (block manager + batch scheduler + model runner).

Contract:
- `add_request` validates everything before any block is allocated (sampling values, prompt token
  ids in ``[0, vocab)``, non-empty prompt, prompt + max_tokens within `max_model_len` with vLLM's
  message, capacity) and raises `InvalidRequestError` naming the problem.
- `step()` runs one continuous-batching step and returns a `RequestOutput` for every request that
  produced a token or finished. ``text`` is the text streamed so far and ``text_delta`` its newest
  part; while stop strings are pending, the last ``len(longest stop) - 1`` characters are held back so
  no stop string is ever partially streamed. A stop string ends the request with reason "stop" and the
  text is cut before it (OpenAI's behaviour).
- `take_kv_event_batch()` wraps the block manager's KV events in batches with increasing `seq`.
  Untaken events are bounded (`MAX_PENDING_KV_EVENTS`): past it they are dropped and their batch
  number skipped, so a consumer sees a gap and resyncs, and an engine nobody reads events from (a
  CLI run, a benchmark) does not grow.
- Migration hooks: `request_blocks`, `suspend` / `resume`, `release_migrated`, `read_kv` / `write_kv` (tensors
  ``[layers, 2, n, block_size, kv_heads, head_dim]``), `reserve_blocks` / `free_reservation`,
  `export_request_state` and `adopt_request`. An adopted request continues bit-identically: its
  sampling seed and output length fix every later draw, and its detokenizer state is rebuilt from its
  output ids.
- KV tiers (``num_cpu_blocks``, ``disk_kv_file`` + ``num_disk_blocks``): blocks the GPU pool evicts
  move down to host memory, then disk (`instance_agent.engine.core.tiers` decides,
  `instance_agent.engine.kv_tiers` copies); a step first hands the scheduler the loads that
  landed, runs the offloads its schedule queued before the forward pass, and starts its new loads
  on the load thread; a step with nothing to run waits briefly for a load instead of spinning.
  Migration's `reserve_blocks` runs the offloads it queued before the blocks are written. Tokens
  loaded from any tier count as cached (``num_cached_tokens``), as GPU hits do.
- LoRA: ``lora_modules`` (name -> PEFT adapter directory, `lora.load_adapter`) are loaded at
  start into ``max_loras`` slots (default: one per adapter, at least one; fewer slots than
  adapters, or a bad adapter, is a `ValueError`); `install_lora` / `unload_lora` change them at run
  time (`core.lora_slots`: LRU eviction of an adapter no request runs with). A request naming one
  (``lora_name``) runs with it, batched with requests for other adapters and the base model; an
  unknown name is an `InvalidRequestError`, and `adopt_request` refuses (`ValueError`) a request
  whose adapter this engine does not serve.
- Warm restart: the disk tier's manifest (`kv_manifest`) is read at start; when it was written
  under the same header, the slots whose bytes pass their checksums fill the disk tier again
  (`BlockManager.restore_tier`: their stores are the first KV event batch). While the disk tier
  changes, a step rewrites the manifest at most every `MANIFEST_INTERVAL_S` (on its own thread),
  and `close` writes the last one.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from instance_agent.engine.core.batch_scheduler import BatchScheduler, SchedulerConfig
from instance_agent.engine.core.block_manager import BlockManager
from instance_agent.engine.core.lora_slots import LoraSlots
from instance_agent.engine.core.request import (
    InvalidRequestError,
    Request,
    RequestStatus,
    SamplingParams,
)
from instance_agent.engine.core.tiers import SlotEntry, TierConfig, TierStore
from instance_agent.engine.kv_manifest import (
    ManifestSlot,
    ManifestWriter,
    manifest_header,
    manifest_path,
    model_identity,
    read_manifest,
)
from instance_agent.engine.kv_tiers import TierBuffers
from instance_agent.engine.loader import LoadedModel, load_model
from instance_agent.engine.lora import LoraAdapter, load_adapter
from instance_agent.engine.model import kv_bytes_per_block
from instance_agent.engine.model_runner import ModelRunner
from kvherd.block_hash import HashAlgo
from kvherd.kv_events import MEDIUM_CPU, MEDIUM_GPU, MEDIUM_STORAGE, KVEvent, KVEventBatch
from kvherd.tokenizer import IncrementalDetokenizer, Tokenizer

MAX_PENDING_KV_EVENTS = 65536
IDLE_LOAD_WAIT_S = 0.005  # a step with only loads in flight waits this long for one to land
MANIFEST_INTERVAL_S = 5.0  # a changing disk tier's manifest is rewritten at most this often

log = logging.getLogger(__name__)


@dataclass(slots=True)
class EngineConfig:
    model: str = "tiny"
    seed: int = 0  # weights of a random-init preset
    block_size: int = 16
    num_gpu_blocks: int | None = None  # KV pool size in blocks; else from kv_cache_bytes
    kv_cache_bytes: int = 256 * 1024 * 1024
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None  # default: the model's max_position_embeddings
    enable_prefix_caching: bool = True
    device: str | None = None  # None: CUDA when available
    dtype: str = "auto"
    hash_algo: HashAlgo = "xxh3_64"
    watermark: float = 0.01
    num_cpu_blocks: int = 0  # host-memory KV tier, in blocks (0: none)
    disk_kv_file: str | None = None  # the disk KV tier's file (with num_disk_blocks)
    num_disk_blocks: int = 0
    lora_modules: dict[str, str] = field(default_factory=dict)  # LoRA adapter name -> directory
    max_loras: int | None = None  # adapter slots (None: one per adapter in lora_modules)


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    new_token_ids: list[int]
    output_token_ids: list[int]
    text: str
    text_delta: str
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    num_cached_tokens: int


@dataclass(slots=True)
class _TextState:
    """Detokenized text of one request and how much of it the client has seen."""

    detokenizer: IncrementalDetokenizer
    stop: list[str]
    text: str = ""
    num_emitted: int = 0  # characters of `text` already streamed
    stopped: bool = False
    hold: int = field(init=False)

    def __post_init__(self) -> None:
        self.hold = max((len(s) for s in self.stop), default=1) - 1

    def advance(self, token_ids: Sequence[int], finishing: bool) -> str:
        """Add tokens; return the new streamable text. Sets `stopped` on a stop string."""
        before = len(self.text)
        self.text += self.detokenizer.push(token_ids)
        if finishing:
            self.text += self.detokenizer.flush()
        if self.stop:
            search_from = max(0, before - self.hold)
            hits = [i for i in (self.text.find(s, search_from) for s in self.stop) if i >= 0]
            if hits:
                self.text = self.text[: min(hits)]
                self.stopped = True
        end = (
            len(self.text)
            if finishing or self.stopped
            else max(self.num_emitted, len(self.text) - self.hold)
        )
        delta = self.text[self.num_emitted : end]
        self.num_emitted = end
        return delta

    @property
    def emitted_text(self) -> str:
        return self.text[: self.num_emitted]


class LLMEngine:
    def __init__(self, config: EngineConfig | None = None) -> None:
        self.config = cfg = config or EngineConfig()
        loaded = load_model(cfg.model, seed=cfg.seed, dtype=cfg.dtype, device=cfg.device)
        self.model_config = loaded.config
        self.tokenizer: Tokenizer = loaded.tokenizer
        self.device = loaded.device
        max_model_len = cfg.max_model_len or loaded.config.max_position_embeddings
        if max_model_len > loaded.config.max_position_embeddings:
            raise ValueError(
                f"max_model_len {max_model_len} exceeds the model's max_position_embeddings "
                f"{loaded.config.max_position_embeddings}"
            )
        self.max_model_len = max_model_len
        if cfg.block_size < 1:
            raise ValueError("block_size must be positive")
        num_blocks = cfg.num_gpu_blocks
        if num_blocks is None:
            per_block = kv_bytes_per_block(loaded.config, cfg.block_size, loaded.dtype)
            # No point in more blocks than every sequence at full length can use.
            useful = cfg.max_num_seqs * -(-max_model_len // cfg.block_size)
            num_blocks = max(1, min(cfg.kv_cache_bytes // per_block, useful))
        tier_configs = [
            TierConfig(medium, count)
            for medium, count in (
                (MEDIUM_CPU, cfg.num_cpu_blocks),
                (MEDIUM_STORAGE, cfg.num_disk_blocks),
            )
            if count > 0
        ]
        if cfg.num_disk_blocks > 0 and cfg.disk_kv_file is None:
            raise ValueError("a disk KV tier needs a file (--disk-kv-dir)")
        if tier_configs and not cfg.enable_prefix_caching:
            raise ValueError("KV tiers need prefix caching")
        self.block_manager = BlockManager(
            num_blocks,
            cfg.block_size,
            cfg.enable_prefix_caching,
            cfg.watermark,
            TierStore(tier_configs, cfg.block_size) if tier_configs else None,
        )
        self.scheduler = BatchScheduler(
            SchedulerConfig(
                max_num_seqs=cfg.max_num_seqs,
                max_num_batched_tokens=cfg.max_num_batched_tokens,
                max_model_len=max_model_len,
            ),
            self.block_manager,
        )
        self.loras = self._load_adapters(loaded)
        self.lora_adapters = self.loras.adapters  # the runner reads this dict, changed in place
        self.runner = ModelRunner(loaded, num_blocks, cfg.block_size, self.lora_adapters)
        self.tier_buffers = (
            TierBuffers(
                self.runner.kv_cache, cfg.num_cpu_blocks, cfg.disk_kv_file, cfg.num_disk_blocks
            )
            if tier_configs
            else None
        )
        self._manifest: ManifestWriter | None = None
        self._manifest_at = -MANIFEST_INTERVAL_S  # when the last write started (monotonic)
        self._manifest_writes = -1  # the disk writes it covered
        if cfg.num_disk_blocks > 0:
            self._manifest = self._open_disk_tier(loaded)
        # The model's eos id when it has one; else the tokenizer's.
        self.eos_token_id = (
            loaded.config.eos_token_id
            if loaded.config.eos_token_id is not None
            else self.tokenizer.eos_token_id
        )
        self._texts: dict[str, _TextState] = {}
        self.num_computed_tokens_total = 0  # tokens run through the model (prefix hits skip it)
        self._event_seq = 0
        self._pending_events: list[KVEvent] = []
        self._auto_ids = itertools.count()

    def _load_adapters(self, loaded: LoadedModel) -> LoraSlots[LoraAdapter]:
        modules, slots = self.config.lora_modules, self.config.max_loras
        if slots is not None and slots < max(1, len(modules)):
            raise ValueError(
                f"max_loras {slots} leaves no slot for every LoRA adapter given ({len(modules)})"
            )
        table: LoraSlots[LoraAdapter] = LoraSlots(slots or max(1, len(modules)))
        for name, path in modules.items():
            table.install(
                load_adapter(name, path, loaded.config, loaded.dtype, loaded.device), bool
            )
        return table

    def read_lora(self, name: str, path: str) -> LoraAdapter:
        """Read a PEFT adapter for this engine's model (any thread: it touches no engine state)."""
        self.loras.check_path(name, path)
        return load_adapter(name, path, self.model_config, self.runner.dtype, self.device)

    def install_lora(self, adapter: LoraAdapter) -> str | None:
        """Make `adapter` resident (engine thread); returns the adapter evicted for it, if any."""
        return self.loras.install(adapter, self._lora_in_use)

    def unload_lora(self, name: str) -> None:
        self.loras.remove(name, self._lora_in_use)

    def _lora_in_use(self, name: str) -> bool:
        return any(r.lora_name == name for r in self.scheduler.requests.values())

    # -- requests ----------------------------------------------------------------------------
    def _prompt_ids(self, prompt: str | Sequence[int]) -> list[int]:
        ids: list[Any]
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt)
        elif isinstance(prompt, Sequence) and not isinstance(prompt, bytes):
            ids = list(prompt)
        else:
            raise InvalidRequestError("prompt must be a string or a list of token ids", "prompt")
        # Also for text: a checkpoint's tokenizer may know more ids than its embedding has rows.
        vocab = self.model_config.vocab_size
        for t in ids:
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab:
                raise InvalidRequestError(
                    f"prompt token id {t!r} is out of range [0, {vocab})", "prompt"
                )
        if not ids:
            raise InvalidRequestError("the prompt must not be empty", "prompt")
        return ids

    def add_request(
        self,
        request_id: str,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        *,
        priority: int = 0,
        cache_salt: str | None = None,
        arrival_time: float | None = None,
        lora_name: str | None = None,
    ) -> Request:
        request = self._new_request(
            request_id, prompt, params, priority, cache_salt, arrival_time, lora_name
        )
        self.scheduler.add_request(request)
        self._texts[request_id] = self._new_text_state(request.sampling_params)
        return request

    def continue_request(
        self,
        request_id: str,
        prompt: str | Sequence[int],
        output_token_ids: Sequence[int],
        params: SamplingParams,
        *,
        sampling_seed: int | None,
        emitted_text: str,
        priority: int = 0,
        cache_salt: str | None = None,
        lora_name: str | None = None,
    ) -> Request:
        """Continue a request that produced `output_token_ids` on an instance that was lost.

        Its KV is recomputed here (as after a preemption) and the next draw is number
        ``len(output_token_ids)`` under `sampling_seed`, so what follows is exactly what the lost
        instance would have produced; `emitted_text` (what the client has seen) resumes the text
        and stop-string state. Refused with `InvalidRequestError` before anything is allocated.
        """
        outputs = list(output_token_ids)
        vocab = self.model_config.vocab_size
        if not all(isinstance(t, int) and 0 <= t < vocab for t in outputs):
            raise InvalidRequestError(
                "output token ids must be in the vocabulary", "kvherd_continuation"
            )
        request = self._new_request(
            request_id, prompt, params, priority, cache_salt, None, lora_name
        )
        if len(outputs) >= request.sampling_params.max_tokens:
            raise InvalidRequestError("the request has no token budget left", "kvherd_continuation")
        text = self._new_text_state(request.sampling_params)
        text.advance(outputs, finishing=False)
        if not text.text.startswith(emitted_text):
            raise InvalidRequestError(
                "emitted_text does not match the output token ids", "kvherd_continuation"
            )
        text.num_emitted = len(emitted_text)
        if sampling_seed is not None:
            request.sampling_seed = sampling_seed
        for token in outputs:
            request.append_output_token(token)
        self.scheduler.add_request(request)
        self._texts[request_id] = text
        return request

    def _new_request(
        self,
        request_id: str,
        prompt: str | Sequence[int],
        params: SamplingParams | None,
        priority: int,
        cache_salt: str | None,
        arrival_time: float | None,
        lora_name: str | None,
    ) -> Request:
        """A validated `Request` (not yet queued)."""
        if lora_name is not None:
            if lora_name not in self.lora_adapters:
                raise InvalidRequestError(f"unknown LoRA adapter {lora_name!r}", "model")
            self.loras.touch(lora_name)
        params = params if params is not None else SamplingParams()
        params.validate()
        ids = self._prompt_ids(prompt)
        total = len(ids) + params.max_tokens
        if total > self.max_model_len:
            raise InvalidRequestError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, you "
                f"requested {total} tokens ({len(ids)} in the messages, {params.max_tokens} in the "
                "completion). Please reduce the length of the messages or completion.",
                "messages",
                "context_length_exceeded",
            )
        request = Request(
            request_id,
            ids,
            params,
            self.config.block_size,
            arrival_time=time.time() if arrival_time is None else arrival_time,
            priority=priority,
            cache_salt=cache_salt,
            eos_token_id=self.eos_token_id,
            hash_algo=self.config.hash_algo,
            lora_name=lora_name,
        )
        return request

    def _new_text_state(self, params: SamplingParams) -> _TextState:
        return _TextState(IncrementalDetokenizer(self.tokenizer), list(params.stop))

    def abort(self, request_id: str) -> bool:
        """End a request and free its blocks; False if it is unknown or already finished."""
        self._texts.pop(request_id, None)
        return self.scheduler.abort_request(request_id) is not None

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # -- stepping ----------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        buffers = self.tier_buffers
        if buffers is not None:
            self._land_loads(buffers)
        plan = self.scheduler.schedule()
        if buffers is not None:
            buffers.offload(self.block_manager.take_offloads())
            for load in plan.loads:
                buffers.start_load(load)
            if self._manifest is not None:
                self._maybe_write_manifest(buffers)
        if plan.is_empty:
            if buffers is not None and buffers.num_in_flight:
                buffers.wait(IDLE_LOAD_WAIT_S)
            return []
        before = {s.request.request_id: s.request.num_output_tokens for s in plan.scheduled}
        sampled = self.runner.execute(plan)
        self.num_computed_tokens_total += plan.num_batched_tokens
        finished = {r.request_id for r in self.scheduler.update_from_output(plan, sampled)}
        self._collect_kv_events()
        outputs = []
        for item in plan.scheduled:
            request = item.request
            rid = request.request_id
            new_ids = request.output_token_ids[before[rid] :]
            state = self._texts.get(rid)
            if not new_ids or state is None:
                continue
            done = rid in finished
            delta = state.advance(new_ids, finishing=done)
            if state.stopped:
                if done:  # the stop string arrived with the last allowed token: still a stop
                    request.status = RequestStatus.FINISHED_STOPPED
                    request.finish_reason = RequestStatus.FINISHED_STOPPED.finish_reason
                else:
                    self.scheduler.finish_request(rid, RequestStatus.FINISHED_STOPPED)
                    done = True
            if done:
                del self._texts[rid]
            outputs.append(
                RequestOutput(
                    request_id=rid,
                    new_token_ids=list(new_ids),
                    output_token_ids=list(request.output_token_ids),
                    text=state.emitted_text,
                    text_delta=delta,
                    finished=done,
                    finish_reason=request.finish_reason if done else None,
                    num_prompt_tokens=request.num_prompt_tokens,
                    num_cached_tokens=max(request.num_cached_tokens, 0),
                )
            )
        return outputs

    def _land_loads(self, buffers: TierBuffers) -> None:
        for request_id, ok in buffers.landed():
            self.scheduler.finish_load(request_id, ok)

    def tier_usage(self) -> list[dict[str, Any]]:
        """Per tier, GPU first: blocks held, capacity, hit tokens, evictions and, for the lower
        tiers, blocks moved in (offloads) and out (loads) with their bytes and seconds."""
        bm = self.block_manager
        bs = bm.block_size
        tiers = bm.tiers.tiers if bm.tiers is not None else []
        lower_hit_tokens = sum(t.counters.hits for t in tiers) * bs
        usage: list[dict[str, Any]] = [
            {
                "medium": MEDIUM_GPU,
                "num_blocks": bm.num_cached_blocks,
                "capacity_blocks": bm.num_blocks,
                "hit_tokens": self.scheduler.prefix_cache_hits - lower_hit_tokens,
                "evicted_blocks": bm.num_evictions,
            }
        ]
        transfers = self.tier_buffers.stats() if self.tier_buffers is not None else {}
        for tier in tiers:
            moved = transfers[tier.medium]
            usage.append(
                {
                    "medium": tier.medium,
                    "num_blocks": len(tier),
                    "capacity_blocks": tier.num_blocks,
                    "hit_tokens": tier.counters.hits * bs,
                    "evicted_blocks": tier.counters.evicted,
                    "offload_blocks": moved.offload_blocks,
                    "offload_bytes": moved.offload_bytes,
                    "offload_seconds": moved.offload_seconds,
                    "load_blocks": moved.load_blocks,
                    "load_bytes": moved.load_bytes,
                    "load_seconds": moved.load_seconds,
                }
            )
        return usage

    def close(self) -> None:
        """Stop the load thread (after the loads in flight) and write the disk tier's manifest."""
        if self.tier_buffers is not None:
            self.tier_buffers.close()
            if self._manifest is not None:
                self._manifest.close(self._disk_listing(self.tier_buffers))

    # -- warm restart ------------------------------------------------------------------------
    def _open_disk_tier(self, loaded: LoadedModel) -> ManifestWriter:
        cfg, buffers = self.config, self.tier_buffers
        assert buffers is not None and buffers.disk_file is not None
        header = manifest_header(
            model_identity(cfg.model, loaded.config, cfg.seed),
            dtype=str(loaded.dtype).removeprefix("torch."),
            block_size=cfg.block_size,
            block_layout=list(buffers.slot_shape),
            bytes_per_block=buffers.bytes_per_block,
            num_blocks=cfg.num_disk_blocks,
            hash_algo=cfg.hash_algo,
        )
        path = manifest_path(buffers.disk_file)
        listed = read_manifest(path, header)
        if listed:
            kept = buffers.verify_disk(listed)
            if len(kept) < len(listed):
                log.warning(
                    "dropping %d of the %d blocks of the disk KV tier in %s: their bytes changed "
                    "after the manifest was written (overwritten or torn)",
                    len(listed) - len(kept),
                    len(listed),
                    path.parent,
                )
            entries = [SlotEntry(s.slot, s.block_hash, s.parent, s.tokens) for s in kept]
            try:
                self.block_manager.restore_tier(MEDIUM_STORAGE, entries)
            except ValueError as exc:
                log.warning("discarding the disk KV tier in %s: %s", path.parent, exc)
                buffers.disk_checksums = [None] * cfg.num_disk_blocks
            else:
                log.info("restored %d blocks of the disk KV tier in %s", len(kept), path.parent)
        return ManifestWriter(path, buffers.disk_file, header)

    def _disk_listing(self, buffers: TierBuffers) -> list[ManifestSlot]:
        """The disk tier's slots with their checksums (after the queued offloads: every listed
        slot's bytes, and so its checksum, are its block's)."""
        buffers.offload(self.block_manager.take_offloads())
        tiers = self.block_manager.tiers
        assert tiers is not None
        checksums = buffers.disk_checksums
        listing = []
        for entry in tiers.snapshot(MEDIUM_STORAGE):
            checksum = checksums[entry.slot]
            assert checksum is not None, f"disk slot {entry.slot} was never written"
            listing.append(ManifestSlot(*entry, checksum))
        return listing

    def _maybe_write_manifest(self, buffers: TierBuffers) -> None:
        now = time.monotonic()
        if (
            buffers.disk_writes == self._manifest_writes
            or now < self._manifest_at + MANIFEST_INTERVAL_S
        ):
            return
        assert self._manifest is not None
        listing = self._disk_listing(buffers)
        if self._manifest.write(listing):
            self._manifest_at, self._manifest_writes = now, buffers.disk_writes

    def generate(
        self,
        prompts: Sequence[str | Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Run prompts to completion; the final output of each, in order."""
        if params is None or isinstance(params, SamplingParams):
            params_list = [params or SamplingParams()] * len(prompts)
        else:
            params_list = list(params)
        if len(params_list) != len(prompts):
            raise ValueError("need one SamplingParams per prompt")
        ids = [f"generate-{next(self._auto_ids)}" for _ in prompts]
        added: list[str] = []
        try:
            for rid, prompt, p in zip(ids, prompts, params_list, strict=True):
                self.add_request(rid, prompt, p)
                added.append(rid)
        except InvalidRequestError:
            for rid in added:
                self.abort(rid)
            raise
        final: dict[str, RequestOutput] = {}
        while len(final) < len(ids):
            for out in self.step():
                if out.finished:
                    final[out.request_id] = out
        return [final[rid] for rid in ids]

    # -- KV events ---------------------------------------------------------------------------
    def _collect_kv_events(self) -> None:
        self._pending_events.extend(self.block_manager.take_events())
        if len(self._pending_events) > MAX_PENDING_KV_EVENTS:
            self._pending_events = []
            self._event_seq += 1  # the dropped batch: consumers see the gap

    @property
    def num_pending_kv_events(self) -> int:
        return len(self._pending_events)

    def take_kv_event_batch(self) -> KVEventBatch | None:
        self._collect_kv_events()
        if not self._pending_events:
            return None
        batch = KVEventBatch(seq=self._event_seq, ts=time.time(), events=self._pending_events)
        self._pending_events = []
        self._event_seq += 1
        return batch

    # -- migration ---------------------------------------------------------------------------
    def _request(self, request_id: str) -> Request:
        request = self.scheduler.requests.get(request_id)
        if request is None:
            raise KeyError(f"unknown or finished request {request_id!r}")
        return request

    def request_blocks(self, request_id: str) -> tuple[list[int], int]:
        """A live request's block ids and how many of its tokens have KV computed."""
        request = self._request(request_id)
        return list(self.block_manager.block_ids(request_id)), request.num_computed_tokens

    def suspend(self, request_id: str) -> None:
        self.scheduler.suspend(request_id)

    def resume(self, request_id: str) -> None:
        self.scheduler.resume(request_id)

    def read_kv(self, block_ids: Sequence[int]) -> torch.Tensor:
        return self.runner.read_kv(list(block_ids))

    def write_kv(self, block_ids: Sequence[int], data: torch.Tensor) -> None:
        self.runner.write_kv(list(block_ids), data)

    def release_migrated(self, request_id: str) -> None:
        """The request now lives on another instance: end it here and free its blocks."""
        self._request(request_id)
        self._texts.pop(request_id, None)
        self.scheduler.finish_request(request_id, RequestStatus.FINISHED_MIGRATED)

    def reserve_blocks(self, owner_id: str, num_blocks: int) -> list[int] | None:
        """Fresh blocks for an incoming migration, held under `owner_id`; None if they do not fit."""
        blocks = self.block_manager.reserve_blocks(owner_id, num_blocks)
        if self.tier_buffers is not None:  # evicted blocks go down before KV is written over them
            self.tier_buffers.offload(self.block_manager.take_offloads())
        return blocks

    def free_reservation(self, owner_id: str) -> None:
        self.block_manager.free_owner(owner_id)

    def export_request_state(self, request_id: str) -> dict[str, Any]:
        """Everything a destination needs to continue the request exactly (JSON-serialisable)."""
        request = self._request(request_id)
        # Stop-string progress: the text already streamed (the rest is rebuilt from the ids).
        return {**request.to_state(), "emitted_text": self._texts[request_id].emitted_text}

    def adopt_request(
        self, state: dict[str, Any], block_ids: Sequence[int], reservation_id: str | None = None
    ) -> Request:
        """Join a migrated request whose KV is already written into `block_ids`.

        The blocks must be held by `reservation_id` (from `reserve_blocks`, handed over here) or
        already by the request id itself.
        """
        rid = state["request_id"]
        if rid in self.scheduler.requests:
            raise ValueError(f"request id {rid!r} is already in use")
        lora = state.get("lora_name")
        if lora is not None and lora not in self.lora_adapters:
            raise ValueError(f"this instance does not serve the request's LoRA adapter {lora!r}")
        request = Request.from_state(state, self.config.block_size, self.config.hash_algo)
        params = request.sampling_params
        bm = self.block_manager
        owner = reservation_id if reservation_id is not None else rid
        if list(bm.block_ids(owner)) != list(block_ids):
            raise ValueError(f"blocks {list(block_ids)} are not held by {owner!r}")
        if bm.blocks_needed(request.num_computed_tokens) > len(block_ids):
            raise ValueError("the blocks do not cover the request's computed tokens")
        text = self._new_text_state(params)
        text.advance(request.output_token_ids, finishing=False)
        emitted = state.get("emitted_text", "")
        if not text.text.startswith(emitted):
            raise ValueError("emitted_text does not match the request's output tokens")
        text.num_emitted = len(emitted)
        # Every check passed: only now do the blocks change hands (nothing leaks on refusal).
        if reservation_id is not None:
            bm.transfer_owner(reservation_id, rid)
        self.scheduler.adopt(request)
        self._texts[rid] = text
        return request
