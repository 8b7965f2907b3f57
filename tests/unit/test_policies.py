"""Built-in dispatch and migration policies, with real numbers, and the policy registry."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest

from policies import (
    DISPATCH_POLICIES,
    MIGRATION_POLICIES,
    ClusterView,
    InstanceView,
    NoInstanceError,
    PolicyLoadError,
    RequestView,
    RunningRequestView,
    load_dispatch_policy,
    load_migration_policy,
)
from policies.dynamo_kv import DynamoKV
from policies.kvherd import KvherdDispatch


def cluster(*instances: InstanceView, matched: dict[str, int] | None = None) -> ClusterView:
    table = matched or {}
    return ClusterView(instances, now=0.0, matcher=lambda request: dict(table))


def request(num_tokens: int = 160, blocks: int | None = None, rid: str = "r") -> RequestView:
    n = num_tokens // 16 if blocks is None else blocks
    return RequestView(rid, num_tokens, tuple(range(1, n + 1)), 16)


def test_every_builtin_loads_and_skips_unhealthy_and_draining() -> None:
    view = cluster(
        InstanceView("sick", healthy=False),
        InstanceView("leaving", draining=True),
        InstanceView("ok", capacity=100, free_blocks=100),
    )
    for name in DISPATCH_POLICIES:
        policy = load_dispatch_policy(name)
        for k in range(5):
            assert policy.choose(request(rid=f"r{k}"), view).instance_id == "ok", name
    for name in MIGRATION_POLICIES:
        assert load_migration_policy(name).plan(view) == []


def test_no_dispatchable_instance_raises() -> None:
    view = cluster(InstanceView("sick", healthy=False))
    for name in DISPATCH_POLICIES:
        with pytest.raises(NoInstanceError):
            load_dispatch_policy(name).choose(request(), view)


def test_round_robin_cycles_in_id_order() -> None:
    view = cluster(InstanceView("b"), InstanceView("a"), InstanceView("c"))
    policy = load_dispatch_policy("round_robin")
    assert [policy.choose(request(), view).instance_id for _ in range(5)] == list("abcab")


def test_least_requests_and_power_of_two() -> None:
    view = cluster(
        InstanceView("a", num_running=5, num_waiting=2),
        InstanceView("b", num_running=3),
        InstanceView("c", num_running=1, num_waiting=4),
    )
    assert load_dispatch_policy("least_requests").choose(request(), view).instance_id == "b"
    # With two of three sampled, the busiest ("a", 7) can never win.
    p2 = load_dispatch_policy("power_of_two", seed=3)
    chosen = {p2.choose(request(), view).instance_id for _ in range(50)}
    assert chosen <= {"b", "c"} and len(chosen) == 2


def test_llumnix_dispatches_to_highest_freeness() -> None:
    view = cluster(
        InstanceView("a", capacity=1000, free_blocks=600, num_running=10, freeness=60.0),
        InstanceView("b", capacity=1000, free_blocks=300, num_running=3, freeness=100.0),
        InstanceView("c", capacity=1000, free_blocks=900, num_running=30, freeness=30.0),
    )
    decision = load_dispatch_policy("llumnix").choose(request(), view)
    assert decision.instance_id == "b"
    assert decision.scores == {"a": 60.0, "b": 100.0, "c": 30.0}
    idle = cluster(*view.instances, InstanceView("idle", capacity=10, free_blocks=10))
    assert load_dispatch_policy("llumnix").choose(request(), idle).instance_id == "idle"


def test_sglang_cache_aware_switches_between_cache_and_shortest_queue() -> None:
    policy = load_dispatch_policy("sglang_cache_aware")
    req = request(160)  # 10 blocks
    # Balanced (max-min = 10 <= 64): the worker with a match rate 0.8 > 0.3 wins.
    balanced = cluster(
        InstanceView("a", inflight=20), InstanceView("b", inflight=10), matched={"a": 8, "b": 1}
    )
    assert policy.choose(req, balanced).instance_id == "a"
    # Imbalanced: 100 - 20 = 80 > 64 and 100 > 1.5 * 20 -> shortest queue, cache ignored.
    imbalanced = cluster(
        InstanceView("a", inflight=100), InstanceView("b", inflight=20), matched={"a": 10}
    )
    decision = policy.choose(req, imbalanced)
    assert decision.instance_id == "b" and "imbalanced" in decision.reason
    # Large absolute gap but not relatively imbalanced (100 <= 1.5 * 70): stays cache-aware.
    relative_ok = cluster(
        InstanceView("a", inflight=100), InstanceView("b", inflight=70), matched={"a": 10}
    )
    assert policy.choose(req, relative_ok).instance_id == "a"
    # Low match rate (2/10 = 0.2 <= 0.3): the smallest cache wins.
    cold = cluster(
        InstanceView("a", cached_blocks=500),
        InstanceView("b", cached_blocks=50),
        matched={"a": 2},
    )
    assert policy.choose(req, cold).instance_id == "b"


def test_dynamo_kv_cost_arithmetic() -> None:
    policy = DynamoKV()
    req = request(320)  # 20 blocks
    a = InstanceView("a", pending_prefill_tokens=160, inflight_blocks=100)
    b = InstanceView("b", pending_prefill_tokens=0, inflight_blocks=130)
    # a: prefill (160 + 320 - 16*16) / 16 = 14 blocks; decode 100 + 20 = 120 -> 134
    assert policy.logit(req, a, 16) == pytest.approx(134.0)
    # b: prefill 320 / 16 = 20; decode 130 + 20 = 150 -> 170
    assert policy.logit(req, b, 0) == pytest.approx(170.0)
    decision = policy.choose(req, cluster(a, b, matched={"a": 16}))
    assert decision.instance_id == "a" and decision.scores == {"a": -134.0, "b": -170.0}
    # Overlap weight 3 makes prefill matter more: a = 3*14 + 120 = 162, b = 3*20 + 150 = 210.
    assert DynamoKV(overlap_score_weight=3.0).logit(req, a, 16) == pytest.approx(162.0)


def test_dynamo_kv_temperature_samples_and_is_deterministic_under_seed() -> None:
    view = cluster(
        InstanceView("a", inflight_blocks=10),
        InstanceView("b", inflight_blocks=12),
        InstanceView("c", inflight_blocks=400),
    )
    hot = DynamoKV(temperature=1.0, seed=7)
    seq = [hot.choose(request(rid=f"{k}"), view).instance_id for k in range(300)]
    again = DynamoKV(temperature=1.0, seed=7)
    assert seq == [again.choose(request(rid=f"{k}"), view).instance_id for k in range(300)]
    # Normalised logits 0, ~0.005, 1: a and b about equally likely, c about e^-1 as likely.
    assert seq.count("c") < seq.count("a") and seq.count("c") < seq.count("b")
    assert seq.count("c") > 30
    assert DynamoKV().choose(request(), view).instance_id == "a"


def test_llmd_weights() -> None:
    policy = load_dispatch_policy("llmd")
    req = request(160)
    view = cluster(
        # prefix 10/10 * 3 = 3; queue (8-8)/(8-0) = 0 * 2; kv (1-0.9) * 2 = 0.2 -> 3.2
        InstanceView("a", num_waiting=8, kv_usage=0.9),
        # prefix 0; queue 1 * 2 = 2; kv (1-0.2) * 2 = 1.6 -> 3.6
        InstanceView("b", num_waiting=0, kv_usage=0.2),
        matched={"a": 10},
    )
    decision = policy.choose(req, view)
    assert decision.scores == pytest.approx({"a": 3.2, "b": 3.6})
    assert decision.instance_id == "b"
    # Equal KV usage and a one-request queue gap: the prefix weight decides.
    view2 = cluster(
        InstanceView("a", num_waiting=1, kv_usage=0.5),
        InstanceView("b", num_waiting=0, kv_usage=0.5),
        matched={"a": 10},
    )
    assert policy.choose(req, view2).instance_id == "a"  # a: 3 + 0 + 1 = 4 > b: 0 + 2 + 1 = 3


def test_kvherd_trades_cache_hit_against_queued_prefill() -> None:
    policy = KvherdDispatch()  # uncached tokens weigh 4, queued tokens 1, a running request 32
    req = request(2048)  # 128 blocks
    # a caches 120 blocks and has 4,000 tokens queued: 4000 + 4*128 = 4512 < b's 4*2048 = 8192.
    view = cluster(
        InstanceView("a", waiting_prefill_tokens=4000),
        InstanceView("b"),
        matched={"a": 120},
    )
    decision = policy.choose(req, view)
    assert decision.instance_id == "a"
    assert decision.scores == {"a": -4512.0, "b": -8192.0}
    # With 8,000 tokens queued the hit is no longer worth waiting for (8512 > 8192).
    busy = cluster(
        InstanceView("a", waiting_prefill_tokens=8000),
        InstanceView("b"),
        matched={"a": 120},
    )
    assert policy.choose(req, busy).instance_id == "b"
    # The router's own pending prefill counts when the report shows less (chunked prefill runs).
    pending = cluster(
        InstanceView("a", waiting_prefill_tokens=100, pending_prefill_tokens=9000),
        InstanceView("b"),
        matched={"a": 120},
    )
    assert policy.choose(req, pending).instance_id == "b"
    # Decode load: 130 running * 32 = 4160, plus 4*32 uncached = 4288 > b's 4*1024 = 4096.
    decoding = cluster(InstanceView("a", num_running=130), InstanceView("b"), matched={"a": 62})
    assert policy.choose(request(1024), decoding).instance_id == "b"


def test_kvherd_memory_penalty_and_hotspot_guard() -> None:
    policy = KvherdDispatch(uncached_weight=1.0)
    req = request(1600)  # 100 blocks
    # a is cached-hot but has room for only 20 of the 60 uncached blocks: 40 short * 16 * 2 = 1280.
    view = cluster(
        InstanceView("a", capacity=1000, free_blocks=30, head_waiting_blocks=10),
        InstanceView("b", capacity=1000, free_blocks=900),
        matched={"a": 40},
    )
    costs = {k: -v for k, v in policy.choose(req, view).scores.items()}
    assert costs == {"a": 960 + 1280, "b": 1600}
    # Hot spot: a has 150 in flight vs 10 (150-10 > 128 and 150 > 2*10): excluded despite a hit.
    hot = cluster(
        InstanceView("a", inflight=150), InstanceView("b", inflight=10), matched={"a": 100}
    )
    decision = policy.choose(req, hot)
    assert decision.instance_id == "b" and "a" not in decision.scores
    warm = cluster(
        InstanceView("a", inflight=130), InstanceView("b", inflight=10), matched={"a": 100}
    )
    assert policy.choose(req, warm).instance_id == "a"  # 120 over the least: still allowed


def test_vectorised_and_scalar_kvherd_costs_agree() -> None:
    policy = KvherdDispatch()
    instances = [
        InstanceView(
            f"i{k}",
            capacity=500 * (k % 2),
            free_blocks=40 * k,
            num_running=k,
            waiting_prefill_tokens=300 * k,
            head_waiting_blocks=k,
        )
        for k in range(8)
    ]
    matched = {"i1": 10, "i4": 50, "i6": 100}
    req = request(1600)
    cost, _ = policy.costs(req, cluster(*instances, matched=matched))
    for k, inst in enumerate(instances):
        assert cost[k] == pytest.approx(policy.cost(req, inst, matched.get(inst.instance_id, 0)))


def test_random_policies_are_deterministic_under_seed() -> None:
    view = cluster(*(InstanceView(f"i{k}") for k in range(10)))
    for name in ("random", "power_of_two", "least_requests", "kvherd", "llmd", "dynamo_kv"):
        runs = []
        for _ in range(2):
            policy = load_dispatch_policy(name, seed=11)
            runs.append([policy.choose(request(rid=f"r{k}"), view).instance_id for k in range(30)])
        assert runs[0] == runs[1], name
    first = load_dispatch_policy("random", seed=1)
    other = load_dispatch_policy("random", seed=2)
    a = [first.choose(request(), view).instance_id for _ in range(30)]
    b = [other.choose(request(), view).instance_id for _ in range(30)]
    assert a != b


def test_explain_lists_best_first() -> None:
    view = cluster(InstanceView("a", freeness=1.0), InstanceView("b", freeness=5.0))
    text = load_dispatch_policy("llumnix").choose(request(), view).explain()
    lines = text.splitlines()
    assert lines[0].startswith("-> b") and "b" in lines[1] and "a" in lines[2]


def test_registry_module_attr_params_and_errors() -> None:
    policy = load_dispatch_policy("policies.dynamo_kv:DynamoKV", overlap_score_weight=2.5)
    assert isinstance(policy, DynamoKV) and policy.overlap_score_weight == 2.5
    mapped = load_dispatch_policy({"name": "kvherd", "parameters": {"decode_token_cost": 8}})
    assert isinstance(mapped, KvherdDispatch) and mapped.decode_token_cost == 8
    with pytest.raises(PolicyLoadError, match="unknown dispatch policy 'nope'"):
        load_dispatch_policy("nope")
    with pytest.raises(PolicyLoadError, match="cannot load"):
        load_dispatch_policy("policies.kvherd:Missing")
    with pytest.raises(PolicyLoadError, match="bad parameters"):
        load_dispatch_policy("kvherd", bogus=1)
    with pytest.raises(PolicyLoadError, match="not a dispatch policy"):
        load_dispatch_policy("policies.migrate_drain:DrainMigration")
    with pytest.raises(PolicyLoadError, match="not a migration policy"):
        load_migration_policy("policies.kvherd:KvherdDispatch")


# -- migration policies -----------------------------------------------------------------------


def running(*blocks: int, prefix: str = "q") -> tuple[RunningRequestView, ...]:
    return tuple(RunningRequestView(f"{prefix}{k}", n * 16, n) for k, n in enumerate(blocks))


def test_llumnix_migration_moves_shortest_from_least_free_to_freest() -> None:
    view = cluster(
        InstanceView(
            "hot",
            capacity=1000,
            free_blocks=20,
            num_running=10,
            freeness=2.0,
            running=running(40, 8, 30, prefix="h"),
        ),
        InstanceView(
            "warm",
            capacity=1000,
            free_blocks=200,
            num_running=10,
            freeness=20.0,
            running=running(5),
        ),
        InstanceView("cold", capacity=1000, free_blocks=900, num_running=2, freeness=450.0),
    )
    orders = load_migration_policy("llumnix").plan(view)
    assert [(o.request_id, o.src, o.dst) for o in orders] == [("h1", "hot", "cold")]


def test_llumnix_migration_passes_over_a_request_about_to_finish() -> None:
    """The shortest request has 10 tokens of budget left: it would finish before a copy commits."""
    ending, long = (
        RunningRequestView("ending", 32, 2, remaining_tokens=10),
        RunningRequestView("long", 160, 10, remaining_tokens=500),
    )

    def view(*requests: RunningRequestView) -> ClusterView:
        return cluster(
            InstanceView(
                "hot", capacity=100, free_blocks=2, num_running=2, freeness=1.0, running=requests
            ),
            InstanceView("cold", capacity=1000, free_blocks=900, num_running=1, freeness=900.0),
        )

    policy = load_migration_policy("llumnix")
    assert [o.request_id for o in policy.plan(view(ending, long))] == ["long"]
    # With nothing else to move, it still goes (moving it frees its blocks a little sooner).
    assert [o.request_id for o in policy.plan(view(ending))] == ["ending"]
    # Unknown budgets (a report without max_tokens) rank by blocks alone, as before.
    unknown = RunningRequestView("unknown", 32, 2)
    assert [o.request_id for o in policy.plan(view(unknown, long))] == ["unknown"]


def test_llumnix_migration_reacts_to_preemption_and_draining() -> None:
    policy = load_migration_policy("llumnix")

    def view(preemptions: int, draining: bool = False) -> ClusterView:
        return cluster(
            InstanceView(
                "a",
                capacity=1000,
                free_blocks=500,
                num_running=5,
                freeness=100.0,
                num_preemptions=preemptions,
                draining=draining,
                running=running(7, 3),
            ),
            InstanceView("b", capacity=1000, free_blocks=900, num_running=1, freeness=900.0),
        )

    assert policy.plan(view(4)) == []  # first sight: a baseline, not an increase
    orders = policy.plan(view(6))
    assert [(o.request_id, o.src, o.dst) for o in orders] == [("q1", "a", "b")]
    assert policy.plan(view(6)) == []
    assert [o.src for o in policy.plan(view(6, draining=True))] == ["a"]


def test_defrag_frees_room_for_blocked_head_of_line() -> None:
    view = cluster(
        # Head needs 50 blocks, 10 free: deficit 40 -> move the 30 and the 12 (largest first).
        InstanceView(
            "blocked",
            capacity=200,
            free_blocks=10,
            head_waiting_blocks=50,
            num_running=3,
            num_waiting=1,
            freeness=-10.0,
            running=running(30, 5, 12),
        ),
        InstanceView("x", capacity=200, free_blocks=35, freeness=35.0),
        InstanceView("y", capacity=200, free_blocks=20, freeness=20.0),
    )
    orders = load_migration_policy("defrag").plan(view)
    assert [(o.request_id, o.dst) for o in orders] == [("q0", "x"), ("q2", "y")]
    # Not enough room anywhere: nothing is moved at all.
    tight = cluster(view["blocked"], InstanceView("x", capacity=200, free_blocks=31))
    assert load_migration_policy("defrag").plan(tight) == []


def test_drain_moves_everything_that_fits() -> None:
    view = cluster(
        InstanceView("d", capacity=100, draining=True, running=running(10, 20, 90)),
        InstanceView("x", capacity=100, free_blocks=40),
        InstanceView("y", capacity=100, free_blocks=25),
    )
    orders = load_migration_policy("drain").plan(view)
    # Shortest first: 10 -> x (40 room), 20 -> x (30 left), 90 fits nowhere.
    assert [(o.request_id, o.dst) for o in orders] == [("q0", "x"), ("q1", "x")]
    assert math.isinf(InstanceView("idle").freeness)


def test_policies_import_nothing_else_of_kvherd() -> None:
    """Plug-ins depend on `policies` alone; it must not pull in the engine or the scheduler."""
    import ast
    from pathlib import Path

    forbidden = {"instance_agent", "scheduler", "simulator", "migration", "kvherd"}
    root = Path(__file__).resolve().parents[2] / "policies"
    for path in root.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            for name in names:
                assert name.split(".")[0] not in forbidden, f"{path.name} imports {name}"


def test_kvherd_small_fleet_path_decides_exactly_like_the_vectorised_one() -> None:
    rng = random.Random(7)
    scalar, vectorised = KvherdDispatch(explain_top=3), KvherdDispatch(explain_top=3)
    for case in range(300):
        n = rng.randrange(1, 12)
        instances = [
            InstanceView(
                f"i{k}",
                capacity=rng.choice((0, 500)),
                free_blocks=rng.randrange(0, 200),
                num_running=rng.randrange(0, 4),
                waiting_prefill_tokens=rng.choice((0, 0, 160, 320)),
                head_waiting_blocks=rng.randrange(0, 20),
                inflight=rng.choice((0, 1, 140, 300)),  # exercises the hot-spot guard
                healthy=rng.random() > 0.1,
            )
            for k in range(n)
        ]
        matched = {f"i{k}": rng.choice((0, 5, 10)) for k in range(n)}
        req = request(rng.choice((160, 800)), rid=f"r{case}")
        view = cluster(*instances, matched=matched)
        try:
            want = vectorised.choose_vectorised(req, view)
        except NoInstanceError:
            with pytest.raises(NoInstanceError):
                scalar.choose_scalar(req, view)
            continue
        got = scalar.choose_scalar(req, view)  # ties drawn from the same seeded coin
        assert (got.instance_id, got.scores, got.reason) == (
            want.instance_id,
            want.scores,
            want.reason,
        )


def test_prefix_match_walks_once_whichever_form_is_asked_first() -> None:
    """A view with both matchers (the scheduler core's) derives the second form from the first:
    the scalar path never builds an array, the vectorised path never a mapping, and both agree."""
    instances = [InstanceView("a"), InstanceView("b"), InstanceView("c")]
    table = {"a": 3, "c": 7}
    calls: list[str] = []

    def matcher(req: RequestView) -> dict[str, int]:
        calls.append("dict")
        return dict(table)

    def array_matcher(req: RequestView) -> np.ndarray:
        calls.append("array")
        return np.array([float(table.get(inst.instance_id, 0)) for inst in instances])

    req = request()
    view = ClusterView(instances, 0.0, matcher, array_matcher=array_matcher)
    assert view.prefix_match_of(req, "c") == 7 and view.prefix_match_of(req, "b") == 0
    assert view.prefix_match_array(req).tolist() == [3.0, 0.0, 7.0]
    assert calls == ["dict"]
    calls.clear()
    view = ClusterView(instances, 0.0, matcher, array_matcher=array_matcher)
    assert view.prefix_match_array(req).tolist() == [3.0, 0.0, 7.0]
    assert view.prefix_match_of(req, "a") == 3
    assert dict(view.prefix_match(req)) == table
    assert calls == ["array"]


def test_kvherd_spreads_new_prefixes_to_the_instance_holding_fewer_blocks() -> None:
    """At equal load a new prefix goes where the index holds less (the traffic its affinity draws
    later spreads too), where ties alone would split them at random; a cached prefix still
    follows its cache."""
    from kvherd.block_hash import block_hash_chain
    from kvherd.kv_events import BlockStored, KVEventBatch
    from scheduler.core.cluster_state import ClusterState
    from scheduler.core.router import Router

    def placed(**params: float) -> list[str]:
        cluster = ClusterState(block_size=16)
        for name in ("a", "b"):
            cluster.add_instance(name, has_kv_events=True, trust_engine_hashes=True)
        held = [(11 * k) % 30000 + 1 for k in range(1600)]  # 100 blocks on a
        chain = block_hash_chain(held, 16)
        cluster.apply_kv_batch("a", KVEventBatch(0, 0.0, [BlockStored(chain, None, held, 16)]))
        router = Router(cluster, load_dispatch_policy("kvherd", **params))
        out = []
        for k in range(16):
            fresh = [(k * 977 + 3 * j) % 30000 + 1 for j in range(320)]
            out.append(router.route(f"new-{k}", fresh, now=float(k)).instance_id)
            router.on_finish(f"new-{k}", now=k + 0.5)
        assert router.route("cached", [*held[:1280], 5, 6, 7], now=20.0).instance_id == "a"
        return out

    assert placed() == ["b"] * 16
    assert "a" in placed(spread_slack=0)  # the tie-break alone
