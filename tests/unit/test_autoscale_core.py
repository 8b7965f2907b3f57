"""The autoscaler's pure core: counts from demand, cool-downs, the scale-in delay, the victim."""

from __future__ import annotations

import pytest

from scheduler.core.autoscale import (
    Autoscaler,
    AutoscaleSettings,
    Candidate,
    FleetLoad,
    ScaleIn,
    ScaleOut,
    scale_in_victim,
)

SETTINGS = AutoscaleSettings(
    min_instances=1,
    max_instances=4,
    slots=4,
    target_utilization=0.5,  # two requests an instance
    window_s=0.0,  # no smoothing unless a test asks for it
    scale_out_cooldown_s=5.0,
    scale_in_delay_s=10.0,
    scale_in_cooldown_s=10.0,
    max_step=2,
)


def test_demand_above_the_target_scales_out_by_what_is_missing_at_most_max_step() -> None:
    auto = Autoscaler(SETTINGS)
    assert auto.decide(0.0, FleetLoad(present=1, inflight=2)) is None
    assert auto.decide(1.0, FleetLoad(present=1, inflight=5)) == ScaleOut(2, "load")
    assert auto.needed == 3
    auto.changed(1.0)
    # Starting instances count as present: nothing more is asked for while they start.
    assert auto.decide(2.0, FleetLoad(present=3, inflight=5)) is None
    # The cool-down holds a further step back, then lets it through.
    assert auto.decide(3.0, FleetLoad(present=3, inflight=20)) is None
    assert auto.decide(6.0, FleetLoad(present=3, inflight=20)) == ScaleOut(1, "load")


def test_scale_in_waits_for_the_delay_and_goes_one_at_a_time() -> None:
    auto = Autoscaler(SETTINGS)
    assert auto.decide(0.0, FleetLoad(present=3, inflight=1)) is None  # below since 0
    assert auto.decide(9.0, FleetLoad(present=3, inflight=1)) is None
    assert auto.decide(10.0, FleetLoad(present=3, inflight=1)) == ScaleIn("load")
    auto.changed(10.0)
    assert auto.decide(15.0, FleetLoad(present=2, inflight=1)) is None
    assert auto.decide(20.0, FleetLoad(present=2, inflight=1)) is None  # the delay restarted
    assert auto.decide(25.0, FleetLoad(present=2, inflight=1)) == ScaleIn("load")


def test_a_burst_in_the_delay_resets_it() -> None:
    auto = Autoscaler(SETTINGS)
    auto.decide(0.0, FleetLoad(present=2, inflight=0))
    auto.decide(8.0, FleetLoad(present=2, inflight=4))  # needs 2 again
    assert auto.decide(12.0, FleetLoad(present=2, inflight=0)) is None
    assert auto.decide(22.0, FleetLoad(present=2, inflight=0)) == ScaleIn("load")


def test_bounds_are_restored_at_once() -> None:
    auto = Autoscaler(SETTINGS)
    auto.changed(0.0)
    assert auto.decide(0.1, FleetLoad(present=0, inflight=0)) == ScaleOut(1, "min")
    assert auto.decide(0.2, FleetLoad(present=5, inflight=0)) == ScaleIn("max")
    assert auto.decide(0.3, FleetLoad(present=4, inflight=100)) is None  # at max


def test_a_standing_queue_beyond_the_target_scales_out_before_the_average_catches_up() -> None:
    settings = AutoscaleSettings(
        min_instances=1, max_instances=4, slots=4, target_utilization=1.0, window_s=2.0
    )
    auto = Autoscaler(settings)
    assert auto.decide(0.0, FleetLoad(present=1, inflight=0)) is None
    # 5 in flight on one instance of 4 slots, 2 queued on the engine: the smoothed demand lags.
    for t in (0.5, 1.0, 2.0):
        assert auto.decide(t, FleetLoad(present=1, inflight=5, queued=2)) is None
        assert auto.needed == 1
    assert auto.decide(2.6, FleetLoad(present=1, inflight=5, queued=2)) == ScaleOut(1, "queue")


def test_queue_without_excess_load_is_not_a_reason() -> None:
    settings = AutoscaleSettings(max_instances=4, slots=8, target_utilization=1.0, window_s=1.0)
    auto = Autoscaler(settings)
    for t in range(6):
        assert auto.decide(float(t), FleetLoad(present=2, inflight=3, queued=1)) is None


def test_demand_is_smoothed_over_the_window() -> None:
    settings = AutoscaleSettings(slots=4, target_utilization=0.5, window_s=4.0)
    auto = Autoscaler(settings)
    auto.decide(0.0, FleetLoad(present=1, inflight=0))
    auto.decide(0.1, FleetLoad(present=1, inflight=100))  # a blip: demand moves ~2.5%
    assert 2.0 < auto.demand < 3.0 and auto.needed == 2


def test_victim_loses_the_fewest_unique_blocks_then_requests_then_is_newest() -> None:
    assert scale_in_victim([]) is None
    cands = [Candidate("a", 10, 0), Candidate("b", 2, 5), Candidate("c", 2, 1)]
    assert scale_in_victim(cands) == "c"
    assert scale_in_victim([Candidate("a", 0, 0), Candidate("b", 0, 0)]) == "b"


@pytest.mark.parametrize(
    "kwargs",
    [
        {"min_instances": 0},
        {"min_instances": 3, "max_instances": 2},
        {"slots": 0},
        {"target_utilization": 0.0},
        {"max_step": 0},
        {"scale_in_delay_s": -1.0},
    ],
)
def test_bad_settings_are_refused(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        AutoscaleSettings(**kwargs)  # type: ignore[arg-type]
