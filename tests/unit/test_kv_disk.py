"""`kvherd.kv_disk.DiskStore`: LRU exactly as `BlockIndex`, restart, manifest, torn reads."""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest

from kvherd.kv_disk import DiskStore, entries
from kvherd.kv_pull import BlockIndex

KEY = {"model": "m", "block_size": "4"}
BLOCK_BYTES = 64
META = 32


def _block(i: int) -> bytes:
    return bytes([i % 256]) * BLOCK_BYTES


def _hash(i: int) -> bytes:
    return i.to_bytes(32, "big")


def test_lru_matches_a_block_index_and_survives_a_reopen(tmp_path: Path) -> None:
    store = DiskStore(tmp_path, KEY, 8, BLOCK_BYTES, META)
    mirror = BlockIndex(8)
    rng = random.Random(0)
    for _ in range(200):
        i = rng.randrange(20)
        assert store.put(_hash(i), b"m%d" % i, _block(i)) == mirror.put(_hash(i))
    held = [h for h in map(_hash, range(20)) if h in mirror]
    assert len(store) == len(held) == 8
    assert all(store.get(h) == _block(int.from_bytes(h, "big")) for h in held)
    assert store.get(_hash(99)) is None
    store.close()

    listed = entries(tmp_path, KEY, 8, META, BLOCK_BYTES)
    reopened = DiskStore(tmp_path, KEY, 8, BLOCK_BYTES, META)
    assert reopened.discarded is None and len(reopened) == 8
    assert {h for h, _meta in listed} == set(held)
    assert all(meta == b"m%d" % int.from_bytes(h, "big") for h, meta in listed)
    # Same LRU order: a mirror fed the listing evicts what the reopened store evicts.
    restarted = BlockIndex(8)
    for h, _meta in listed:
        restarted.put(h)
    for i in range(30, 35):
        assert reopened.put(_hash(i), b"", _block(i)) == restarted.put(_hash(i))


def test_another_manifest_discards_the_blocks(tmp_path: Path) -> None:
    store = DiskStore(tmp_path, KEY, 4, BLOCK_BYTES, META)
    store.put(_hash(1), b"", _block(1))
    store.close()
    other = {**KEY, "model": "other"}
    assert entries(tmp_path, other, 4, META, BLOCK_BYTES) == []
    fresh = DiskStore(tmp_path, other, 4, BLOCK_BYTES, META)
    assert fresh.discarded == "model 'm' != 'other'"
    assert len(fresh) == 0 and fresh.get(_hash(1)) is None
    assert DiskStore(tmp_path / "new", KEY, 4, BLOCK_BYTES, META).discarded is None


def test_a_slot_rewritten_during_a_read_or_corrupt_reads_as_missing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = DiskStore(tmp_path, KEY, 1, BLOCK_BYTES, META)
    store.put(_hash(1), b"", _block(1))
    pread = os.pread

    def pread_during_a_put(fd: int, n: int, offset: int) -> bytes:
        store._generation[0] += 1  # what a put of another block into this slot does
        return pread(fd, n, offset)

    monkeypatch.setattr(os, "pread", pread_during_a_put)
    assert store.get(_hash(1)) is None
    monkeypatch.undo()
    assert store.get(_hash(1)) == _block(1)
    store.put(_hash(2), b"", _block(2))
    with open(tmp_path / "blocks.bin", "r+b") as handle:
        handle.seek(store.slot_bytes - 1)
        handle.write(b"\xff")
    assert store.get(_hash(2)) is None
