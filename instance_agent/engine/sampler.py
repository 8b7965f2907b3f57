"""Token sampling: greedy, temperature, top-k, top-p, with counter-based per-request randomness.

Contract:
- `sample(logits, rows)` returns one token id per row of ``logits [rows, vocab]``. Every operation is
  row-wise, so a request's token never depends on which other requests share the batch.
- Temperature 0 is greedy (argmax, lowest id on ties). Otherwise logits are divided by the
  temperature, restricted to the `top_k` highest (0 or -1: all) and to the smallest set whose
  probability reaches `top_p`, and one token is drawn.
- The draw for output token i of a request is a pure function of ``(sampling_seed, i)``: the
  exponential noise of the Gumbel-max trick (``argmax(p / E)``, E ~ Exp(1)) comes from a CPU generator
  seeded with `draw_seed(sampling_seed, i)`. Preempted, re-batched or migrated requests therefore
  draw exactly the same tokens, on CPU and CUDA alike.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from instance_agent.engine.core.request import SamplingParams

_MASK64 = (1 << 64) - 1


def draw_seed(sampling_seed: int, index: int) -> int:
    """Seed of draw `index` of a request: SplitMix64 over (seed, index), folded into [0, 2**63)."""
    z = ((sampling_seed & _MASK64) + (index + 1) * 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) >> 1


@dataclass(slots=True)
class SamplingRow:
    params: SamplingParams
    sampling_seed: int
    index: int  # which output token of the request is being drawn


def sample(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> list[int]:
    """One token id per row (see the module docstring)."""
    tokens = logits.argmax(dim=-1)
    random_rows = [i for i, r in enumerate(rows) if not r.params.greedy]
    if random_rows:
        picked = _sample_random(logits[random_rows], [rows[i] for i in random_rows])
        tokens[random_rows] = picked
    return [int(t) for t in tokens.tolist()]


def _sample_random(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    n, vocab = logits.shape
    device = logits.device
    temps = torch.tensor([r.params.temperature for r in rows], dtype=torch.float32, device=device)
    scaled = logits.float() / temps[:, None]
    top_k = [r.params.top_k if r.params.top_k > 0 else vocab for r in rows]
    top_p = [r.params.top_p for r in rows]
    if any(k < vocab for k in top_k) or any(p < 1.0 for p in top_p):
        scaled = _filter_top_k_top_p(scaled, top_k, top_p)
    probs = torch.softmax(scaled, dim=-1)
    noise = torch.empty(n, vocab, dtype=torch.float32)
    for i, r in enumerate(rows):
        gen = torch.Generator().manual_seed(draw_seed(r.sampling_seed, r.index))
        noise[i].exponential_(generator=gen)
    return (probs / noise.to(device)).argmax(dim=-1)


def _filter_top_k_top_p(
    logits: torch.Tensor, top_k: Sequence[int], top_p: Sequence[float]
) -> torch.Tensor:
    vocab = logits.shape[1]
    device = logits.device
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(vocab, device=device)[None, :]
    k = torch.tensor(top_k, device=device)[:, None]
    sorted_logits = sorted_logits.masked_fill(ranks >= k, float("-inf"))
    p = torch.tensor(top_p, dtype=torch.float32, device=device)[:, None]
    sorted_probs = torch.softmax(sorted_logits, dim=-1)
    # Drop a token when the tokens ranked above it already reach top_p; the first always stays.
    before = sorted_probs.cumsum(dim=-1) - sorted_probs
    sorted_logits = sorted_logits.masked_fill((before >= p) & (ranks > 0), float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(1, order, sorted_logits)
