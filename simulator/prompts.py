"""Deterministic token ids from prefix block ids: the one synthesis the simulator and replay share.

Contract:
- `synthesize_prompt(hash_ids, input_length, ...)` maps each block id to one fixed block of
  `id_block_size` token ids (512 for Mooncake) and cuts the concatenation to `input_length`. Equal ids at
  equal positions give equal tokens, so requests that share leading ids share a real token prefix, and
  the engine's own block hashing finds it at any engine block size that divides the id block size.
- Tokens lie in [low, vocab_size). The defaults [3, 256) are regular tokens in every vocabulary kvherd
  runs (byte-level ids of the built-in tokenizer, byte-fallback or plain ids of real models) and skip
  the ids models commonly reserve (0-2: pad/bos/eos); pass a larger `vocab_size` for a wider alphabet.
- The ids come as a uint32 `array` (what the simulator's engine requests hold; `.tolist()` for
  a JSON prompt).
- Pure function of its arguments (a splitmix64 hash; no RNG state), stable across processes.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from functools import cache

import numpy as np

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)


def _splitmix64(x: np.ndarray) -> np.ndarray:
    # A bijection on 64-bit words with good avalanche; uint64 arrays wrap silently.
    x = x + _GOLDEN
    x = (x ^ (x >> np.uint64(30))) * _M1
    x = (x ^ (x >> np.uint64(27))) * _M2
    return x ^ (x >> np.uint64(31))


@cache
def _seed_key(seed: int) -> np.uint64:
    return np.uint64(_splitmix64(np.asarray([seed], dtype=np.uint64))[0])


@cache
def _positions(id_block_size: int) -> np.ndarray:
    """Per-position offsets inside an id block (read-only: shared by every call)."""
    positions = np.arange(id_block_size, dtype=np.uint64) * _GOLDEN
    positions.setflags(write=False)
    return positions


DEFAULT_VOCAB_SIZE = 256
DEFAULT_LOW_TOKEN = 3


def synthesize_prompt(
    hash_ids: Sequence[int],
    input_length: int,
    id_block_size: int = 512,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    low: int = DEFAULT_LOW_TOKEN,
    seed: int = 0,
) -> array[int]:
    """Token ids for a prompt of `input_length` tokens described by its prefix block ids, as a
    uint32 `array` (what an engine `Request` stores, no int objects; `.tolist()` for JSON)."""
    if not 0 <= low < vocab_size:
        raise ValueError(f"need 0 <= low < vocab_size, got low={low}, vocab_size={vocab_size}")
    if vocab_size > 1 << 32:
        raise ValueError(f"token ids must fit 32 bits, vocab_size={vocab_size}")
    if input_length > len(hash_ids) * id_block_size:
        raise ValueError(
            f"{len(hash_ids)} block ids cover at most {len(hash_ids) * id_block_size} tokens, "
            f"not {input_length}"
        )
    num_blocks = -(-input_length // id_block_size)  # later ids fall past the cut
    ids = np.asarray(hash_ids[:num_blocks], dtype=np.uint64)
    block_key = _splitmix64(ids ^ _seed_key(seed))
    positions = _positions(id_block_size)
    words = _splitmix64((block_key[:, None] + positions[None, :]).reshape(-1)[:input_length])
    tokens = array("I")
    tokens.frombytes(
        (np.uint64(low) + words % np.uint64(vocab_size - low)).astype(np.uint32).tobytes()
    )
    return tokens
