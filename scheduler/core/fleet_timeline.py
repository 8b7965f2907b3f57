"""The fleet's recent history for the live page: samples of counters, gauges and histograms.

Contract:
- Pure, no clock: `add(sample)` with the sample's own time keeps the samples of the last
  ``window_s`` seconds; a sample less than ``min_interval_s`` after the last one is dropped
  (returns False), so many viewers polling at once do not shorten the intervals.
- `series()` gives, per kept sample after the first, its time and, over the ``smooth_s`` seconds
  before it (the oldest kept sample at most): each counter's rate per second, each gauge's value
  and each histogram's quantiles (`QUANTILES`, Prometheus' ``histogram_quantile`` on the bucket
  increments; None where nothing was observed). A counter that went down was reset: its
  increase is its new value, as in Prometheus.
- Keys are ``(group, label)`` pairs (``("requests", "200")``); a key missing from a sample counts
  as 0 (a counter not yet incremented) or None (a gauge of an instance that left).
- Histograms are cumulative bucket counts by upper bound (the last bound is ``inf``).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

Key = tuple[str, str]
Buckets = Sequence[tuple[float, float]]  # (upper bound, cumulative count), ascending
QUANTILES = (0.5, 0.9, 0.99)


@dataclass(frozen=True)
class Sample:
    t: float
    counters: Mapping[Key, float] = field(default_factory=dict)
    gauges: Mapping[Key, float] = field(default_factory=dict)
    histograms: Mapping[str, Buckets] = field(default_factory=dict)


@dataclass(frozen=True)
class Series:
    t: list[float]
    rates: dict[Key, list[float]]
    gauges: dict[Key, list[float | None]]
    quantiles: dict[str, dict[float, list[float | None]]]


def histogram_quantile(q: float, buckets: Buckets) -> float | None:
    """Prometheus' estimate: linear within the bucket holding rank ``q * total``."""
    if not buckets or buckets[-1][1] <= 0:
        return None
    rank = q * buckets[-1][1]
    lower_bound, lower_count = 0.0, 0.0
    for bound, count in buckets:
        if count >= rank:
            if math.isinf(bound):
                return lower_bound  # beyond the last finite bound: its value, as Prometheus does
            if count == lower_count:
                return bound
            return lower_bound + (bound - lower_bound) * (rank - lower_count) / (
                count - lower_count
            )
        lower_bound, lower_count = bound, count
    return lower_bound


def _increase(now: float, before: float) -> float:
    return now - before if now >= before else now


class FleetTimeline:
    def __init__(
        self, window_s: float = 300.0, smooth_s: float = 10.0, min_interval_s: float = 1.0
    ):
        if not 0 < min_interval_s <= smooth_s <= window_s:
            raise ValueError("need 0 < min_interval_s <= smooth_s <= window_s")
        self.window_s = window_s
        self.smooth_s = smooth_s
        self.min_interval_s = min_interval_s
        self._samples: deque[Sample] = deque()

    def add(self, sample: Sample) -> bool:
        if self._samples and sample.t - self._samples[-1].t < self.min_interval_s:
            return False
        self._samples.append(sample)
        while self._samples[0].t < sample.t - self.window_s:
            self._samples.popleft()
        return True

    def series(self) -> Series:
        samples = list(self._samples)
        counters = sorted({k for s in samples for k in s.counters})
        gauges = sorted({k for s in samples for k in s.gauges})
        histograms = sorted({h for s in samples for h in s.histograms})
        out = Series([], {k: [] for k in counters}, {k: [] for k in gauges}, {})
        out.quantiles.update({h: {q: [] for q in QUANTILES} for h in histograms})
        base = 0
        for i in range(1, len(samples)):
            now = samples[i]
            while samples[base + 1].t <= now.t - self.smooth_s:
                base += 1
            then = samples[base]
            elapsed = now.t - then.t
            out.t.append(now.t)
            for key in counters:
                delta = _increase(now.counters.get(key, 0.0), then.counters.get(key, 0.0))
                out.rates[key].append(delta / elapsed)
            for key in gauges:
                out.gauges[key].append(now.gauges.get(key))
            for name in histograms:
                increments = _bucket_increases(
                    now.histograms.get(name, ()), then.histograms.get(name, ())
                )
                for q in QUANTILES:
                    out.quantiles[name][q].append(histogram_quantile(q, increments))
        return out


def _bucket_increases(now: Buckets, then: Buckets) -> list[tuple[float, float]]:
    before = dict(then)
    if any(count < before.get(bound, 0.0) for bound, count in now):
        return list(now)  # reset
    return [(bound, count - before.get(bound, 0.0)) for bound, count in now]
