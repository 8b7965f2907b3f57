"""Slow start: an instance that joins a serving fleet takes a share of its batch slots that ramps
from the floor to all of them; the router sends the rest elsewhere, never refusing a request
for it; the simulator's autoscaled instances ramp through the same router."""

from __future__ import annotations

import pytest

from policies import load_dispatch_policy
from scheduler.core.autoscale import AutoscaleSettings
from scheduler.core.cluster_state import ClusterState
from scheduler.core.router import Router
from scheduler.core.slow_start import SlowStart, SlowStartSettings
from simulator.experiment import SimSettings, run_policy
from simulator.instance import InstanceConfig
from simulator.latency import load_latency_model
from simulator.synthetic import SyntheticSpec, generate


def test_the_share_ramps_from_the_floor_to_all_over_the_window() -> None:
    ramp = SlowStart(SlowStartSettings(window_s=10.0, floor=0.2))
    ramp.joined("new", 100.0)
    assert ramp.share("new", 100.0) == pytest.approx(0.2)
    assert ramp.share("new", 105.0) == pytest.approx(0.6)
    assert ramp.share("new", 110.0) == 1.0
    assert ramp.share("old", 105.0) == 1.0  # never joined: not ramping
    slots = {"new": 10}
    # At 105 s its limit is floor(0.6 x 10) = 6 requests.
    assert ramp.held(105.0, lambda _: 5, slots.__getitem__) == set()
    assert ramp.held(105.0, lambda _: 6, slots.__getitem__) == {"new"}
    assert ramp.held(111.0, lambda _: 99, slots.__getitem__) == set()
    assert not ramp.ramping  # the ended ramp was dropped


def test_off_by_default_and_settings_are_checked() -> None:
    ramp = SlowStart()
    ramp.joined("new", 0.0)
    assert not ramp.ramping and ramp.share("new", 0.0) == 1.0
    for bad in ({"window_s": -1.0}, {"floor": 0.0}, {"floor": 1.5}, {"default_slots": 0}):
        with pytest.raises(ValueError):
            SlowStartSettings(**bad)  # type: ignore[arg-type]


def _fleet(window_s: float) -> Router:
    cluster = ClusterState(block_size=16)
    for name in ("old", "new"):
        cluster.add_instance(name, batch_slots=8)
    ramp = SlowStart(SlowStartSettings(window_s=window_s, floor=0.25))
    return Router(cluster, load_dispatch_policy("round_robin"), slow_start=ramp)


def test_the_router_keeps_a_ramping_instance_within_its_share() -> None:
    router = _fleet(window_s=20.0)
    router.slow_start.joined("new", 0.0)
    where = [router.route(f"r{k}", list(range(k, k + 32)), now=0.0).instance_id for k in range(8)]
    assert where.count("new") == 2  # a quarter of its 8 slots; round robin would give it 4
    for k in range(8):
        router.on_finish(f"r{k}", 0.0)
    where = [router.route(f"s{k}", list(range(k, k + 32)), now=20.0).instance_id for k in range(8)]
    assert where.count("new") == 4  # the window passed: round robin's half


def test_a_ramping_instance_still_takes_what_nothing_else_can() -> None:
    router = _fleet(window_s=20.0)
    router.slow_start.joined("new", 0.0)
    router.cluster.get("old").healthy = False
    where = {router.route(f"r{k}", list(range(k, k + 32)), now=0.0).instance_id for k in range(6)}
    assert where == {"new"}  # held, but the only candidate: never a refusal for the ramp


def test_a_ramp_never_queues_a_request_behind_full_instances() -> None:
    router = _fleet(window_s=20.0)
    router.slow_start.joined("new", 0.0)
    where = [router.route(f"r{k}", list(range(k, k + 32)), now=0.0).instance_id for k in range(14)]
    assert where[:10].count("old") == 8  # the newcomer held at 2 until old's 8 slots are full
    assert where[10:].count("new") == 2  # then it is held no more: round robin's half


def test_in_the_simulator_an_overloaded_fleet_scales_out_the_same_with_a_ramp() -> None:
    """The autoscaled instances ramp through the same router; while the fleet is overloaded
    every newcomer's slot is needed, so the ramp changes nothing (a first version that held
    newcomers anyway tripled the TTFT p99 of this run)."""
    latency = load_latency_model("roofline:llama-2-7b:a100-80gb")
    engine = InstanceConfig(num_blocks=4000, block_size=16, max_num_seqs=16)
    spec = SyntheticSpec(
        requests=800, rate=25.0, input_mean=700, output_mean=200, num_groups=8,
        prefix_tokens=512, seed=2,
    )  # fmt: skip
    trace = generate(spec)
    summaries = []
    for ramp_s in (0.0, 20.0):
        settings = SimSettings(1, latency, engine, slo_ttft_ms=2000)
        settings.autoscale = AutoscaleSettings(1, 4, slots=8, window_s=2.0, scale_in_delay_s=10.0)
        settings.instance_start_s = 5.0
        settings.slow_start_s = ramp_s
        summaries.append(run_policy(trace, settings, "kvherd").summary)
    plain, ramped = summaries
    assert ramped["completed"] == len(trace.requests) and ramped["scale_outs"] >= 2
    assert ramped["ttft_ms_p99"] == pytest.approx(plain["ttft_ms_p99"])
