"""Cache truth: the engine's reported hits checked against the KV-event index's claims, and a
diverging instance routed by the approximate index until it agrees again."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvherd.block_hash import block_hash_chain
from kvherd.kv_events import BlockStored, KVEventBatch
from policies import load_dispatch_policy
from scheduler.core.cache_truth import CacheTruth, TruthSettings
from scheduler.core.cluster_state import ClusterState
from scheduler.core.router import Router

BLOCK = 16


def tokens(n: int, seed: int) -> list[int]:
    return [(seed * 7919 + k * 31) % 30000 for k in range(n)]


def test_a_check_allows_one_block_short_and_counts_what_was_recomputed() -> None:
    truth = CacheTruth()
    truth.expect("full", "a", 320, BLOCK)
    assert truth.observe("full", "m", 304) is None  # a full hit reads one block short
    truth.expect("none", "a", 320, BLOCK)
    truth.observe("none", "m", 0)
    truth.expect("more", "a", 0, BLOCK)  # claimed nothing: counted, not in the window
    truth.observe("more", "m", 128)
    totals = truth.totals["a", "m"]
    assert (totals.checks, totals.claimed_tokens, totals.missing_tokens) == (3, 640, 304)
    assert truth.divergence("a") == pytest.approx(304 / 640)
    assert truth.observe("none", "m", 0) is None  # each dispatch is checked once
    truth.expect("gone", "a", 320, BLOCK)
    truth.forget("gone")
    assert truth.observe("gone", "m", 0) is None and truth.totals["a", "m"].checks == 3


def test_an_instance_turns_past_the_ratio_and_back_over_fresh_checks() -> None:
    truth = CacheTruth(TruthSettings(window=8, min_checks=4, diverge_ratio=0.3, agree_ratio=0.1))
    turns = []
    for k in range(4):  # recomputes everything its events claim
        truth.expect(f"r{k}", "a", 160, BLOCK)
        turns.append(truth.observe(f"r{k}", "m", 0))
    assert turns[:3] == [None, None, None]
    turn = turns[3]
    assert turn is not None and turn.diverging and turn.checks == 4
    assert (turn.claimed_tokens, turn.missing_tokens) == (640, 576)
    assert truth.diverging("a") and truth.divergence("a") == 0.0  # the window restarted
    for k in range(3):  # agreeing again, but not yet over min_checks fresh checks
        truth.expect(f"s{k}", "a", 160, BLOCK)
        assert truth.observe(f"s{k}", "m", 160) is None
    truth.expect("s3", "a", 160, BLOCK)
    back = truth.observe("s3", "m", 144)
    assert back is not None and not back.diverging and not truth.diverging("a")


def test_a_few_evictions_do_not_turn_an_instance() -> None:
    truth = CacheTruth()
    for k in range(64):
        truth.expect(f"r{k}", "a", 320, BLOCK)
        cached = 0 if k % 8 == 0 else 320  # one in eight evicted before it ran
        assert truth.observe(f"r{k}", "m", cached) is None
    assert not truth.diverging("a") and truth.divergence("a") < 0.3


@pytest.mark.parametrize(
    "settings",
    [
        dict(window=0),
        dict(window=4, min_checks=5),
        dict(agree_ratio=0.5, diverge_ratio=0.3),
        dict(diverge_ratio=1.5),
    ],
)
def test_bad_settings(settings: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        TruthSettings(**settings)  # type: ignore[arg-type]


def _fleet() -> tuple[ClusterState, Router]:
    cluster = ClusterState(block_size=BLOCK)
    for name in ("a", "b"):
        cluster.add_instance(name, has_kv_events=True, trust_engine_hashes=True)
    return cluster, Router(cluster, load_dispatch_policy("kvherd"))


def _stored(cluster: ClusterState, instance_id: str, prompt: list[int], seq: int) -> None:
    chain = block_hash_chain(prompt, BLOCK)
    batch = KVEventBatch(seq, 0.0, [BlockStored(chain, None, prompt, BLOCK)])
    cluster.apply_kv_batch(instance_id, batch)


def test_a_distrusted_instance_is_matched_by_the_approximate_index_alone() -> None:
    cluster, router = _fleet()
    held = tokens(320, 1)  # a's events say it holds this prompt
    _stored(cluster, "a", held, 0)
    chain = block_hash_chain(held, BLOCK)
    routed = router.route("r1", held + tokens(16, 2), now=0.0)
    assert routed.instance_id == "a" and routed.claimed_blocks == 20
    router.on_finish("r1", now=0.1)
    cluster.set_index_trusted("a", False)
    assert not cluster.index_trusted("a")
    # Its events no longer count for routing, but still answer the truth check.
    assert cluster.match(chain, now=10.0) == {}
    assert cluster.claimed_depth(chain, "a") == 20
    # What is routed there now is recorded whole, at the approximate TTL (not the 5 s pending).
    other = tokens(160, 3)
    routed = router.route("r2", other, now=20.0, exclude={"b"})
    assert routed.instance_id == "a" and routed.matched_blocks == 0
    router.on_finish("r2", now=20.1)
    assert cluster.match(block_hash_chain(other, BLOCK), now=60.0) == {"a": 10}
    cluster.set_index_trusted("a", True)
    assert cluster.match(chain, now=61.0)["a"] == 20
    # A re-join starts trusted.
    cluster.set_index_trusted("a", False)
    cluster.add_instance("a", has_kv_events=True, trust_engine_hashes=True)
    assert cluster.index_trusted("a")


def test_check_turns_the_cluster_and_routing_follows() -> None:
    """An instance whose events claim a prefix its engine never hits stops attracting that
    prefix: after the turn, requests spread by load instead of piling onto the false holder."""
    cluster, router = _fleet()
    truth = CacheTruth(TruthSettings(window=8, min_checks=4))
    prefix = tokens(480, 7)
    _stored(cluster, "a", prefix, 0)  # a false claim: the engine recomputes it every time
    placed = []
    for k in range(12):
        rid = f"r{k}"
        routed = router.route(rid, prefix + tokens(32, 100 + k), now=float(k))
        placed.append(routed.instance_id)
        assert routed.claimed_blocks is not None
        truth.expect(rid, routed.instance_id, routed.claimed_blocks * BLOCK, BLOCK)
        truth.check(cluster, rid, "m", 0)
        router.on_finish(rid, now=k + 0.5)
    assert placed[:4] == ["a"] * 4  # the claimed prefix attracts them
    assert not cluster.index_trusted("a") and truth.diverging("a")
    assert "b" in placed[4:]  # then the approximate view (b holds them too) and load decide


def test_the_simulator_runs_the_check_and_its_events_are_true() -> None:
    """With room for the fleet's prefixes, every simulated engine hits what its events claimed
    (0 missing tokens over every request of the Mooncake sample)."""
    from simulator.cluster import ClusterConfig, SimCluster
    from simulator.instance import InstanceConfig
    from simulator.latency import load_latency_model
    from simulator.traces import load_trace

    trace = load_trace(
        Path(__file__).resolve().parents[2] / "traces/mooncake/synthetic_trace_600.jsonl"
    )
    config = ClusterConfig(
        num_instances=4,
        instance=InstanceConfig(num_blocks=4000, block_size=512, max_num_batched_tokens=8192),
    )
    latency = load_latency_model("roofline:llama-2-7b:a100-80gb")
    cluster = SimCluster(config, latency, load_dispatch_policy("kvherd"))
    cluster.run(trace)
    checks = sum(t.checks for t in cluster.truth.totals.values())
    claimed = sum(t.claimed_tokens for t in cluster.truth.totals.values())
    assert checks == len(trace) and claimed > 0
    assert cluster.truth.missing_tokens() == 0
