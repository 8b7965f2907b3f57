"""The pure scheduler core: load reports, optimistic accounting, cluster state, router, migration loop."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from kvherd.block_hash import block_hash_chain
from kvherd.kv_events import BlockStored, KVEventBatch
from policies import MigrationOrder, NoInstanceError, load_dispatch_policy, load_migration_policy
from scheduler.core.cluster_state import ClusterState, ResyncRequest
from scheduler.core.instance_state import InstanceState
from scheduler.core.load_report import (
    LoadReport,
    LoadReportError,
    parse_agent_state,
    parse_prometheus,
)
from scheduler.core.migration_loop import MigrationLoop
from scheduler.core.router import Router

# -- load reports -----------------------------------------------------------------------------

AGENT_STATE = {
    "instance_id": "a",
    "model": "tiny",
    "block_size": 16,
    "total_blocks": 1000,
    "free_blocks": 700,
    "cached_blocks": 120,
    "kv_usage": 0.3,
    "num_running": 3,
    "num_waiting": 2,
    "running": [
        {
            "request_id": "r1",
            "num_tokens": 100,
            "num_computed_tokens": 99,
            "blocks": 7,
            "num_output_tokens": 60,
            "max_tokens": 64,
        },
        {"request_id": "r2", "num_tokens": 40, "num_computed_tokens": 39, "blocks": 3},
        {"request_id": "r3", "num_tokens": 900, "num_computed_tokens": 512, "blocks": 32},
    ],
    "waiting": [
        {"request_id": "w1", "num_tokens": 300, "num_computed_tokens": 64, "blocks": 4},
        {"request_id": "w2", "num_tokens": 50, "num_computed_tokens": 0, "blocks": 0},
    ],
    "num_preemptions": 3,
    "freeness": 150.0,
    "step_latency": {"count": 0},
    "last_kv_event_seq": -1,
    "draining": False,
}


def test_agent_state_snapshot() -> None:
    report = parse_agent_state(AGENT_STATE)
    assert (report.num_running, report.num_waiting) == (3, 2)
    assert (report.num_total_blocks, report.num_free_blocks, report.num_cached_blocks) == (
        1000,
        700,
        120,
    )
    # Queued prompts plus the rest of r3's chunked prefill; decodes add nothing.
    assert report.waiting_prefill_tokens == (300 - 64) + 50 + (900 - 512)
    assert report.head_waiting_blocks == 19 - 4  # ceil(300/16) = 19 needed, 4 held
    assert report.running is not None and [r.num_blocks for r in report.running] == [7, 3, 32]
    assert [r.remaining_tokens for r in report.running] == [4, None, None]
    assert report.num_preemptions == 3 and report.last_kv_event_seq is None
    heartbeat = parse_agent_state({"num_running": 1, "free_blocks": 5, "last_kv_event_seq": 9})
    assert heartbeat.num_running == 1 and heartbeat.running is None
    assert heartbeat.last_kv_event_seq == 9


@pytest.mark.parametrize(
    ("state", "message"),
    [
        ([], "JSON object"),
        ({"num_running": -1}, "non-negative"),
        ({"num_running": "3"}, "non-negative"),
        ({"kv_usage": 1.5}, r"in \[0, 1\]"),
        ({"running": [{"request_id": 1, "num_tokens": 3}]}, r"running\[0\]"),
        ({"waiting": "x"}, "list of objects"),
        ({"last_kv_event_seq": -5}, "last_kv_event_seq"),
    ],
)
def test_bad_agent_state(state: object, message: str) -> None:
    with pytest.raises(LoadReportError, match=message):
        parse_agent_state(state)


VLLM_V1 = """# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_running{engine="1",model_name="m"} 2.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 4.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
# TYPE vllm:num_preemptions counter
vllm:num_preemptions_total{engine="0",model_name="m"} 7.0
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="16",num_gpu_blocks="2000"} 1.0
"""

VLLM_OLD = """# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="m"} 1.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{model_name="m"} 0.0
# TYPE vllm:gpu_cache_usage_perc gauge
vllm:gpu_cache_usage_perc{model_name="m"} 0.5
"""

SGLANG = """# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{model_name="m"} 6.0
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{model_name="m"} 1.0
# TYPE sglang:token_usage gauge
sglang:token_usage{model_name="m"} 0.75
# TYPE sglang:max_total_num_tokens gauge
sglang:max_total_num_tokens{model_name="m"} 32000.0
"""


def test_prometheus_vllm_new_old_and_sglang() -> None:
    new = parse_prometheus(VLLM_V1)
    assert (new.num_running, new.num_waiting, new.kv_usage) == (5, 4, 0.25)
    assert (new.num_total_blocks, new.num_free_blocks, new.num_preemptions) == (2000, 1500, 7)
    old = parse_prometheus(VLLM_OLD)
    assert (old.num_running, old.num_waiting, old.kv_usage, old.num_total_blocks) == (
        1,
        0,
        0.5,
        None,
    )
    sgl = parse_prometheus(SGLANG, block_size=16)
    assert (sgl.num_running, sgl.num_waiting, sgl.kv_usage) == (6, 1, 0.75)
    assert (sgl.num_total_blocks, sgl.num_free_blocks) == (2000, 500)
    assert parse_prometheus("") == LoadReport()
    with pytest.raises(LoadReportError):
        parse_prometheus("vllm:num_requests_running{ 3\n")


# -- optimistic accounting and the router -----------------------------------------------------


def tokens(n: int, seed: int = 0) -> list[int]:
    return [(seed * 7919 + k * 31) % 30000 for k in range(n)]


def make(n: int, policy: str = "least_requests", **kwargs: object) -> tuple[ClusterState, Router]:
    cluster = ClusterState(block_size=16)
    for k in range(n):
        cluster.add_instance(f"i{k}", **kwargs)  # type: ignore[arg-type]
    return cluster, Router(cluster, load_dispatch_policy(policy))


def test_optimistic_accounting_spreads_a_burst_between_reports() -> None:
    cluster, router = make(4)
    for name in cluster.instances:
        cluster.apply_report(name, LoadReport(num_running=0, num_waiting=0), now=0.0)
    placed = [router.route(f"r{k}", tokens(64, k), now=0.1).instance_id for k in range(12)]
    assert sorted(placed.count(f"i{k}") for k in range(4)) == [3, 3, 3, 3]
    view = cluster.view(0.1)["i0"]
    assert (view.num_waiting, view.pending_prefill, view.inflight_blocks) == (3, 3, 12)
    # Without optimistic charges (a policy that only saw reports) all 12 would go to one instance.


def test_charges_move_at_first_token_and_finish_and_reports_absorb_them() -> None:
    cluster, router = make(1)
    cluster.apply_report(
        "i0",
        LoadReport(num_running=1, num_waiting=0, num_total_blocks=100, num_free_blocks=90),
        now=0.0,
    )
    router.route("r", tokens(160), now=1.0)  # 10 blocks, 160 uncached tokens
    v = cluster.view(1.0)["i0"]
    assert (v.num_running, v.num_waiting, v.free_blocks, v.waiting_prefill_tokens) == (
        1,
        1,
        80,
        160,
    )
    assert v.freeness == pytest.approx((80 - 10) / 2)
    router.on_first_token("r", now=1.5)
    v = cluster.view(1.5)["i0"]
    assert (v.num_running, v.num_waiting, v.pending_prefill_tokens) == (2, 0, 0)
    # A report snapshotted at 1.2 (before the first token) counts r as waiting; the first-token
    # change after the snapshot stays on top of it.
    cluster.apply_report(
        "i0", LoadReport(num_running=1, num_waiting=1, num_free_blocks=80), now=1.6, taken_at=1.2
    )
    v = cluster.view(1.6)["i0"]
    assert (v.num_running, v.num_waiting, v.free_blocks) == (2, 0, 80)
    router.on_finish("r", now=2.0)
    v = cluster.view(2.0)["i0"]
    assert (v.num_running, v.num_waiting, v.free_blocks, v.inflight) == (1, 0, 90, 0)
    cluster.apply_report(
        "i0", LoadReport(num_running=1, num_waiting=0, num_free_blocks=90), now=2.5
    )
    v = cluster.view(2.5)["i0"]
    assert (v.num_running, v.free_blocks) == (1, 90)
    router.on_finish("r", now=3.0)  # a second finish is ignored
    assert cluster.view(3.0)["i0"].num_running == 1


def test_a_report_says_whether_the_view_can_have_changed() -> None:
    state = InstanceState("i0", block_size=16)
    steady = LoadReport(num_running=2, num_waiting=0, num_total_blocks=100, num_free_blocks=60)
    assert state.apply_report(steady, now=0.0)
    assert not state.apply_report(dataclasses.replace(steady), now=0.5)  # same figures
    # A field the new report leaves unknown keeps its value: still the same view.
    assert not state.apply_report(LoadReport(num_running=2, num_waiting=0), now=0.6)
    assert state.report.num_free_blocks == 60
    state.dispatch("r", prompt_tokens=32, uncached_tokens=32, now=1.0)
    # Same figures, but the snapshot (taken after the dispatch) now counts it: the log changes.
    assert state.apply_report(steady, now=1.5, taken_at=1.2)
    assert state.view().num_waiting == 0
    assert state.apply_report(LoadReport(num_running=2, num_waiting=1), now=2.0)
    assert state.view().num_waiting == 1


def test_the_view_reports_a_standing_queue_less_deferred_and_the_running_peak() -> None:
    state = InstanceState("i0", block_size=16)
    # One report with a request waiting is a blip (it arrived between two engine steps).
    state.apply_report(LoadReport(num_running=8, num_waiting=1), now=0.0)
    assert state.view().reported_waiting == 0 and state.view().running_peak == 8
    # Two in a row: a queue.
    state.apply_report(LoadReport(num_running=8, num_waiting=2), now=0.5)
    assert state.view().reported_waiting == 2
    # Those deferred (waiting for a KV pull) are not queued for room.
    state.apply_report(LoadReport(num_running=6, num_waiting=2, num_deferred=2), now=1.0)
    assert state.view().reported_waiting == 0 and state.view().running_peak == 8
    state.apply_report(LoadReport(num_running=11, num_waiting=0), now=1.5)
    assert state.view().running_peak == 11


def test_prometheus_waiting_by_reason_deferred() -> None:
    text = (
        "vllm:num_requests_running 3\nvllm:num_requests_waiting 5\n"
        'vllm:num_requests_waiting_by_reason{reason="capacity"} 3\n'
        'vllm:num_requests_waiting_by_reason{reason="deferred"} 2\n'
    )
    report = parse_prometheus(text)
    assert (report.num_running, report.num_waiting, report.num_deferred) == (3, 5, 2)
    assert parse_prometheus("vllm:num_requests_waiting 5\n").num_deferred is None


def test_an_overflowing_change_log_is_recounted_at_the_next_report() -> None:
    state = InstanceState("i0", block_size=16, max_log=2)
    state.apply_report(LoadReport(num_running=0, num_waiting=0, num_free_blocks=50), now=0.0)
    for k in range(3):  # the first change falls out of the log
        state.dispatch(f"r{k}", prompt_tokens=16, uncached_tokens=16, now=1.0 + k)
    assert state.view().num_waiting == 3  # running sums still hold all three
    state.apply_report(LoadReport(num_running=0, num_waiting=0, num_free_blocks=50), now=1.5)
    assert state.view().num_waiting == 2  # recounted from the log: what it still holds
    state.apply_report(LoadReport(num_running=0, num_waiting=1, num_free_blocks=49), now=2.5)
    assert (state.view().num_waiting, state.view().free_blocks) == (2, 48)


def test_unhealthy_and_excluded_instances_are_never_least_loaded() -> None:
    cluster, router = make(3)
    cluster.apply_report("i0", LoadReport(num_running=0, num_waiting=0), now=0.0)
    cluster.apply_report("i1", LoadReport(num_running=9, num_waiting=0), now=0.0)
    cluster.apply_report("i2", LoadReport(num_running=5, num_waiting=0), now=0.0)
    cluster.set_healthy("i0", False)
    assert router.route("a", tokens(32), now=0.1).instance_id == "i2"
    assert router.route("b", tokens(32), now=0.1, exclude={"i2"}).instance_id == "i1"
    cluster.set_draining("i1", True)
    with pytest.raises(NoInstanceError):
        router.route("c", tokens(32), now=0.1, exclude={"i2"})


def test_router_hashes_with_the_tenant_salt_and_uses_the_approximate_index() -> None:
    _, router = make(4, policy="kvherd")
    prompt = tokens(640)
    first = router.route("r1", prompt, now=0.0, cache_salt="tenant-a")
    assert first.request.block_hashes == tuple(block_hash_chain(prompt, 16, "tenant-a"))
    router.on_first_token("r1", now=0.5)
    router.on_finish("r1", now=1.0)
    again = router.route("r2", prompt + tokens(16, 9), now=2.0, cache_salt="tenant-a")
    assert again.instance_id == first.instance_id and again.matched_blocks == 40
    other_tenant = router.route("r3", prompt, now=2.0, cache_salt="tenant-b")
    assert other_tenant.matched_blocks == 0
    # The approximate entry expires after its TTL (120 s by default).
    router.on_finish("r2", now=2.0)
    late = router.route("r4", prompt, now=300.0, cache_salt="tenant-a")
    assert late.matched_blocks == 0


def test_precise_index_through_cluster_state_and_replay_needed() -> None:
    cluster, router = make(2, policy="kvherd", has_kv_events=True)
    assert cluster.add_instance("i1", has_kv_events=True) == ResyncRequest("i1", 0)
    prompt = tokens(320)
    chain = block_hash_chain(prompt, 16)
    cluster.apply_kv_batch("i1", KVEventBatch(4, 0.0, [BlockStored(chain, None, prompt, 16)]))
    longer = prompt + tokens(32, 5)
    routed = router.route("r", longer, now=0.0)
    assert routed.instance_id == "i1" and routed.matched_blocks == 20
    # Until i1's events arrive, its 2-block tail counts as pending there: precise 20 + pending 2.
    assert cluster.match(block_hash_chain(longer, 16), now=1.0) == {"i1": 22}
    assert cluster.match(block_hash_chain(longer, 16), now=10.0) == {"i1": 20}  # pending TTL 5 s
    cluster.apply_kv_batch("i1", KVEventBatch(6, 0.0, []))
    assert cluster.replay_needed("i1") == 5
    cluster.apply_kv_batch("i1", KVEventBatch(5, 0.0, []))
    assert cluster.replay_needed("i1") is None
    cluster.clear_kv_view("i1")
    assert cluster.match(chain, now=100.0) == {}


def test_removing_an_instance_returns_its_requests_and_keeps_views_consistent() -> None:
    cluster, router = make(3)
    placed = {router.route(f"r{k}", tokens(32, k), now=0.0).instance_id for k in range(3)}
    assert placed == {"i0", "i1", "i2"}
    orphans = router.forget_instance("i1")
    assert len(orphans) == 1 and router.instance_of(orphans[0]) is None
    view = cluster.view(1.0)
    assert [i.instance_id for i in view.instances] == ["i0", "i2"]
    assert list(view.column("inflight")) == [1.0, 1.0]
    assert view.index_of("i2") == 1


def test_migration_moves_charges() -> None:
    cluster, router = make(2)
    src = router.route("r", tokens(64), now=0.0).instance_id
    dst = "i1" if src == "i0" else "i0"
    router.on_first_token("r", now=0.1)
    router.on_migrated("r", dst, now=1.0)
    view = cluster.view(1.0)
    assert view[src].inflight == 0 and view[dst].inflight == 1 and view[dst].num_running == 1
    assert router.instance_of("r") == dst


def test_route_argument_errors() -> None:
    _, router = make(1)
    with pytest.raises(ValueError, match="needs token_ids"):
        router.route("x", now=0.0)
    with pytest.raises(ValueError, match="num_tokens is required"):
        router.route("x", block_hashes=[1, 2], now=0.0)
    router.route("x", block_hashes=[1, 2], num_tokens=40, now=0.0)
    with pytest.raises(ValueError, match="already routed"):
        router.route("x", tokens(8), now=0.0)


# -- migration loop ---------------------------------------------------------------------------


def test_migration_loop_interval_limits_and_completion() -> None:
    cluster = ClusterState(block_size=16)
    for name in ("hot", "cold", "cool"):
        cluster.add_instance(name)
    running = [{"request_id": f"h{k}", "num_tokens": 16 * (k + 1)} for k in range(3)]
    cluster.apply_report(
        "hot",
        parse_agent_state(
            {"total_blocks": 100, "free_blocks": 2, "running": running, "waiting": []}
        ),
        now=0.0,
    )
    for name in ("cold", "cool"):
        cluster.apply_report(
            name, parse_agent_state({"total_blocks": 100, "free_blocks": 100}), 0.0
        )
    executed: list[MigrationOrder] = []
    loop = MigrationLoop(load_migration_policy("llumnix"), executed.append, interval_s=1.0)
    first = loop.tick(cluster.view(0.0), now=0.0)
    assert [(o.request_id, o.src) for o in first] == [("h0", "hot")] and executed == first
    assert loop.tick(cluster.view(0.5), now=0.5) == []  # before the interval
    # h0 is still migrating and hot is busy (one migration per instance): nothing new.
    assert loop.tick(cluster.view(1.0), now=1.0) == []
    assert loop.stats.rejected == 1
    assert loop.on_done("h0", ok=True, now=1.2) == first[0]
    assert loop.on_done("h0", ok=True, now=1.2) is None
    again = loop.tick(cluster.view(2.0), now=2.0)
    assert [o.request_id for o in again] == ["h0"]  # the report still shows h0 on hot
    assert loop.tick(cluster.view(70.0), now=70.0)  # the order timed out; a new one goes out
    assert loop.stats.timed_out == 1 and loop.stats.succeeded == 1


def test_migration_loop_drops_orders_it_cannot_execute() -> None:
    cluster = ClusterState(block_size=16)
    cluster.add_instance("a")
    cluster.add_instance("b")
    cluster.set_draining("b", True)
    cluster.add_instance("p", role="prefill")

    class Naive:
        name = "naive"

        def plan(self, view: object) -> list[MigrationOrder]:
            return [
                MigrationOrder("x", "a", "a"),
                MigrationOrder("y", "a", "b"),  # destination draining
                MigrationOrder("z", "a", "ghost"),
                MigrationOrder("w", "a", "p"),  # a prefill-only instance never takes a decode
            ]

    loop = MigrationLoop(Naive(), lambda order: None)
    assert loop.tick(cluster.view(0.0), now=0.0) == []
    assert loop.stats.rejected == 4 and math.isinf(cluster.view(0.0)["a"].freeness)


@pytest.mark.parametrize("fleet", [5, 150])  # few matches: per-bit path; many: bit-matrix path
def test_match_array_agrees_with_match(fleet: int) -> None:
    import random

    rng = random.Random(fleet)
    cluster = ClusterState(block_size=16)
    doc = tokens(16 * 64, 3)
    chain = block_hash_chain(doc, 16)
    depths: dict[str, int] = {}
    for k in range(fleet):
        name = f"n{k}"
        cluster.add_instance(name, has_kv_events=k % 3 != 0)
        depth = depths[name] = rng.randrange(0, 65)
        if k % 3:
            prefix = doc[: 16 * depth]
            cluster.apply_kv_events(name, [BlockStored(chain[:depth], None, prefix, 16)])
        else:
            cluster.note_routed(name, chain[:depth], now=0.0)
    cluster.remove_instance("n1")  # a freed slot and shifted positions
    del depths["n1"]
    expected = {name: depth for name, depth in depths.items() if depth}
    view = cluster.view(1.0)
    array = cluster.match_array(chain, now=1.0)
    assert {view.instances[i].instance_id: int(array[i]) for i in np.flatnonzero(array)} == expected
    assert {n: d for n, d in cluster.match(chain, now=1.0).items() if d} == expected
    assert len(expected) > (64 if fleet > 100 else 0)


def test_match_counts_a_block_held_in_either_index_over_a_long_chain() -> None:
    """Blocks of one instance split between its precise and pending (approximate) entries; the
    walk must OR them per block, across its chunk boundaries, and stop at each instance's gap."""
    import random

    rng = random.Random(7)
    cluster = ClusterState(block_size=16)
    doc = tokens(16 * 700, 11)
    chain = block_hash_chain(doc, 16)
    expected = {}
    for k in range(40):
        name = f"m{k}"
        cluster.add_instance(name, has_kv_events=True, trust_engine_hashes=True)
        held = [rng.random() < 0.995 for _ in chain]
        precise = {i for i, h in enumerate(held) if h and rng.random() < 0.5}
        pending = [chain[i] for i, h in enumerate(held) if h and i not in precise]
        cluster.apply_kv_events(
            name,
            [BlockStored([chain[i]], None, doc[16 * i : 16 * i + 16], 16) for i in sorted(precise)],
        )
        cluster.note_routed(name, pending, now=0.0)
        depth = held.index(False) if False in held else len(chain)
        if depth:
            expected[name] = depth
    assert cluster.match(chain, now=1.0) == expected
    view = cluster.view(1.0)
    array = cluster.match_array(chain, now=1.0)
    assert {view.instances[i].instance_id: int(array[i]) for i in np.flatnonzero(array)} == expected


def test_dispatchable_from_the_column_matches_each_instance() -> None:
    cluster, _ = make(6)
    view = cluster.view(0.0)
    assert view.dispatchable == view.instances
    cluster.set_healthy("i1", False)
    cluster.set_draining("i4", True)
    view = cluster.view(0.0, exclude={"i2"})
    assert [i.instance_id for i in view.dispatchable] == ["i0", "i3", "i5"]
    assert view.dispatchable == tuple(i for i in view.instances if i.dispatchable)


def test_views_share_the_core_table_read_only_and_exclusion_does_not_leak() -> None:
    cluster, router = make(3)
    view = cluster.view(0.0, exclude={"i0"})
    assert list(view.column("dispatchable")) == [0.0, 1.0, 1.0]
    with pytest.raises(ValueError):
        view.column("inflight")[0] = 5.0  # the core's own figures: a policy cannot change them
    chosen = router.route("r", tokens(32), now=0.1).instance_id
    view = cluster.view(0.2)
    assert list(view.column("dispatchable")) == [1.0, 1.0, 1.0]  # the exclusion was this view's
    inflight = view.column("inflight")
    assert inflight[view.index_of(chosen)] == 1.0 and inflight.sum() == 1.0
