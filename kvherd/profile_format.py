"""The features an engine step's time is modelled on: one definition for fit and prediction.

Contract: `kvherd profile` times real engine steps and fits one linear model over `FEATURES`
(`fit_steps`); the simulator's calibrated latency model predicts with the same coefficients. Both
compute the features with `step_features(prefill, decode_contexts)`, for a step that prefills the
chunks `prefill` (``(new tokens, tokens computed before)`` each) and decodes one token for
sequences with `decode_contexts` tokens of context, so fit and prediction cannot disagree. A
profile file names its format `PROFILE_FORMAT` (readers accept every format of `PROFILE_FORMATS`).
Pure: no torch.

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

import json
from collections.abc import Sequence
from typing import Any

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


def doubling_grid(limit: int, start: int) -> list[int]:
    """`start`, doubled while below `limit`, then `limit`: the profiles' lengths and batch sizes."""
    values, v = [], start
    while v < limit:
        values.append(v)
        v *= 2
    return [*values, limit]


def fastest_per_shape(points: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Of the points measured for one batch shape, the fastest: the usual defence against
    interference from other processes on a shared machine."""
    best: dict[str, dict[str, Any]] = {}
    for point in points:
        key = json.dumps([point["prefill"], point["decode"]])
        if key not in best or point["measured_s"] < best[key]["measured_s"]:
            best[key] = point
    return list(best.values())


def fit_steps(
    points: Sequence[dict[str, Any]],
    extra: Sequence[str] = (),
    unfitted: Sequence[str] = (),
) -> tuple[list[float], dict[str, float], list[float]]:
    """Least squares of `FEATURES` over measured steps (``prefill``, ``decode``, ``measured_s``
    each), and of the `extra` columns a point may carry (absent: 0); the `unfitted` features,
    which the points cannot tell apart from others, weigh 0. Returns the coefficients (s, in
    `FEATURES` then `extra` order), the fit's quality, and each point's prediction."""
    import numpy as np

    x = np.array(
        [
            step_features(p["prefill"], p["decode"]) + [float(p.get(e, 0.0)) for e in extra]
            for p in points
        ]
    )
    y = np.array([p["measured_s"] for p in points])
    kept = [i for i in range(x.shape[1]) if i >= len(FEATURES) or FEATURES[i] not in unfitted]
    # Relative least squares: long and short steps weigh alike (weights 1/y).
    w = 1.0 / np.maximum(y, 1e-6)
    coef = np.zeros(x.shape[1])
    coef[kept] = np.linalg.lstsq(x[:, kept] * w[:, None], y * w, rcond=None)[0]
    pred = np.maximum(x @ coef, 1e-5)
    residual = y - pred
    stats = {
        "num_points": len(y),
        "rmse_ms": float(np.sqrt(np.mean(residual**2)) * 1000.0),
        "mean_abs_pct_error": float(np.mean(np.abs(residual) / y) * 100.0),
        "r2": float(1.0 - np.sum(residual**2) / np.sum((y - y.mean()) ** 2)),
    }
    return [float(c) for c in coef], stats, [float(v) for v in pred]
