"""Per-request latency records and their summary, shared by `kvherd sim` and `kvherd replay`.

Contract (definitions follow `vllm bench serve`):
- TTFT: first token time - arrival. E2E: last token time - arrival.
- TPOT per request: (E2E - TTFT) / (output tokens - 1), only for requests with more than one token.
- ITL: every gap between consecutive tokens of a request, pooled over all requests. Gaps go into a
  log-bucketed histogram (0.5% relative resolution) so memory stays flat for millions of requests;
  means are compensated sums (order-independent to an ulp), percentiles (nearest rank) are within
  half a bucket.
- Queueing: first time the engine scheduled the request - arrival (simulator only; NaN in replay).
- Throughput: output tokens and requests per second over [first arrival, last completion].
  Goodput: requests per second meeting both SLOs (TTFT <= slo_ttft and TPOT <= slo_tpot).
- Prefix hit rate: prompt tokens served from the prefix cache / prompt tokens (any KV tier);
  `shared_cache_limit(trace)` is its physical limit, an infinite cache shared by the fleet.
Times are seconds internally; summaries report milliseconds for latencies.
"""

from __future__ import annotations

import itertools
import math
from array import array
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from simulator.traces import Trace

PERCENTILES = (50, 90, 99)
_BUCKETS_PER_DECADE = 460  # 10**(1/460) - 1 = 0.5% bucket width
_MIN_GAP_S = 1e-7
_DECADES = 12  # 1e-7 s .. 1e5 s


class LogHistogram:
    """ITL gaps in log buckets, with their exact count and a compensated sum.

    Gaps are buffered as (value, count) columns and binned in bulk with numpy every
    `_FLUSH_EVERY` entries (and before any read): a decode run adds its gaps with two list
    extends instead of a Python loop body per step.
    """

    __slots__ = ("_compensation", "_counts", "_n", "_total", "_values", "_weights")

    _FLUSH_EVERY = 1 << 16

    def __init__(self) -> None:
        self._counts = np.zeros(_BUCKETS_PER_DECADE * _DECADES + 1, dtype=np.int64)
        self._values: list[float] = []
        self._weights: list[int] = []
        # Each flush adds its chunk's exactly rounded sum (`math.fsum`) to a Neumaier-compensated
        # total, so the mean is within an ulp of the exact one whatever order the gaps came in.
        self._total = 0.0
        self._compensation = 0.0
        self._n = 0

    @property
    def n(self) -> int:
        """Gaps recorded."""
        self._flush()
        return self._n

    @property
    def counts(self) -> np.ndarray:
        self._flush()
        return self._counts.copy()

    def add(self, value: float, count: int = 1) -> None:
        """Record `value` `count` times."""
        self.add_each((value,), count)

    def add_each(self, values: Sequence[float], count: int) -> None:
        """Record each of `values` `count` times (a decode run: each step's gap, once per
        request of the batch)."""
        if count <= 0 or not values:
            return
        self._values.extend(values)
        self._weights.extend([count] * len(values))
        if len(self._values) >= self._FLUSH_EVERY:
            self._flush()

    def add_counted(self, items: Iterable[tuple[float, int]]) -> None:
        """Record each `(value, count)`: `value`, `count` times."""
        for value, count in items:
            if count > 0:
                self._values.append(value)
                self._weights.append(count)
        if len(self._values) >= self._FLUSH_EVERY:
            self._flush()

    def _flush(self) -> None:
        if not self._values:
            return
        values = np.asarray(self._values, dtype=np.float64)
        weights = np.asarray(self._weights, dtype=np.int64)
        self._values.clear()
        self._weights.clear()
        index = np.zeros(len(values), dtype=np.int64)
        above = values > _MIN_GAP_S
        buckets = np.log10(values[above] / _MIN_GAP_S) * _BUCKETS_PER_DECADE
        index[above] = np.minimum(buckets.astype(np.int64) + 1, len(self._counts) - 1)
        np.add.at(self._counts, index, weights)
        self._n += int(weights.sum())
        term = math.fsum((values * weights).tolist())
        total = self._total + term
        if abs(self._total) >= abs(term):
            self._compensation += (self._total - total) + term
        else:
            self._compensation += (term - total) + self._total
        self._total = total

    def mean(self) -> float:
        self._flush()
        return (self._total + self._compensation) / self._n if self._n else math.nan

    def percentile(self, q: float) -> float:
        self._flush()
        if not self._n:
            return math.nan
        rank = max(math.ceil(q / 100.0 * self._n), 1)  # nearest rank
        cumulative = np.cumsum(self._counts)
        index = int(np.searchsorted(cumulative, rank, side="left"))
        if index == 0:
            return _MIN_GAP_S
        # Geometric centre of the bucket.
        return float(_MIN_GAP_S * 10 ** ((index - 0.5) / _BUCKETS_PER_DECADE))


_TIME_COLUMNS = ("arrival", "scheduled", "first_token", "last_token")
_COUNT_COLUMNS = (
    "index",
    "output_tokens",
    "prompt_tokens",
    "cached_tokens",
    "preemptions",
    "migrations",
)
# The order `columns()` gives them in.
_COLUMNS = ("index", *_TIME_COLUMNS, *_COUNT_COLUMNS[1:])


@dataclass(slots=True)
class _Live:
    arrival: float
    prompt_tokens: int
    scheduled: float = math.nan
    first_token: float = math.nan
    last_token: float = math.nan
    num_tokens: int = 0


class MetricsCollector:
    """Collects per-request timelines as tokens arrive; `summary()` reduces them."""

    def __init__(self) -> None:
        self._live: dict[str, _Live] = {}
        self.itl = LogHistogram()
        # Finished requests as packed columns (~80 bytes a request, for million-request runs),
        # in finishing order; `columns()` sorts them by trace index.
        self._times = {name: array("d") for name in _TIME_COLUMNS}
        self._counts = {name: array("q") for name in _COUNT_COLUMNS}
        self._instance_codes = array("I")
        self._instance_names: dict[str, int] = {}
        self.failed = 0
        self.refused_arrivals = array("d")  # of requests admission refused (429)
        self.migrations = 0

    def on_arrival(self, request_id: str, arrival: float, prompt_tokens: int) -> None:
        self._live[request_id] = _Live(arrival, prompt_tokens)

    def on_scheduled(self, request_id: str, now: float) -> None:
        live = self._live[request_id]
        if math.isnan(live.scheduled):
            live.scheduled = now

    def on_token(self, request_id: str, now: float) -> bool:
        """Record one token (or streamed chunk); True when it is the request's first."""
        return bool(self.on_tokens([request_id], now))

    def on_tokens(self, request_ids: list[str], now: float) -> list[str]:
        """`on_token` for each of `request_ids` (one engine step); returns those whose token
        was their first."""
        firsts: list[str] = []
        gaps: list[float] = []
        live_of = self._live
        for request_id in request_ids:
            live = live_of[request_id]
            if live.num_tokens:
                gaps.append(now - live.last_token)
            else:
                live.first_token = now
                firsts.append(request_id)
            live.num_tokens += 1
            live.last_token = now
        self.itl.add_each(gaps, 1)
        return firsts

    def on_decode_run(self, request_ids: list[str], times: list[float]) -> None:
        """Each request got one more token at each of `times` (a decode fast-forward; none is a
        request's first): equal to calling `on_token` per request per time, gaps pooled in
        another order (the compensated ITL mean does not see the order)."""
        if not times:
            return
        itl = self.itl
        lives = [self._live[rid] for rid in request_ids]
        first = times[0]
        # The first gap is to each request's own previous token.
        itl.add_each([first - live.last_token for live in lives], 1)
        # Later gaps are the step times, shared by the whole batch.
        itl.add_each([b - a for a, b in itertools.pairwise(times)], len(lives))
        count = len(times)
        last = times[-1]
        for live in lives:
            live.num_tokens += count
            live.last_token = last

    def on_finished_ids(
        self,
        request_id: str,
        index: int,
        num_cached_tokens: int,
        num_preemptions: int,
        num_migrations: int,
        instance_id: str,
        num_output_tokens: int | None = None,
    ) -> None:
        """Close a request's record; `num_output_tokens` overrides the token count (a replay reads
        it from the server's usage, since one streamed chunk may carry several tokens)."""
        live = self._live.pop(request_id)
        times, counts = self._times, self._counts
        times["arrival"].append(live.arrival)
        times["scheduled"].append(live.scheduled)
        times["first_token"].append(live.first_token)
        times["last_token"].append(live.last_token)
        counts["index"].append(index)
        counts["output_tokens"].append(
            live.num_tokens if num_output_tokens is None else num_output_tokens
        )
        counts["prompt_tokens"].append(live.prompt_tokens)
        counts["cached_tokens"].append(max(num_cached_tokens, 0))
        counts["preemptions"].append(num_preemptions)
        counts["migrations"].append(num_migrations)
        code = self._instance_names.setdefault(instance_id, len(self._instance_names))
        self._instance_codes.append(code)

    def on_failed(self, request_id: str) -> None:
        self._live.pop(request_id, None)
        self.failed += 1

    def on_refused(self, request_id: str) -> None:
        self.refused_arrivals.append(self._live.pop(request_id).arrival)

    @property
    def num_unfinished(self) -> int:
        return len(self._live)

    # -- reduction -------------------------------------------------------------------------------
    def columns(self) -> dict[str, np.ndarray]:
        """One float64 column per field (and `instance`, object), rows in trace-index order."""
        index = np.frombuffer(self._counts["index"], dtype=np.int64)
        order = np.argsort(index, kind="stable")
        out: dict[str, np.ndarray] = {}
        for name in _COLUMNS:
            packed = self._times[name] if name in self._times else self._counts[name]
            dtype = np.float64 if name in self._times else np.int64
            out[name] = np.frombuffer(packed, dtype=dtype)[order].astype(np.float64)
        names = np.empty(len(self._instance_names), dtype=object)
        for name, code in self._instance_names.items():
            names[code] = name
        codes = np.frombuffer(self._instance_codes, dtype=np.uint32).astype(np.int64)
        out["instance"] = names[codes[order]]
        return out

    def summary(
        self, slo_ttft_ms: float | None = None, slo_tpot_ms: float | None = None
    ) -> dict[str, Any]:
        cols = self.columns()
        n = len(cols["index"])
        ttft = (cols["first_token"] - cols["arrival"]) * 1000.0
        e2e = (cols["last_token"] - cols["arrival"]) * 1000.0
        queue = (cols["scheduled"] - cols["arrival"]) * 1000.0
        out_tokens = cols["output_tokens"]
        multi = out_tokens > 1
        tpot = (e2e[multi] - ttft[multi]) / (out_tokens[multi] - 1)
        duration = float(cols["last_token"].max() - cols["arrival"].min()) if n else 0.0
        good = np.ones(n, dtype=bool)
        if slo_ttft_ms is not None:
            good &= ttft <= slo_ttft_ms
        if slo_tpot_ms is not None:
            tpot_all = np.zeros(n)
            tpot_all[multi] = tpot
            good &= tpot_all <= slo_tpot_ms
        prompt = float(cols["prompt_tokens"].sum())
        summary: dict[str, Any] = {
            "completed": n,
            "failed": self.failed,
            "duration_s": duration,
            "output_tokens": int(out_tokens.sum()),
            "request_throughput": n / duration if duration > 0 else math.nan,
            "output_throughput": float(out_tokens.sum()) / duration if duration > 0 else math.nan,
            "goodput": float(good.sum()) / duration if duration > 0 else math.nan,
            "slo_attainment": float(good.mean()) if n else math.nan,
            "prefix_hit_rate": float(cols["cached_tokens"].sum()) / prompt if prompt else math.nan,
            "preemptions": int(cols["preemptions"].sum()),
            "migrations": int(cols["migrations"].sum()),
        }
        for name, values in (("ttft", ttft), ("tpot", tpot), ("e2e", e2e), ("queue", queue)):
            summary.update(_stats(name, values))
        summary["itl_ms_mean"] = self.itl.mean() * 1000.0
        for q in PERCENTILES:
            summary[f"itl_ms_p{q}"] = self.itl.percentile(q) * 1000.0
        return summary


def _stats(name: str, values: np.ndarray) -> dict[str, float]:
    values = values[~np.isnan(values)]
    if not len(values):
        return {f"{name}_ms_{k}": math.nan for k in ("mean", *(f"p{q}" for q in PERCENTILES))}
    out = {f"{name}_ms_mean": float(values.mean())}
    for q in PERCENTILES:
        out[f"{name}_ms_p{q}"] = float(np.percentile(values, q))
    return out


def shared_cache_limit(trace: Trace) -> float:
    """The physical limit of prefix reuse: the hit rate of one infinite cache shared by the whole
    fleet, filled the instant a request arrives (in arrival order: each request hits the leading
    trace blocks any earlier one had, never its last token)."""
    seen: set[int] = set()
    hit = total = 0
    size = trace.block_size
    for request in sorted(trace.requests, key=lambda r: r.arrival_s):
        ids = request.hash_ids
        leading = 0
        while leading < len(ids) and ids[leading] in seen:
            leading += 1
        hit += min(leading * size, request.input_length - 1)
        total += request.input_length
        seen.update(ids)
    return hit / total if total else math.nan
