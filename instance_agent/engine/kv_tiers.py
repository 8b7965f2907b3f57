"""The torch side of the KV tiers: the host DRAM and disk block stores, and the copies the core orders.

Contract:
- `TierBuffers` allocates each lower tier as one tensor ``[slots, layers, 2, block_size, kv_heads,
  head_dim]`` (a block's KV contiguous per slot, the GPU cache's per-block layout, dtype alike):
  the CPU tier in host memory (pinned when the cache is on CUDA), the disk tier in one file made
  to its full size up front and memory-mapped (``torch.from_file(shared=True)``), so writes go to
  the file through the page cache and reads of cold slots come from disk.
- `offload(copies)` runs the core's offload copies (`BlockManager.take_offloads`) now, in order:
  the engine calls it before the forward pass that may overwrite an evicted block.
- `start_load(load)` runs a `KVLoad`'s copies (lower tier -> GPU blocks) on one worker thread (on
  CUDA: on a side stream, synchronised there), so the engine keeps stepping; `landed()` hands back
  the loads that ended, as (request id, ok), without blocking; `wait(timeout)` blocks until one
  ends or the time passes. A copy that raises ends its load not ok (the core recomputes).
  Both are safe against the forward pass by the core's rules: a load writes only blocks its
  request owns and reads only pinned slots.
- `stats` counts blocks, bytes and seconds moved, per tier and direction.
- Warm restart (`kv_manifest`): each disk slot's checksum (xxh3-64 of its bytes) is taken as it
  is written (`disk_checksums`, `disk_writes` counts the writes); `verify_disk` keeps the listed
  slots whose bytes still match their checksum and adopts those checksums.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
import xxhash

from instance_agent.engine.core.batch_scheduler import KVLoad
from instance_agent.engine.core.tiers import BlockCopy
from instance_agent.engine.kv_manifest import ManifestSlot
from kvherd.kv_events import MEDIUM_CPU, MEDIUM_GPU, MEDIUM_STORAGE

log = logging.getLogger(__name__)


@dataclass(slots=True)
class TransferStats:
    """Blocks, bytes and seconds moved into (offload) and out of (load) one tier."""

    offload_blocks: int = 0
    offload_bytes: int = 0
    offload_seconds: float = 0.0
    load_blocks: int = 0
    load_bytes: int = 0
    load_seconds: float = 0.0


@dataclass(slots=True)
class _Stats:
    by_medium: dict[str, TransferStats] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)


def _groups(copies: Sequence[BlockCopy]) -> list[list[BlockCopy]]:
    """Runs of consecutive copies between the same two media with no destination repeated:
    each run is one indexed copy, and running the runs in order is running the copies in order
    (a copy between the same two media never reads what another of its run writes)."""
    runs: list[list[BlockCopy]] = []
    seen: set[int] = set()
    for copy in copies:
        if runs:
            last = runs[-1][0]
            same = (last.src_medium, last.dst_medium) == (copy.src_medium, copy.dst_medium)
            if same and copy.dst not in seen:
                runs[-1].append(copy)
                seen.add(copy.dst)
                continue
        runs.append([copy])
        seen = {copy.dst}
    return runs


class TierBuffers:
    def __init__(
        self,
        kv_cache: torch.Tensor,
        num_cpu_blocks: int = 0,
        disk_file: str | Path | None = None,
        num_disk_blocks: int = 0,
    ) -> None:
        self.kv_cache = kv_cache  # [layers, 2, blocks, block_size, kv_heads, head_dim]
        layers, two, _, block_size, heads, head_dim = kv_cache.shape
        self.slot_shape = (layers, two, block_size, heads, head_dim)
        self.bytes_per_block = kv_cache[:, :, 0].numel() * kv_cache.element_size()
        self.stores: dict[str, torch.Tensor] = {}
        if num_cpu_blocks > 0:
            self.stores[MEDIUM_CPU] = torch.empty(
                (num_cpu_blocks, *self.slot_shape),
                dtype=kv_cache.dtype,
                pin_memory=kv_cache.device.type == "cuda",
            )
        if num_disk_blocks > 0:
            if disk_file is None:
                raise ValueError("a disk tier needs a file")
            self.stores[MEDIUM_STORAGE] = self._map_file(Path(disk_file), num_disk_blocks)
        self.disk_file = Path(disk_file) if disk_file is not None else None
        self.disk_checksums: list[int | None] = [None] * num_disk_blocks
        self.disk_writes = 0
        self._stats = _Stats({medium: TransferStats() for medium in self.stores})
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kv-load")
        self._stream = (
            torch.cuda.Stream(kv_cache.device) if kv_cache.device.type == "cuda" else None
        )
        self._in_flight: dict[Future[None], str] = {}

    def _map_file(self, path: Path, num_blocks: int) -> torch.Tensor:
        numel = num_blocks * self.kv_cache[:, :, 0].numel()
        nbytes = numel * self.kv_cache.element_size()
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "ab") as handle:  # (creates it; keeps what a previous run wrote)
            if os.fstat(handle.fileno()).st_size != nbytes:
                handle.truncate(0)
                # Claim the space now: a full disk fails the start, not a later offload.
                os.posix_fallocate(handle.fileno(), 0, nbytes)
        flat = torch.from_file(str(path), shared=True, size=numel, dtype=self.kv_cache.dtype)
        return flat.view(num_blocks, *self.slot_shape)

    # -- offloads ----------------------------------------------------------------------------
    def offload(self, copies: Sequence[BlockCopy]) -> None:
        for run in _groups(copies):
            started = time.perf_counter()
            self._run(run)
            self._count(run[0].dst_medium, "offload", len(run), time.perf_counter() - started)

    def _run(self, run: list[BlockCopy]) -> None:
        src_medium, dst_medium = run[0].src_medium, run[0].dst_medium
        src = torch.tensor([c.src for c in run], dtype=torch.long)
        dst = torch.tensor([c.dst for c in run], dtype=torch.long)
        cache = self.kv_cache
        if src_medium == MEDIUM_GPU:  # GPU blocks -> slots
            data = cache.index_select(2, src.to(cache.device)).permute(2, 0, 1, 3, 4, 5)
            self.stores[dst_medium].index_copy_(0, dst, data.to("cpu"))
        elif dst_medium == MEDIUM_GPU:  # slots -> GPU blocks
            data = self.stores[src_medium].index_select(0, src).permute(1, 2, 0, 3, 4, 5)
            cache.index_copy_(2, dst.to(cache.device), data.to(cache.device, non_blocking=True))
        else:  # slots -> slots (CPU -> disk)
            self.stores[dst_medium].index_copy_(
                0, dst, self.stores[src_medium].index_select(0, src)
            )
        if dst_medium == MEDIUM_STORAGE:
            for copy in run:
                self.disk_checksums[copy.dst] = self._checksum(copy.dst)
            self.disk_writes += len(run)

    def _checksum(self, slot: int) -> int:
        data = self.stores[MEDIUM_STORAGE][slot].view(torch.uint8).numpy()
        return xxhash.xxh3_64_intdigest(data.data)

    def verify_disk(self, listed: Sequence[ManifestSlot]) -> list[ManifestSlot]:
        """The listed disk slots whose bytes match their checksum (reads each once)."""
        kept = []
        for entry in listed:
            in_range = 0 <= entry.slot < len(self.disk_checksums)
            if in_range and self._checksum(entry.slot) == entry.checksum:
                self.disk_checksums[entry.slot] = entry.checksum
                kept.append(entry)
        return kept

    def _count(self, medium: str, direction: str, blocks: int, seconds: float) -> None:
        with self._stats.lock:
            stats = self._stats.by_medium[medium]
            if direction == "offload":
                stats.offload_blocks += blocks
                stats.offload_bytes += blocks * self.bytes_per_block
                stats.offload_seconds += seconds
            else:
                stats.load_blocks += blocks
                stats.load_bytes += blocks * self.bytes_per_block
                stats.load_seconds += seconds

    def stats(self) -> dict[str, TransferStats]:
        with self._stats.lock:
            return {medium: replace(s) for medium, s in self._stats.by_medium.items()}

    # -- loads -------------------------------------------------------------------------------
    @property
    def num_in_flight(self) -> int:
        return len(self._in_flight)

    def start_load(self, load: KVLoad) -> None:
        self._in_flight[self._worker.submit(self._load, load.copies)] = load.request_id

    def _load(self, copies: list[BlockCopy]) -> None:
        stream = self._stream
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            for run in _groups(copies):
                started = time.perf_counter()
                self._run(run)
                if stream is not None:
                    stream.synchronize()  # done means landed: the forward may read it next
                self._count(run[0].src_medium, "load", len(run), time.perf_counter() - started)

    def landed(self) -> list[tuple[str, bool]]:
        done = [f for f in self._in_flight if f.done()]
        ended = []
        for future in done:
            request_id = self._in_flight.pop(future)
            error = future.exception()
            if error is not None:
                log.warning("loading the KV of %s failed, recomputing it: %r", request_id, error)
            ended.append((request_id, error is None))
        return ended

    def wait(self, timeout: float) -> None:
        if self._in_flight:
            wait(list(self._in_flight), timeout=timeout, return_when=FIRST_COMPLETED)

    def close(self) -> None:
        self._worker.shutdown(wait=True)
