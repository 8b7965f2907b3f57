"""The live page's history: rates, gauges and histogram quantiles over a sliding window."""

from __future__ import annotations

import math

import pytest

from scheduler.core.fleet_timeline import FleetTimeline, Sample, histogram_quantile

INF = math.inf


def test_quantile_interpolates_within_the_bucket_like_prometheus() -> None:
    buckets = [(0.1, 50.0), (1.0, 100.0), (INF, 100.0)]
    assert histogram_quantile(0.5, buckets) == pytest.approx(0.1)
    assert histogram_quantile(0.75, buckets) == pytest.approx(0.55)
    assert histogram_quantile(0.5, [(1.0, 0.0), (INF, 0.0)]) is None
    assert histogram_quantile(0.99, [(1.0, 1.0), (INF, 10.0)]) == 1.0  # past the last bound


def test_rates_are_over_the_smoothing_window_and_survive_resets() -> None:
    timeline = FleetTimeline(window_s=60, smooth_s=2, min_interval_s=1)
    for t, count in ((0, 0), (1, 10), (2, 20), (3, 30), (4, 5)):
        assert timeline.add(Sample(t, counters={("requests", "200"): count}))
    series = timeline.series()
    assert series.t == [1, 2, 3, 4]
    # t=1 and t=2 reach back to t=0; then 2 s back; the reset at t=4 counts its new value.
    assert series.rates[("requests", "200")] == [10, 10, 10, pytest.approx((20 + 5 - 20) / 2)]


def test_samples_too_close_are_dropped_and_old_ones_expire() -> None:
    timeline = FleetTimeline(window_s=10, smooth_s=5, min_interval_s=1)
    assert timeline.add(Sample(0))
    assert not timeline.add(Sample(0.5))
    for t in range(1, 30):
        timeline.add(Sample(t, gauges={("running", "a"): t}))
    series = timeline.series()
    assert series.t[0] == 20 and series.t[-1] == 29
    assert series.gauges[("running", "a")][-1] == 29


def test_quantiles_use_the_buckets_observed_in_the_window() -> None:
    timeline = FleetTimeline(window_s=60, smooth_s=10, min_interval_s=1)
    timeline.add(Sample(0, histograms={"ttft": [(0.1, 100.0), (1.0, 100.0), (INF, 100.0)]}))
    timeline.add(Sample(5, histograms={"ttft": [(0.1, 100.0), (1.0, 110.0), (INF, 110.0)]}))
    timeline.add(Sample(6, counters={("requests", "200"): 1}))  # the histogram went away
    quantiles = timeline.series().quantiles["ttft"]
    assert quantiles[0.5] == [pytest.approx(0.55), None]  # only the 10 slow ones are new
