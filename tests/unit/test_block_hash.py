"""Block hashing: stable across processes, chained, salted in the first block, slice-consistent."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kvherd.block_hash import block_hash_chain, hash_block

TOKENS = [(i * 7919) % 50_000 for i in range(100)]


def _chained_one_by_one(
    tokens: list[int], block_size: int, salt: str | None, algo: str
) -> list[int]:
    hashes: list[int] = []
    parent = None
    for i in range(len(tokens) // block_size):
        extra = (salt,) if (i == 0 and salt) else None
        parent = hash_block(parent, tokens[i * block_size : (i + 1) * block_size], extra, algo)  # type: ignore[arg-type]
        hashes.append(parent)
    return hashes


@pytest.mark.parametrize("algo", ["xxh3_64", "sha256"])
def test_stable_across_processes(algo: str) -> None:
    code = (
        "import json, sys; from kvherd.block_hash import block_hash_chain;"
        f"print(json.dumps(block_hash_chain({TOKENS!r}, 16, 'tenant-a', {algo!r})))"
    )
    # A different PYTHONHASHSEED in the child proves Python's hash() plays no part.
    child = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        env={"PYTHONHASHSEED": "12345", "PATH": ""},
    )
    assert json.loads(child.stdout) == block_hash_chain(TOKENS, 16, "tenant-a", algo)  # type: ignore[arg-type]


@pytest.mark.parametrize("algo", ["xxh3_64", "sha256"])
@pytest.mark.parametrize("salt", [None, "tenant-a"])
def test_chain_equals_block_by_block_hashing(algo: str, salt: str | None) -> None:
    assert block_hash_chain(TOKENS, 16, salt, algo) == _chained_one_by_one(TOKENS, 16, salt, algo)  # type: ignore[arg-type]


def test_salt_changes_every_hash_and_chaining_covers_the_prefix() -> None:
    plain = block_hash_chain(TOKENS, 16)
    salted = block_hash_chain(TOKENS, 16, "tenant-a")
    assert len(plain) == 6 and all(a != b for a, b in zip(plain, salted, strict=True))
    assert block_hash_chain(TOKENS, 16, "tenant-b") != salted
    # Same last block after a different first block: a different hash (chained, not per-block).
    other = [1] * 16 + TOKENS[16:]
    assert block_hash_chain(other, 16)[-1] != plain[-1]
    assert block_hash_chain(other, 16)[1:] != plain[1:]


def test_partial_blocks_are_not_hashed_and_incremental_extension_agrees() -> None:
    assert len(block_hash_chain(TOKENS[:31], 16)) == 1
    full = block_hash_chain(TOKENS, 16, "s")
    assert block_hash_chain(TOKENS, 16, "s", start=3, parent_hash=full[2]) == full[3:]
    with pytest.raises(ValueError):
        block_hash_chain(TOKENS, 16, algo="md5")  # type: ignore[arg-type]


def test_hash_values_are_pinned() -> None:
    """The values themselves, as every engine, proxy and simulator version must compute them (a
    faster implementation that changed one bit would split the fleet's view of the cache)."""
    assert block_hash_chain(TOKENS, 16)[:3] == [
        12082738089873921480,
        10013886143760948566,
        12019207723969392509,
    ]
    assert block_hash_chain(TOKENS, 16, "tenant-a")[-1] == 8416099663351977434
    assert block_hash_chain(TOKENS, 16, algo="sha256")[-1] == 17187645167114028184
    assert block_hash_chain(TOKENS, 4, "s", start=5, parent_hash=123)[:2] == [
        6209169282310322803,
        8529919894438526216,
    ]
    # One block of a long prompt hashed alone agrees with the whole chain.
    long_prompt = [(i * 104729) % 32000 for i in range(4096)]
    chain = block_hash_chain(long_prompt, 16, "t")
    assert hash_block(chain[99], long_prompt[1600:1616]) == chain[100]
