"""Chained block hashing: the one function that names a KV block everywhere in kvherd.

Contract:
- A block hash covers exactly one *full* block of `block_size` token ids. Partial blocks are never hashed.
- It is chained: ``hash_block(parent, tokens, extra)`` folds in the parent block's hash, so equal hashes
  mean equal whole prefixes, not just equal blocks.
- Extra keys (e.g. a tenant's cache salt) are folded into the *first* block only; since every later block
  chains on it, a salt changes every hash of the chain. A LoRA adapter's name is folded into *every*
  block (as vLLM does), ahead of the salt: `block_extra_keys` gives one block's keys.
- Hashes are 64-bit unsigned ints, stable across processes, machines and Python versions (xxh3-64 by
  default, sha256 truncated to 64 bits when selected). Python's ``hash()`` is never used.
- Token ids are hashed as uint32: ids outside ``[0, MAX_TOKEN_ID]`` raise `OverflowError`, so
  callers holding untrusted ids (the proxy) check them against `MAX_TOKEN_ID` first.

The engine, the proxy, the scheduler's prefix index and the simulator all call this module, so a block
hashed by any of them names the same KV block.
"""

from __future__ import annotations

import hashlib
import struct
from array import array
from collections.abc import Callable, Sequence
from functools import cache
from typing import Literal

import xxhash

BlockHash = int
HashAlgo = Literal["xxh3_64", "sha256"]

# The parent of the first block. A fixed constant (not random) keeps hashes stable across processes.
ROOT_PARENT_HASH: BlockHash = 0
MAX_TOKEN_ID = 2**32 - 1
_U64 = struct.Struct("<Q")


def _extra_bytes(extra_keys: Sequence[str | int | bytes] | None) -> bytes:
    if not extra_keys:
        return b""
    parts: list[bytes] = []
    for key in extra_keys:
        if isinstance(key, bytes):
            raw, tag = key, b"b"
        elif isinstance(key, str):
            raw, tag = key.encode("utf-8"), b"s"
        elif isinstance(key, int):
            raw, tag = str(key).encode("ascii"), b"i"
        else:
            raise TypeError(f"extra key must be str, int or bytes, not {type(key).__name__}")
        # Length-prefixed so ("ab", "c") and ("a", "bc") never collide.
        parts.append(tag + _U64.pack(len(raw)) + raw)
    return b"x" + b"".join(parts)


def hash_block(
    parent_hash: BlockHash | None,
    token_ids: Sequence[int],
    extra_keys: Sequence[str | int | bytes] | None = None,
    algo: HashAlgo = "xxh3_64",
) -> BlockHash:
    """Hash one full block given its parent's hash (None for the first block)."""
    tokens = array("I", token_ids)  # uint32: every vocabulary fits; rejects negative ids
    if tokens.itemsize != 4:  # pragma: no cover - platform guard
        raise RuntimeError("array('I') must be 32-bit")
    payload = (
        _U64.pack(ROOT_PARENT_HASH if parent_hash is None else parent_hash)
        + tokens.tobytes()
        + _extra_bytes(extra_keys)
    )
    digest = _DIGESTS.get(algo)
    if digest is None:
        raise ValueError(f"unknown hash algorithm {algo!r}; expected 'xxh3_64' or 'sha256'")
    return digest(payload)


def block_extra_keys(
    first_block: bool, cache_salt: str | None = None, lora_name: str | None = None
) -> tuple[str, ...] | None:
    """The extra keys one block's hash folds in: ``("lora", name)`` on every block of a LoRA
    request, then the cache salt on the first block of a prompt; None when there are none."""
    keys: tuple[str, ...] = ("lora", lora_name) if lora_name is not None else ()
    if first_block and cache_salt:
        keys += (cache_salt,)
    return keys or None


def block_hash_chain(
    token_ids: Sequence[int],
    block_size: int,
    cache_salt: str | None = None,
    algo: HashAlgo = "xxh3_64",
    start: int = 0,
    parent_hash: BlockHash | None = None,
    lora_name: str | None = None,
) -> list[BlockHash]:
    """Hashes of every full block of `token_ids`, from block index `start` on.

    `parent_hash` must be the hash of block `start - 1` when `start > 0` (incremental hashing as a
    request grows). The salt only enters block 0; `lora_name` enters every block.
    """
    if block_size <= 0:
        raise ValueError("block_size must be positive")
    digest = _DIGESTS.get(algo)
    if digest is None:
        raise ValueError(f"unknown hash algorithm {algo!r}; expected 'xxh3_64' or 'sha256'")
    num_blocks = len(token_ids) // block_size
    if start >= num_blocks:
        return []
    if lora_name is not None:
        previous = parent_hash
        chain: list[BlockHash] = []
        for index in range(start, num_blocks):
            block = token_ids[index * block_size : (index + 1) * block_size]
            extra = block_extra_keys(index == 0, cache_salt, lora_name)
            previous = hash_block(previous, block, extra, algo)
            chain.append(previous)
        return chain
    # One conversion of every covered token, then one C call per block to cut it into block
    # payloads (iter_unpack) and one to prefix the parent (pack): a long prompt's thousands of
    # blocks cost a single tight loop with no slicing arithmetic.
    raw = array("I", token_ids[start * block_size : num_blocks * block_size]).tobytes()
    stride = 4 * block_size
    blocks = _block_bytes(stride).iter_unpack(raw)
    with_parent = _parent_and_block(stride).pack
    parent = ROOT_PARENT_HASH if parent_hash is None else parent_hash
    hashes: list[BlockHash] = []
    if start == 0 and cache_salt:  # the salt enters block 0 only
        (first,) = next(blocks)
        parent = digest(with_parent(parent, first) + _extra_bytes((cache_salt,)))
        hashes.append(parent)
    append = hashes.append
    for (block,) in blocks:
        parent = digest(with_parent(parent, block))
        append(parent)
    return hashes


def next_block_hash(
    parent_hash: BlockHash, block_token_ids: array[int], algo: HashAlgo = "xxh3_64"
) -> BlockHash:
    """Hash of one full block after the first (no salt enters), its token ids given as a
    uint32 array: what `block_hash_chain` gives for that block, at a fraction of its fixed cost
    (a request growing by one block per decode step hashes this way)."""
    return _DIGESTS[algo](_U64.pack(parent_hash) + block_token_ids.tobytes())


@cache
def _block_bytes(stride: int) -> struct.Struct:
    return struct.Struct(f"{stride}s")


@cache
def _parent_and_block(stride: int) -> struct.Struct:
    """Payload of a block: its parent's hash (u64, little-endian), then its token ids."""
    return struct.Struct(f"<Q{stride}s")


def _sha256_u64(payload: bytes) -> int:
    return int.from_bytes(hashlib.sha256(payload).digest()[:8], "little")


_DIGESTS: dict[str, Callable[[bytes], int]] = {
    "xxh3_64": xxhash.xxh3_64_intdigest,
    "sha256": _sha256_u64,
}
