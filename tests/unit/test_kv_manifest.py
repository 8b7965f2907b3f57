"""The disk tier's manifest: written atomically, read back only under the same header."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from instance_agent.engine.config import PRESETS
from instance_agent.engine.kv_manifest import (
    ManifestSlot,
    manifest_header,
    manifest_path,
    model_identity,
    read_manifest,
    write_manifest,
)


def header(seed: int = 0, block_size: int = 16) -> dict[str, object]:
    return manifest_header(
        model_identity("tiny", PRESETS["tiny"], seed),
        dtype="float32",
        block_size=block_size,
        block_layout=[2, 2, block_size, 2, 32],
        bytes_per_block=1024,
        num_blocks=4,
        hash_algo="xxh3_64",
    )


SLOTS = [
    ManifestSlot(2, 2**64 - 1, None, bytes(range(64)), 7),
    ManifestSlot(0, 5, 2**64 - 1, b"\1" * 64, 2**63),
]


def test_a_manifest_reads_back_exactly_under_its_header(tmp_path: Path) -> None:
    data = tmp_path / "kvherd-kv-a.bin"
    data.write_bytes(bytes(4096))
    path = manifest_path(data)
    assert path.name == "kvherd-kv-a.json"
    write_manifest(path, data, header(), SLOTS)
    assert read_manifest(path, header()) == SLOTS
    assert sorted(p.name for p in tmp_path.iterdir()) == [data.name, path.name]  # no temp left


@pytest.mark.parametrize(
    ("now", "named"),
    [(header(seed=1), "weights 'random init, seed 0'"), (header(block_size=8), "block_size 16")],
)
def test_another_header_or_a_broken_file_discards_it_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, now: dict[str, object], named: str
) -> None:
    data = tmp_path / "kv.bin"
    data.write_bytes(bytes(4096))
    path = manifest_path(data)
    write_manifest(path, data, header(), SLOTS)
    with caplog.at_level(logging.WARNING):
        assert read_manifest(path, now) is None
    assert named in caplog.text and not path.exists()
    path.write_text('{"format": 1, "slots": [[0, "zz"]]')  # a manifest cut short
    with caplog.at_level(logging.WARNING):
        assert read_manifest(path, header()) is None
    assert "unreadable manifest" in caplog.text and not path.exists()
    assert read_manifest(path, header()) is None  # none at all: a cold start, no warning
