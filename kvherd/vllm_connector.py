"""kvherd's KV connector for vLLM (0.32 API): whole-block prefix pulls, a host and a disk tier.

Contract (loaded by vLLM's own python; see vllm_connector.md for the flags and the verified facts):
- Every worker copies each full block its engine computes or loads into a bounded host
  `kv_pull.BlockStore` (``store_mib``, default 512) after the forward that wrote it, and serves
  it, and its disk tier, on ``port`` (0 or absent: serves nothing) to other workers.
- Host tier (``host_tier``, default on): vLLM's scheduler mirrors the store (`kv_pull.BlockIndex`)
  and announces it on vLLM's KV event stream (``BlockStored``/``BlockRemoved``, ``medium`` "CPU");
  a prompt whose prefix vLLM's pool lost but a tier holds loads it (``{"kvherd_host": ...}``).
- Disk tier (``disk_dir``, ``disk_mib``, default 1024): blocks the host store evicts go to a
  `kv_disk.DiskStore` (``medium`` "STORAGE"); it survives a restart when its manifest matches
  (`_storage_key`; else a WARNING and it starts empty), and a started connector announces it.
- ``{"kvherd_pull": {"from": "tcp://host:port", "tokens": N}}`` in a request's
  ``kv_transfer_params`` loads (asynchronously: WAITING_FOR_REMOTE_KVS) the full prompt blocks past
  its local hit, up to N tokens, from that server, then prefills only the rest.
- Any failed load (refused, unreachable, short stream, missing block, ``pull_timeout_s``) recomputes
  (``kv_load_failure_policy`` must be "recompute"); a request loads at most once; nothing stays
  pinned. Its response says ``{"kvherd_pull"|"kvherd_host": {"outcome": ..., "tokens": n}}``.
- Trust: with a fleet token (`fleet_token.FLEET_TOKEN_ENV` in vLLM's environment, else
  ``fleet_token`` in the extra config) the block wire is authenticated (`kv_pull`): a peer that
  fails the check is refused as a source (the load fails ``untrusted``, recomputes) and as a
  client (``vllm:kvherd_connector_refused_requests_total``). Without one the wire is open.
- Metrics through vLLM's `KVConnectorStats` route: ``vllm:kvherd_connector_*`` on ``/metrics``.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections import Counter
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from vllm.distributed.kv_events import (
    MEDIUM_CPU,
    MEDIUM_STORAGE,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
)
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)
from vllm.v1.core.kv_cache_utils import DEFAULT_NONE_HASH_SEED, maybe_convert_block_hash

from kvherd.fleet_token import FLEET_TOKEN_ENV
from kvherd.kv_disk import DiskStore, entries
from kvherd.kv_pull import BlockIndex, BlockServer, BlockStore, Pull, PullError, fetch_blocks

logger = logging.getLogger("vllm.kvherd_connector")  # under vLLM's logger, so it reaches its log

DEFAULT_STORE_MIB = 512
DEFAULT_DISK_MIB = 1024
DEFAULT_PULL_TIMEOUT_S = 10.0
PARALLEL_PULLS = 2  # loader threads per worker: a slow source does not hold up the next pull
MAX_LORA_NAME = 256  # characters kept in a disk block's metadata (its header has a fixed size)


def _meta_bytes(block_size: int) -> int:
    """A disk slot's metadata budget: the JSON of `_block_meta` (token ids of up to 11 digits)."""
    return 2048 + 12 * block_size


@dataclass(frozen=True, slots=True)
class BlockLoad:
    """Load `hashes` from `source` (None: this worker's own tiers) into its `block_ids`."""

    request_id: str
    source: str | None
    hashes: list[bytes]
    block_ids: list[int]


@dataclass
class KvherdConnectorMetadata(KVConnectorMetadata):
    """One step's work for the workers: loads to start, and (hash, block id, meta) to keep
    (meta: `_block_meta`, empty without a disk tier)."""

    loads: list[BlockLoad] = field(default_factory=list)
    saves: list[tuple[bytes, int, bytes]] = field(default_factory=list)


@dataclass
class KvherdConnectorStats(KVConnectorStats):
    """Sums since the worker's last report: ``data`` maps "loads|TIER|OUTCOME|REASON" and
    "blocks|TIER", "bytes|TIER", "seconds|TIER" (TIER: peer, cpu, disk), and "refused" (block
    requests without the fleet token's MAC) to numbers."""

    def reset(self) -> None:
        self.data.clear()

    def add(self, key: str, value: float) -> None:
        self.data[key] = self.data.get(key, 0) + value

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for key, value in other.data.items():
            self.add(key, value)
        return self

    def reduce(self) -> dict[str, int | float]:
        return dict(self.data)

    def is_empty(self) -> bool:
        return not self.data


class KvherdPromMetrics(KVConnectorPromMetrics):
    """``vllm:kvherd_connector_{loads,load_blocks,load_bytes,load_seconds}_total`` per tier,
    ``vllm:kvherd_connector_refused_requests_total``."""

    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        tier = [*labelnames, "tier"]
        self._counters = {
            "loads": self._counter_cls(
                name="vllm:kvherd_connector_loads",
                documentation="kvherd connector loads by tier (peer, cpu, disk), outcome, reason",
                labelnames=[*tier, "outcome", "reason"],
            ),
            "blocks": self._counter_cls(
                name="vllm:kvherd_connector_load_blocks",
                documentation="KV blocks the kvherd connector loaded, by the tier they came from",
                labelnames=tier,
            ),
            "bytes": self._counter_cls(
                name="vllm:kvherd_connector_load_bytes",
                documentation="KV bytes the kvherd connector loaded, by the tier they came from",
                labelnames=tier,
            ),
            "seconds": self._counter_cls(
                name="vllm:kvherd_connector_load_seconds",
                documentation="Seconds kvherd connector loads took (failed ones too), by tier",
                labelnames=tier,
            ),
            "refused": self._counter_cls(
                name="vllm:kvherd_connector_refused_requests",
                documentation="Block requests refused: no valid fleet token MAC",
                labelnames=labelnames,
            ),
        }

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        engine = self.per_engine_labelvalues[engine_idx]
        for key, value in transfer_stats_data.items():
            kind, *labels = key.split("|")
            counter = self._counters.get(kind)
            if counter is not None:
                counter.labels(*engine, *labels).inc(value)


@dataclass(slots=True)
class _Tracked:
    """The scheduler side's view of one live request."""

    request: Any  # vllm.v1.request.Request
    pull: Pull | None
    saved_blocks: int = 0  # blocks already handed to the workers to keep
    planned: tuple[int, int] | None = None  # (first block, blocks) the last match offered
    kind: str | None = None  # the load it got: "kvherd_pull" (a peer) or "kvherd_host" (its tiers)
    loaded_tokens: int = 0
    outcome: str | None = None  # "loading", then "loaded" or "failed"


def _storage_key(vllm_config: Any, kv_cache_config: Any, capacity: int) -> dict[str, str]:
    """What a disk tier's blocks are: a restart keeps them only if every field is the same.
    Both sides compute it from vLLM's configs alone, so they agree without talking."""
    spec = kv_cache_config.kv_cache_groups[0].kv_cache_spec
    layers = sum(len(group.layer_names) for group in kv_cache_config.kv_cache_groups)
    device = vllm_config.device_config.device_type
    isa = torch.backends.cpu.get_cpu_capability() if device == "cpu" else ""
    cache = vllm_config.cache_config
    seed = os.environ.get("PYTHONHASHSEED", DEFAULT_NONE_HASH_SEED)
    return {
        "format": "1",
        "model": str(vllm_config.model_config.model),
        "block_size": str(cache.block_size),
        "block_bytes": str(_config_block_bytes(kv_cache_config)),
        "layout": f"{spec.dtype}:{layers}x{spec.num_kv_heads}x{spec.head_size}:{device}:{isa}",
        "hash_seed": f"{cache.prefix_caching_hash_algo}:{seed}",
        "capacity_blocks": str(capacity),
    }


def _config_block_bytes(kv_cache_config: Any) -> int:
    return sum(t.size for t in kv_cache_config.kv_cache_tensors) // max(
        1, kv_cache_config.num_blocks
    )


def _parent_first(held: dict[bytes, bytes]) -> list[bytes]:
    """`held`'s hashes (insertion order) reordered so that a held parent precedes its children:
    an index chains a block to its parent, so a child announced first would be skipped."""
    done: set[bytes] = set()
    ordered: list[bytes] = []
    for block_hash in held:
        chain = []
        while block_hash in held and block_hash not in done:
            done.add(block_hash)
            chain.append(block_hash)
            parent = json.loads(held[block_hash])["parent"]
            block_hash = bytes.fromhex(parent) if parent else b""
        ordered += reversed(chain)
    return ordered


class _Tiers:
    """A `kv_pull.BlockSource` over the host store and then the disk tier, touching nothing."""

    def __init__(self, store: BlockStore, disk: DiskStore | None) -> None:
        self.store, self.disk = store, disk

    def get(self, block_hash: bytes) -> tuple[bytes | None, str]:
        block = self.store.get(block_hash)
        if block is None and self.disk is not None:
            return self.disk.get(block_hash), "disk"
        return block, "cpu"

    def prefix(self, hashes: Sequence[bytes]) -> list[bytes]:
        blocks = []
        for block_hash in hashes:
            block, _tier = self.get(block_hash)
            if block is None:
                break
            blocks.append(block)
        return blocks


class KvherdConnector(KVConnectorBase_V1):
    """Scheduler and worker sides of the kvherd connector (see the module contract).

    Mirror invariant: the scheduler's `BlockIndex` pair (host, disk) holds exactly the hashes
    the worker's `BlockStore` and `DiskStore` hold once the worker has run the saves of every
    step built so far. Both start from the same state (empty host; the disk entries of one
    directory, read in one LRU order, or nothing when the manifest does not match), and both apply
    the same operations in the same order: per saved block, a host put (a held hash is touched,
    a new one may evict the least recently put), then, per evicted hash in eviction order, a disk
    put (touch or add and evict). Loads and serving read without touching either tier. A block
    that changes between the scheduler's decision and the loader's read (evicted meanwhile) fails
    that one load, which recomputes; it never makes the mirror wrong.
    """

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
        # Both sides size the tiers from vLLM's KV config, so the scheduler's mirror is exact.
        block_bytes = max(1, _config_block_bytes(kv_cache_config))
        capacity = (int(extra.get("store_mib", DEFAULT_STORE_MIB)) << 20) // block_bytes
        self._host_tier = bool(extra.get("host_tier", True))
        disk_dir = extra.get("disk_dir")
        if disk_dir and not self._host_tier:
            raise ValueError("kvherd connector: disk_dir needs the host tier (host_tier true)")
        disk_capacity = (int(extra.get("disk_mib", DEFAULT_DISK_MIB)) << 20) // block_bytes
        key = _storage_key(vllm_config, kv_cache_config, disk_capacity)
        meta_bytes = _meta_bytes(self._block_size)
        # Scheduler side.
        self._tracked: dict[str, _Tracked] = {}
        self._ready_loads: list[BlockLoad] = []
        self._host_index = BlockIndex(capacity)
        self._disk_index: BlockIndex | None = None
        self._meta: dict[bytes, bytes] = {}  # `_block_meta` of the blocks of either tier (disk)
        self._events: list[KVCacheEvent] = []  # drained by vLLM every step (take_events)
        # Worker side.
        self._store = BlockStore(capacity)
        self._disk: DiskStore | None = None
        self._host_meta: dict[bytes, bytes] = {}  # `_block_meta` of the host store's blocks
        self._host = str(extra.get("host", "127.0.0.1"))
        self._port = int(extra.get("port", 0))
        self._pull_timeout_s = float(extra.get("pull_timeout_s", DEFAULT_PULL_TIMEOUT_S))
        self._token: str | None = os.environ.get(FLEET_TOKEN_ENV) or extra.get("fleet_token")
        self._layers: list[torch.Tensor] = []
        self._layout = ""
        self._block_bytes = 0
        self._server: BlockServer | None = None
        self._loader: ThreadPoolExecutor | None = None
        self._done_lock = threading.Lock()
        self._done: dict[str, bool] = {}  # request id -> loaded (False: failed)
        self._stats = KvherdConnectorStats()
        if not disk_dir:
            return
        # vLLM builds the worker's connector (which may discard the directory) before the
        # scheduler's, and the worker writes only once a step has run: the scheduler reads the
        # directory the worker will start from.
        if role == KVConnectorRole.WORKER:
            self._disk = DiskStore(disk_dir, key, disk_capacity, block_bytes, meta_bytes)
            if self._disk.discarded:
                logger.warning(
                    "kvherd disk tier %s: discarding its blocks, written for another setup (%s)",
                    disk_dir,
                    self._disk.discarded,
                )
            logger.info(
                "kvherd disk tier %s: %d of %d blocks held",
                disk_dir,
                len(self._disk),
                self._disk.capacity_blocks,
            )
            return
        self._disk_index = BlockIndex(disk_capacity)
        for block_hash, meta in entries(disk_dir, key, disk_capacity, meta_bytes, block_bytes):
            self._disk_index.put(block_hash)
            self._meta[block_hash] = meta
        # Announced at once: has_pending_push_work keeps vLLM stepping until they are published.
        for block_hash in _parent_first(self._meta):
            self._events.append(self._stored_event(block_hash, self._meta[block_hash], "STORAGE"))

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
            wanted = first + self._held_prefix(request.block_hashes[first:wanted])
        else:
            return 0, False
        if wanted <= first:
            return 0, False
        tracked.planned = (first, wanted - first)
        return (wanted - first) * size, True

    def _held_prefix(self, hashes: Sequence[bytes]) -> int:
        """How many of `hashes`, from the first, the host or the disk tier holds."""
        disk = self._disk_index
        n = 0
        while n < len(hashes) and (
            hashes[n] in self._host_index or (disk is not None and hashes[n] in disk)
        ):
            n += 1
        return n

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
                block_meta = self._block_meta(request, i) if self._host_tier else b""
                self._mirror_put(block_hash, block_meta)
                kept = block_meta if self._disk_index is not None else b""  # only disk needs it
                meta.saves.append((block_hash, block_ids[i], kept))
            tracked.saved_blocks = full
        return meta

    def _block_meta(self, request: Any, i: int) -> bytes:
        """What a `BlockStored` of block `i` of `request` says besides its hash, as JSON."""
        size = self._block_size
        lora = request.lora_request
        return json.dumps(
            {
                "parent": bytes(request.block_hashes[i - 1]).hex() if i else None,
                "tokens": list(request.all_token_ids[i * size : (i + 1) * size]),
                "lora_id": lora.adapter_id if lora else None,
                "lora_name": lora.name[:MAX_LORA_NAME] if lora else None,
            },
            separators=(",", ":"),
        ).encode()

    def _stored_event(self, block_hash: bytes, block_meta: bytes, medium: str) -> BlockStored:
        fields = json.loads(block_meta)
        parent = fields["parent"]
        return BlockStored(
            block_hashes=[maybe_convert_block_hash(block_hash)],
            parent_block_hash=maybe_convert_block_hash(bytes.fromhex(parent)) if parent else None,
            token_ids=fields["tokens"],
            block_size=self._block_size,
            lora_id=fields["lora_id"],
            medium=medium,
            lora_name=fields["lora_name"],
        )

    def _mirror_put(self, block_hash: bytes, block_meta: bytes) -> None:
        """The worker keeps this block: mirror it and announce it (and the blocks it pushes down
        a tier or out) as vLLM would a tier of its own, on vLLM's event stream."""
        added, evicted = self._host_index.put(block_hash)
        if not self._host_tier:
            return
        for moved in evicted if self._disk_index is not None else ():
            self._disk_put(moved)
        if evicted:
            hashes = [maybe_convert_block_hash(h) for h in evicted]
            self._events.append(BlockRemoved(block_hashes=hashes, medium=MEDIUM_CPU))
        if added:
            self._events.append(self._stored_event(block_hash, block_meta, MEDIUM_CPU))
            if self._disk_index is not None:
                self._meta[block_hash] = block_meta

    def _disk_put(self, block_hash: bytes) -> None:
        assert self._disk_index is not None
        added, dropped = self._disk_index.put(block_hash)
        if dropped:
            hashes = [maybe_convert_block_hash(h) for h in dropped]
            self._events.append(BlockRemoved(block_hashes=hashes, medium=MEDIUM_STORAGE))
            for gone in dropped:
                if gone not in self._host_index:
                    del self._meta[gone]
        if added:
            self._events.append(
                self._stored_event(block_hash, self._meta[block_hash], MEDIUM_STORAGE)
            )

    def take_events(self) -> list[KVCacheEvent]:
        events, self._events = self._events, []
        return events

    def has_pending_push_work(self) -> bool:
        return bool(self._events)  # the disk tier's announcement at start, before any request

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

    @classmethod
    def build_kv_connector_stats(
        cls, data: dict[str, Any] | None = None
    ) -> KVConnectorStats | None:
        return KvherdConnectorStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: Any,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVConnectorPromMetrics | None:
        return KvherdPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

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
        if self._disk is not None and self._disk.block_bytes != self._block_bytes:
            raise ValueError(
                f"kvherd connector: blocks of {self._block_bytes} bytes, vLLM's KV config says "
                f"{self._disk.block_bytes}"
            )
        isa = torch.backends.cpu.get_cpu_capability() if first.device.type == "cpu" else ""
        shape = "x".join(str(d) for d in first.shape[1:])
        self._layout = f"{first.dtype}:{shape}:{len(self._layers)}:{first.device.type}:{isa}"
        self._loader = ThreadPoolExecutor(PARALLEL_PULLS, thread_name_prefix="kvherd-pull")
        if self._port:
            source = _Tiers(self._store, self._disk)
            self._server = BlockServer(
                source,
                self._layout,
                self._host,
                self._port,
                token=self._token,
                on_refused=self._refused,
            )
            logger.info(
                "kvherd connector serving blocks on %s:%d (%s)",
                self._host,
                self._port,
                "fleet token required" if self._token else "open: no fleet token",
            )

    def _refused(self) -> None:
        logger.warning("kvherd block server refused a request without the fleet token's MAC")
        with self._done_lock:
            self._stats.add("refused", 1)

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

    def _load_local(self, load: BlockLoad, tiers: Counter[str]) -> None:
        source = _Tiers(self._store, self._disk)
        for i, block_hash in enumerate(load.hashes):
            block, tier = source.get(block_hash)
            if block is None:
                raise PullError(f"block {i} left this worker's tiers", "evicted")
            self._write_block(load.block_ids[i], memoryview(block))
            tiers[tier] += 1

    def _load(self, load: BlockLoad) -> None:
        started = time.monotonic()
        tiers: Counter[str] = Counter()  # blocks loaded, per tier they came from
        reason = ""

        def sink(i: int, data: memoryview) -> None:
            self._write_block(load.block_ids[i], data)

        try:
            if load.source is None:
                self._load_local(load, tiers)
            else:
                count = fetch_blocks(
                    load.source,
                    self._layout,
                    load.hashes,
                    self._block_bytes,
                    sink,
                    self._pull_timeout_s,
                    self._token,
                )
                if count < len(load.hashes):
                    raise PullError(
                        f"{load.source} holds {count} of {len(load.hashes)} blocks",
                        "missing_blocks",
                    )
                tiers["peer"] = count
            logger.info(
                "kvherd pull %s: %d blocks (%d bytes) from %s in %.3fs",
                load.request_id,
                sum(tiers.values()),
                sum(tiers.values()) * self._block_bytes,
                load.source or f"this worker's tiers {dict(tiers)}",
                time.monotonic() - started,
            )
        except PullError as exc:
            reason = exc.reason
            logger.warning("kvherd pull %s failed, recomputing: %s", load.request_id, exc)
        except Exception:  # a bug must not strand the request: report it failed
            reason = "crash"
            logger.exception("kvherd pull %s crashed, recomputing", load.request_id)
        self._record(load, tiers, reason, time.monotonic() - started)
        with self._done_lock:
            self._done[load.request_id] = not reason

    def _record(self, load: BlockLoad, tiers: Counter[str], reason: str, seconds: float) -> None:
        """A load's metrics: counted once, under its lowest tier (a peer; else disk if a block
        came from there or a failed one was last looked for there; else cpu); the blocks and
        bytes of a load that landed, per tier they came from."""
        lowest = "disk" if tiers["disk"] or (reason and self._disk is not None) else "cpu"
        tier = "peer" if load.source else lowest
        outcome = "failed" if reason else "loaded"
        with self._done_lock:
            self._stats.add(f"loads|{tier}|{outcome}|{reason}", 1)
            self._stats.add(f"seconds|{tier}", seconds)
            for name, blocks in tiers.items() if not reason else ():
                self._stats.add(f"blocks|{name}", blocks)
                self._stats.add(f"bytes|{name}", blocks * self._block_bytes)

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        with self._done_lock:
            if self._stats.is_empty():
                return None
            stats, self._stats = self._stats, KvherdConnectorStats()
        return stats

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
        for block_hash, block_id, block_meta in meta.saves:
            if self._store.touch(block_hash):
                continue  # the mirror touched it too
            evicted = self._store.put(block_hash, self._block_bytes_of(block_id))
            if self._disk is None:
                continue
            self._host_meta[block_hash] = block_meta
            for moved, block in evicted:
                self._disk.put(moved, self._host_meta.pop(moved), block)

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
        if self._disk is not None:
            self._disk.close()
