"""The features an engine step's time is modelled on: one definition for fit and prediction.

Contract: `kvherd profile` times real engine steps and fits one linear model over `FEATURES`; the
simulator's calibrated latency model predicts with the same coefficients. Both compute the features
with `step_features(prefill, decode_contexts)`, for a step that prefills the chunks `prefill`
(``(new tokens, tokens computed before)`` each) and decodes one token for sequences with
`decode_contexts` tokens of context, so fit and prediction cannot disagree. A profile file names
its format `PROFILE_FORMAT` (readers accept every format of `PROFILE_FORMATS`). Pure: no torch.

Besides the engine's fit a profile file may carry a ``host`` section (`HOST_SECTION`): the host the
fleet runs on, what the request path and co-located instances add to the engine's time
(`simulator.host_model.HostModel`, which reads and writes it). Its keys are `HOST_KNOBS`, in
seconds: ``request_overhead_s``, ``request_overhead_per_busy_s``, ``request_overhead_idle``
(``[idle s, extra s]`` points), ``request_overhead_spread`` (quantiles of the request path's
deviation) and ``step_slowdown_per_busy`` (a fraction); a knob left out is zero. `kvherd profile`
times one engine alone and writes none; bench/sim_fidelity.py writes the one it probes on a live
fleet, and one may be written by hand.
"""

from __future__ import annotations

from collections.abc import Sequence

PROFILE_FORMAT = "kvherd-latency-profile/v2"
PROFILE_FORMATS = ("kvherd-latency-profile/v1", PROFILE_FORMAT)
HOST_SECTION = "host"
HOST_KNOBS = (
    "request_overhead_s",
    "request_overhead_per_busy_s",
    "request_overhead_idle",
    "request_overhead_spread",
    "step_slowdown_per_busy",
)
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
