"""The decode fast-forward changes nothing a simulation reports.

The same trace runs with `fast_forward` on and off: every per-request timeline (arrival, first
scheduling, first and last token, tokens, cached tokens, preemptions, instance), every summary
figure, the engine step count, the load samples and the KV events the global index received must
be identical; only the ITL mean may differ in its last bits (the gaps are summed in another
order). (The engine-core level, step by step, is tests/unit/test_fast_forward_equals_stepping.py.)
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import pytest

from kvherd.kv_events import KVEvent
from policies import (
    ClusterView,
    Decision,
    RequestView,
    load_dispatch_policy,
    load_migration_policy,
)
from scheduler.core.load_report import LoadReport
from simulator.cluster import ClusterConfig, SimCluster
from simulator.instance import DecodeRun, InstanceConfig
from simulator.latency import load_latency_model
from simulator.synthetic import SyntheticSpec, generate
from simulator.traces import Trace


def _trace() -> Trace:
    return generate(
        SyntheticSpec(
            requests=160,
            rate=12.0,
            input_mean=500,
            output_mean=120,
            num_groups=5,
            prefix_tokens=512,
            max_input=2000,
            seed=3,
        )
    )


class _AllToFirst:
    """Overloads one instance so the migration policy has work."""

    name = "all_to_first"

    def choose(self, request: RequestView, cluster: ClusterView) -> Decision:
        return Decision(cluster.instances[0].instance_id)


def _run(
    trace: Trace, policy: str, fast_forward: bool, num_blocks: int
) -> tuple[SimCluster, list[tuple[float, str, list[KVEvent]]], list[object], dict[str, int]]:
    """The finished cluster, the KV events and load reports the global state received (with
    their times), and how many engine steps decode runs fast-forwarded, by how they started
    (`start_decode_run` or `continue_decode_run`)."""
    config = ClusterConfig(
        num_instances=3,
        instance=InstanceConfig(
            num_blocks=num_blocks, block_size=16, max_num_seqs=24, max_num_batched_tokens=1024
        ),
        sample_interval_s=0.25,
        migration_interval_s=0.05,
    )
    migrating = policy == "all_to_first+llumnix"
    cluster = SimCluster(
        config,
        load_latency_model("roofline:llama-2-7b:a100-80gb"),
        _AllToFirst() if migrating else load_dispatch_policy(policy),
        load_migration_policy("llumnix") if migrating else None,
        fast_forward=fast_forward,
    )
    delivered: list[tuple[float, str, list[KVEvent]]] = []
    deliver = cluster._apply_events

    def recording(due: float, instance_id: str, events: list[KVEvent]) -> None:
        delivered.append((due, instance_id, events))
        deliver(due, instance_id, events)

    cluster._apply_events = recording  # type: ignore[method-assign]
    reports: list[object] = []
    deliver_report = cluster._deliver_report

    def recording_report(instance_id: str, report: LoadReport, taken_at: float) -> None:
        reports.append((cluster.loop.now, instance_id, report, taken_at))
        deliver_report(instance_id, report, taken_at)

    cluster._deliver_report = recording_report  # type: ignore[method-assign]
    fast_forwarded = {"start": 0, "continue": 0}
    for inst in cluster.instances.values():
        for name in fast_forwarded:
            method = getattr(inst, f"{name}_decode_run")

            def counting(
                *args: object,
                method: Callable[..., DecodeRun | None] = method,
                name: str = name,
                **kwargs: object,
            ) -> DecodeRun | None:
                run = method(*args, **kwargs)
                fast_forwarded[name] += 0 if run is None else len(run.step_ends)
                return run

            setattr(inst, f"{name}_decode_run", counting)
    cluster.run(trace)
    return cluster, delivered, reports, fast_forwarded


@pytest.mark.parametrize(
    ("policy", "num_blocks"),
    # Tight pools preempt; all-to-first overloads one instance so that llumnix migrates.
    [("kvherd", 400), ("round_robin", 260), ("round_robin", 4000), ("all_to_first+llumnix", 900)],
)
def test_fast_forward_gives_identical_results(policy: str, num_blocks: int) -> None:
    trace = _trace()
    slow, slow_events, slow_reports, slow_runs = _run(trace, policy, False, num_blocks)
    fast, fast_events, fast_reports, fast_runs = _run(trace, policy, True, num_blocks)

    slow_cols, fast_cols = slow.metrics.columns(), fast.metrics.columns()
    assert slow_cols.keys() == fast_cols.keys()
    for name in slow_cols:
        assert np.array_equal(slow_cols[name], fast_cols[name]), name
    slow_summary, fast_summary = slow.metrics.summary(), fast.metrics.summary()
    assert slow_summary["completed"] == len(trace)
    for key, value in slow_summary.items():
        if key == "itl_ms_mean":
            assert math.isclose(value, fast_summary[key], rel_tol=1e-12)
        elif isinstance(value, float) and math.isnan(value):
            assert math.isnan(fast_summary[key]), key
        else:
            assert fast_summary[key] == value, key
    assert slow.metrics.itl.counts.tolist() == fast.metrics.itl.counts.tolist()
    assert fast_events == slow_events
    assert fast.load_times == slow.load_times and fast.load_samples == slow.load_samples
    assert fast.kv_use_samples == slow.kv_use_samples
    for iid, inst in slow.instances.items():
        twin = fast.instances[iid]
        assert (twin.num_steps, twin.busy_time) == (inst.num_steps, inst.busy_time)
        assert twin.scheduler.num_preemptions == inst.scheduler.num_preemptions
    assert fast_reports == slow_reports
    assert fast.migration_stats == slow.migration_stats
    # The fast-forward did run: most steps went by without a `schedule` call (fewer under
    # migrations, whose ticks and stages end runs). Without migrations, runs also went on past
    # arrivals routed elsewhere (`continue_decode_run`).
    steps = sum(i.num_steps for i in slow.instances.values())
    assert sum(slow_runs.values()) == 0
    if slow.migration_stats.started:
        assert fast_runs["start"] > steps / 10 and fast_runs["continue"] == 0
    else:
        assert sum(fast_runs.values()) > steps / 2 and fast_runs["continue"] > steps / 10
    if policy == "all_to_first+llumnix":
        assert slow.migration_stats.committed > 0
