"""A bounded disk tier of whole KV blocks: one preallocated file, LRU by put, that survives a restart.

Contract:
- `DiskStore(directory, key, capacity_blocks, block_bytes, meta_bytes)` keeps ``manifest.json``
  (`key`, a str -> str map naming what the blocks are: model, block size, layout, hash seed, size)
  and ``blocks.bin`` (slot i at ``i * slot_bytes``: a header, then the block). A manifest that is
  absent, unreadable or names another key discards the file's blocks (`discarded` says why) and
  the store starts empty; the file is preallocated to its full size.
- Policy: `kv_pull.BlockIndex`'s, exactly. `put(hash, meta, block)` adds (evicting the least
  recently put) or touches, and returns (added, evicted hashes); `entries(...)` reads a directory's
  (hash, meta) in that LRU order without writing, so a mirror fed them and then the same puts
  holds what the store holds. Reopened, the store resumes the order (sequence numbers in headers).
- `get(hash)` is the block, or None when absent, overwritten while it was read, or corrupt (crc32);
  nothing is touched. One writer thread (`put`), any number of readers. Standard library only.
"""

from __future__ import annotations

import json
import os
import struct
import threading
import zlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

from kvherd.kv_pull import BlockIndex

MANIFEST = "manifest.json"
BLOCKS = "blocks.bin"
MAX_HASH_BYTES = 64
_MAGIC = b"KVB1"
# magic, crc32 of the rest of the header, crc32 of the block, sequence, hash length, meta length
_HEADER = struct.Struct(">4sIIQHI")


def header_bytes(meta_bytes: int) -> int:
    return _HEADER.size + MAX_HASH_BYTES + meta_bytes


@dataclass(slots=True)
class _Slot:
    block_hash: bytes
    meta: bytes
    data_crc: int
    seq: int


def _pack_header(slot: _Slot, size: int) -> bytes:
    rest = struct.pack(">IQHI", slot.data_crc, slot.seq, len(slot.block_hash), len(slot.meta))
    body = rest + slot.block_hash + slot.meta
    return (_MAGIC + struct.pack(">I", zlib.crc32(body)) + body).ljust(size, b"\0")


def _unpack_header(raw: bytes) -> _Slot | None:
    magic, crc, data_crc, seq, hash_len, meta_len = _HEADER.unpack_from(raw)
    end = _HEADER.size + hash_len + meta_len
    if magic != _MAGIC or hash_len > MAX_HASH_BYTES or end > len(raw):
        return None
    if zlib.crc32(raw[8:end]) != crc:
        return None
    block_hash = raw[_HEADER.size : _HEADER.size + hash_len]
    return _Slot(block_hash, raw[_HEADER.size + hash_len : end], data_crc, seq)


def _read_manifest(directory: Path) -> dict[str, str] | None:
    try:
        manifest = json.loads((directory / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    return manifest if isinstance(manifest, dict) else None


def _scan(fd: int, capacity_blocks: int, slot_bytes: int, head: int) -> Iterator[tuple[int, _Slot]]:
    for i in range(capacity_blocks):
        raw = os.pread(fd, head, i * slot_bytes)
        if len(raw) == head and (slot := _unpack_header(raw)) is not None:
            yield i, slot


def entries(
    directory: str | Path,
    key: Mapping[str, str],
    capacity_blocks: int,
    meta_bytes: int,
    block_bytes: int,
) -> list[tuple[bytes, bytes]]:
    """(hash, meta) of the blocks a `DiskStore` of these arguments would start with, least
    recently put first; empty when the manifest does not match. Reads only."""
    path = Path(directory)
    if _read_manifest(path) != dict(key):
        return []
    head = header_bytes(meta_bytes)
    try:
        fd = os.open(path / BLOCKS, os.O_RDONLY)
    except OSError:
        return []
    try:
        found = list(_scan(fd, capacity_blocks, head + block_bytes, head))
    finally:
        os.close(fd)
    return [(slot.block_hash, slot.meta) for _i, slot in _dedup(found)]


def _dedup(found: list[tuple[int, _Slot]]) -> list[tuple[int, _Slot]]:
    """One slot per hash (the latest; a crash between two writes can leave two), by sequence."""
    latest = {slot.block_hash: (i, slot) for i, slot in found}
    return sorted(latest.values(), key=lambda s: s[1].seq)


class DiskStore:
    """The disk tier of one vLLM worker (see the module contract)."""

    def __init__(
        self,
        directory: str | Path,
        key: Mapping[str, str],
        capacity_blocks: int,
        block_bytes: int,
        meta_bytes: int,
    ) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.block_bytes = block_bytes
        self.meta_bytes = meta_bytes
        self._head = header_bytes(meta_bytes)
        self.slot_bytes = self._head + block_bytes
        self._index = BlockIndex(capacity_blocks)
        self.capacity_blocks = self._index.capacity_blocks
        self._slots: list[_Slot | None] = [None] * self.capacity_blocks
        self._where: dict[bytes, int] = {}
        self._generation = [0] * self.capacity_blocks  # bumped whenever a slot is rewritten
        self._lock = threading.Lock()
        self.discarded: str | None = None
        manifest = _read_manifest(self.directory)
        path = self.directory / BLOCKS
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        size = self.capacity_blocks * self.slot_bytes
        if manifest != dict(key):
            if manifest is not None or os.fstat(self._fd).st_size:
                self.discarded = _difference(manifest, key)
            os.ftruncate(self._fd, 0)  # every header zero: an empty tier
            self._write_manifest(key)
        else:
            for i, slot in _dedup(
                list(_scan(self._fd, self.capacity_blocks, self.slot_bytes, self._head))
            ):
                self._index.put(slot.block_hash)
                self._slots[i], self._where[slot.block_hash] = slot, i
        if os.fstat(self._fd).st_size < size:
            os.ftruncate(self._fd, size)
            if hasattr(os, "posix_fallocate"):
                os.posix_fallocate(self._fd, 0, size)
        self._seq = 1 + max((s.seq for s in self._slots if s is not None), default=0)
        self._free = [i for i, s in enumerate(self._slots) if s is None][::-1]

    def _write_manifest(self, key: Mapping[str, str]) -> None:
        tmp = self.directory / (MANIFEST + ".tmp")
        tmp.write_text(json.dumps(dict(key), indent=1, sort_keys=True))
        os.replace(tmp, self.directory / MANIFEST)

    def __len__(self) -> int:
        return len(self._where)

    def put(self, block_hash: bytes, meta: bytes, block: bytes) -> tuple[bool, list[bytes]]:
        """Add or touch `block_hash` (its `meta` and `block` are written when it is new)."""
        if len(block_hash) > MAX_HASH_BYTES or len(meta) > self.meta_bytes:
            raise ValueError(f"hash of {len(block_hash)} or meta of {len(meta)} bytes too long")
        if len(block) != self.block_bytes:
            raise ValueError(f"block of {len(block)} bytes, not {self.block_bytes}")
        with self._lock:
            added, evicted = self._index.put(block_hash)
            seq, self._seq = self._seq, self._seq + 1
            if not added:  # a touch: only the header's sequence number moves
                i = self._where[block_hash]
                slot = self._slots[i]
                assert slot is not None
                slot.seq = seq
                os.pwrite(self._fd, _pack_header(slot, self._head), i * self.slot_bytes)
                return False, []
            for dropped in evicted:
                j = self._where.pop(dropped)
                self._slots[j] = None
                self._generation[j] += 1
                self._free.append(j)
            i = self._free.pop()
            self._generation[i] += 1
        offset = i * self.slot_bytes
        slot = _Slot(block_hash, meta, zlib.crc32(block), seq)
        os.pwrite(self._fd, b"\0" * self._head, offset)  # a crash mid-write leaves no header
        os.pwrite(self._fd, block, offset + self._head)
        os.pwrite(self._fd, _pack_header(slot, self._head), offset)
        with self._lock:
            self._slots[i], self._where[block_hash] = slot, i
        return True, evicted

    def get(self, block_hash: bytes) -> bytes | None:
        with self._lock:
            i = self._where.get(block_hash)
            if i is None:
                return None
            generation, slot = self._generation[i], self._slots[i]
        assert slot is not None
        block = os.pread(self._fd, self.block_bytes, i * self.slot_bytes + self._head)
        with self._lock:
            if self._generation[i] != generation:
                return None  # evicted and rewritten while it was read
        return block if zlib.crc32(block) == slot.data_crc else None

    def close(self) -> None:
        os.close(self._fd)


def _difference(manifest: Mapping[str, str] | None, key: Mapping[str, str]) -> str:
    if manifest is None:
        return "no readable manifest"
    changed = sorted(set(manifest) | set(key))
    return ", ".join(
        f"{name} {manifest.get(name)!r} != {key.get(name)!r}"
        for name in changed
        if manifest.get(name) != key.get(name)
    )
