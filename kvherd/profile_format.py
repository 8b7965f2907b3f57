"""The features an engine step's time is modelled on: one definition for fit and prediction.

Contract: `kvherd profile` times real engine steps and fits one linear model over `FEATURES`; the
simulator's calibrated latency model predicts with the same coefficients. Both compute the features
with `step_features(prefill, decode_contexts)`, for a step that prefills the chunks `prefill`
(``(new tokens, tokens computed before)`` each) and decodes one token for sequences with
`decode_contexts` tokens of context, so fit and prediction cannot disagree. A profile file names
its format `PROFILE_FORMAT`. Pure: no torch.
"""

from __future__ import annotations

from collections.abc import Sequence

PROFILE_FORMAT = "kvherd-latency-profile/v2"
FEATURES = (
    "const",
    "prefill_sequences",
    "prefill_tokens",
    "prefill_attention_pairs",
    "decode_batch",
    "decode_context_tokens",
)


def attention_pairs(num_new: int, num_before: int) -> int:
    """Query-key pairs a causal prefill chunk computes: each new token attends to its context."""
    return num_new * num_before + num_new * (num_new + 1) // 2


def step_features(
    prefill: Sequence[tuple[int, int]], decode_contexts: Sequence[int]
) -> list[float]:
    """The values of `FEATURES`, in order, for one step."""
    return [
        1.0,
        float(len(prefill)),
        float(sum(n for n, _ in prefill)),
        float(sum(attention_pairs(n, c) for n, c in prefill)),
        float(len(decode_contexts)),
        float(sum(decode_contexts)),
    ]
