"""Fleet-level SLOs a capacity plan must meet, and their values measured on one simulated run.

Contract: an `Slo` is `NAME=VALUE` (`parse_slo`). Latency SLOs bound a statistic from above, in
seconds: NAME is `ttft`, `tpot`, `e2e` or `queue` (`simulator.metrics`' definitions) joined to `pQ`
(a percentile, 0 < Q <= 100, numpy's linear interpolation) or `mean`, e.g. `ttft_p99=2.0`.
`attainment` (a fraction) and `goodput` (requests/s) bound from below the requests that met the
per-request targets (`RequestTargets`: TTFT and TPOT in seconds, `metrics.summary`'s goodput).
`measure(slos, result)` gives every SLO's value on a run; a value meets its SLO only when finite,
and a run meets its SLOs only when it also served every request (none failed or unfinished).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

LATENCIES = ("ttft", "tpot", "e2e", "queue")
GOOD_REQUESTS = ("attainment", "goodput")


@dataclass(frozen=True, slots=True)
class Slo:
    metric: str  # e.g. "ttft_p99", "tpot_mean", "attainment"
    limit: float

    @property
    def upper(self) -> bool:
        """Whether the limit bounds the value from above (latencies) or from below."""
        return self.metric not in GOOD_REQUESTS

    def met(self, value: float) -> bool:
        if not math.isfinite(value):
            return False
        return value <= self.limit if self.upper else value >= self.limit

    def __str__(self) -> str:
        return f"{self.metric}{'<=' if self.upper else '>='}{self.limit:g}"


@dataclass(frozen=True, slots=True)
class RequestTargets:
    """What one request must meet to count towards `attainment` and `goodput` (seconds)."""

    ttft_s: float | None = None
    tpot_s: float | None = None


def parse_slo(text: str) -> Slo:
    """``ttft_p99=2.0`` -> `Slo`; raises `ValueError` naming what is wrong."""
    name, sep, raw = text.partition("=")
    name = name.strip()
    try:
        limit = float(raw)
    except ValueError:
        limit = math.nan
    if not sep or not math.isfinite(limit) or limit < 0:
        raise ValueError(f"SLO {text!r} is not NAME=VALUE with a non-negative number")
    if name not in GOOD_REQUESTS:
        base, _, stat = name.partition("_")
        try:
            if base not in LATENCIES:
                raise ValueError
            _percentile(stat)
        except ValueError:
            raise ValueError(
                f"SLO {name!r}: expected {'|'.join(LATENCIES)} with _pQ or _mean "
                f"(e.g. ttft_p99), or {' or '.join(GOOD_REQUESTS)}"
            ) from None
    return Slo(name, limit)


def _percentile(stat: str) -> float | None:
    """`pQ` -> Q, `mean` -> None; `ValueError` for anything else."""
    if stat == "mean":
        return None
    q = float(stat[1:]) if stat.startswith("p") else math.nan
    if not 0 < q <= 100:
        raise ValueError(stat)
    return q


def latencies_s(columns: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Per-request TTFT, TPOT (requests of more than one token), E2E and queueing, in seconds."""
    arrival = columns["arrival"]
    ttft = columns["first_token"] - arrival
    e2e = columns["last_token"] - arrival
    multi = columns["output_tokens"] > 1
    tpot = (e2e[multi] - ttft[multi]) / (columns["output_tokens"][multi] - 1)
    return {"ttft": ttft, "tpot": tpot, "e2e": e2e, "queue": columns["scheduled"] - arrival}


def measure(
    slos: Sequence[Slo], columns: Mapping[str, np.ndarray], summary: Mapping[str, float]
) -> dict[str, float]:
    """Each SLO's value on one run: its latency statistic, or the summary's attainment/goodput
    (computed there against the run's `RequestTargets`)."""
    values: dict[str, float] = {}
    per_request = latencies_s(columns)
    for slo in slos:
        if slo.metric == "attainment":
            values[slo.metric] = float(summary["slo_attainment"])
        elif slo.metric == "goodput":
            values[slo.metric] = float(summary["goodput"])
        else:
            base, _, stat = slo.metric.partition("_")
            data = per_request[base]
            data = data[~np.isnan(data)]
            q = _percentile(stat)
            if not len(data):
                values[slo.metric] = math.nan
            elif q is None:
                values[slo.metric] = float(data.mean())
            else:
                values[slo.metric] = float(np.percentile(data, q))
    return values
