"""Tier-aware routing: kvherd prices a lower-tier hit as its load time; the peers use their
projects' tier weights."""

from __future__ import annotations

import random

import numpy as np
import pytest

from policies.dynamo_kv import DynamoKV
from policies.kvherd import KvherdDispatch
from policies.plugins.scorers import PrefixCacheScorer
from policies.views import ClusterView, InstanceView, RequestView

BS = 16
REQUEST = RequestView("r", 64 * BS, tuple(range(64)), BS)


def view(instances: list[InstanceView], tiers: list[list[float]]) -> ClusterView:
    """A hand-built view whose match per tier is `tiers` (rows GPU, CPU, STORAGE)."""
    table = np.array(tiers, dtype=np.float64)
    gpu = {inst.instance_id: int(d) for inst, d in zip(instances, table[0], strict=True) if d}
    return ClusterView(
        instances, 0.0, lambda request: gpu, tier_matcher=lambda request, _gpu: table[1:]
    )


def idle(name: str, **fields: float) -> InstanceView:
    return InstanceView(name, capacity=10_000, free_blocks=10_000, **fields)  # type: ignore[arg-type]


def test_a_lower_tier_hit_costs_its_load_time_never_free_never_a_miss() -> None:
    policy = KvherdDispatch()
    instances = [idle("gpu"), idle("cpu"), idle("disk"), idle("miss")]
    costs = [
        policy.cost(REQUEST, instances[0], 48),
        policy.cost(REQUEST, instances[1], 0, cpu_blocks=48),
        policy.cost(REQUEST, instances[2], 0, storage_blocks=48),
        policy.cost(REQUEST, instances[3], 0),
    ]
    assert costs == sorted(costs) and len(set(costs)) == 4
    # The load time, in prefill tokens: 48 blocks x 16 tokens x the tier's ratio.
    assert costs[1] - costs[0] == pytest.approx(48 * BS * 0.05)
    assert costs[2] - costs[0] == pytest.approx(48 * BS * 0.4)
    decision = policy.choose(REQUEST, view(instances[1:], [[0, 0, 0], [48, 0, 0], [0, 48, 0]]))
    assert decision.instance_id == "cpu"


def test_a_per_instance_load_ratio_overrides_the_default() -> None:
    policy = KvherdDispatch()
    slow = idle("slow-cpu", cpu_load_ratio=20.0)  # loading costs more than recomputing
    fast = idle("fast-disk", storage_load_ratio=0.01)
    assert policy.cost(REQUEST, slow, 0, cpu_blocks=48) > policy.cost(REQUEST, slow, 0)
    assert policy.cost(REQUEST, fast, 0, storage_blocks=48) == policy.ttft_cost(
        REQUEST, 0, 0, 0, -10_000, 1, max, 48, 48 * BS * 0.01
    )


def test_scalar_and_vectorised_decisions_agree_with_tiers() -> None:
    rng = random.Random(3)
    for case in range(100):
        n = rng.choice([3, 9, 40])
        instances = [
            InstanceView(
                f"i{k}",
                capacity=4096,
                free_blocks=rng.randrange(4096),
                num_running=rng.randrange(8),
                waiting_prefill_tokens=rng.randrange(4096),
                head_waiting_blocks=rng.randrange(64),
                cpu_load_ratio=rng.choice([0.0, 0.02, 0.3]),
                storage_load_ratio=rng.choice([0.0, 0.5]),
            )
            for k in range(n)
        ]
        tiers = [[float(rng.randrange(0, 20)) for _ in range(n)] for _ in range(3)]
        scalar, vectorised = KvherdDispatch(seed=case), KvherdDispatch(seed=case)
        a = scalar.choose_scalar(REQUEST, view(instances, tiers))
        b = vectorised.choose_vectorised(REQUEST, view(instances, tiers))
        assert a.instance_id == b.instance_id
        assert a.scores == b.scores


def test_dynamo_weighs_host_and_disk_blocks_as_its_router_does() -> None:
    instances = [idle("a"), idle("b")]
    cluster = view(instances, [[8, 0], [4, 0], [0, 12]])
    assert cluster.weighted_prefix_match(REQUEST, (1.0, 0.75, 0.25)) == {"a": 11.0, "b": 3.0}
    decision = DynamoKV().choose(REQUEST, cluster)
    logit_a = DynamoKV().logit(REQUEST, instances[0], 8 + 0.75 * 4)
    assert decision.instance_id == "a" and decision.scores["a"] == -logit_a


def test_llmd_prefix_scorer_weighs_cpu_blocks_0_8() -> None:
    instances = [idle("a"), idle("b")]
    cluster = view(instances, [[32, 0], [0, 64], [0, 0]])
    scores = PrefixCacheScorer().score(REQUEST, cluster, instances)
    assert scores == {"a": 0.5, "b": 0.8}
