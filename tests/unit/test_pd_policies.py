"""P/D pairing policies: roles respected, conditional disaggregation, cache and load awareness."""

from __future__ import annotations

from collections.abc import Mapping

import pytest

from policies.base import PDPolicy
from policies.registry import PD_POLICIES, PolicyLoadError, load_pd_policy
from policies.views import ClusterView, InstanceView, NoInstanceError, PDDecision, RequestView

BS = 16


def request(num_tokens: int, rid: str = "r") -> RequestView:
    blocks = num_tokens // BS
    return RequestView(rid, num_tokens, tuple(range(1, blocks + 1)), block_size=BS)


def cluster(instances: list[InstanceView], match: Mapping[str, int] | None = None) -> ClusterView:
    found = dict(match or {})
    return ClusterView(instances, 0.0, matcher=lambda _req: found)


def inst(iid: str, role: str, **fields: object) -> InstanceView:
    defaults: dict[str, object] = {"capacity": 1000, "free_blocks": 1000}
    defaults.update(fields)
    return InstanceView(iid, role=role, **defaults)  # type: ignore[arg-type]


@pytest.mark.parametrize("name", sorted(PD_POLICIES))
def test_every_builtin_respects_roles(name: str) -> None:
    policy = load_pd_policy(name)
    assert isinstance(policy, PDPolicy)
    fleet = [
        inst("p0", "prefill"),
        inst("p1", "prefill"),
        inst("d0", "decode"),
        inst("d1", "decode"),
    ]
    for tokens in (16, 4096):
        decision = policy.pair(request(tokens), cluster(fleet))
        assert decision.decode in {"d0", "d1"}
        # Short prompts stay on their decode instance; long ones prefill on a prefill instance.
        assert decision.prefill in ({"d0", "d1"} if tokens == 16 else {"p0", "p1"})
        assert decision.disaggregated == (tokens == 4096)


@pytest.mark.parametrize("name", sorted(PD_POLICIES))
def test_every_builtin_needs_both_phases(name: str) -> None:
    policy = load_pd_policy(name)
    with pytest.raises(NoInstanceError):
        policy.pair(request(4096), cluster([inst("p0", "prefill")]))
    with pytest.raises(NoInstanceError):
        policy.pair(
            request(4096), cluster([inst("d0", "decode", healthy=False), inst("p", "prefill")])
        )
    # A mixed instance does both: no handoff is possible, and none is asked for.
    decision = policy.pair(request(4096), cluster([inst("m", "mixed")]))
    assert decision == PDDecision("m", "m", decision.reason) and not decision.disaggregated


def test_kvherd_pd_prefill_by_cache_affinity_decode_by_load_and_held_blocks() -> None:
    policy = load_pd_policy("kvherd")
    fleet = [
        inst("p0", "prefill"),
        inst("p1", "prefill"),
        inst("d0", "decode", num_running=8),
        inst("d1", "decode", num_running=1),
    ]
    # p1 caches the prompt's first 200 blocks: prefill goes there; d1 decodes less.
    decision = policy.pair(request(4096), cluster(fleet, {"p1": 200}))
    assert (decision.prefill, decision.decode) == ("p1", "d1")
    # Equal decode load: the decode instance already holding the prefix needs fewer blocks moved.
    fleet[2] = inst("d0", "decode", num_running=1)
    decision = policy.pair(request(4096), cluster(fleet, {"p1": 200, "d0": 100}))
    assert decision.decode == "d0"
    # A decode instance caching nearly all of the prompt computes the rest itself.
    decision = policy.pair(request(4096), cluster(fleet, {"d0": 250}))
    assert decision == PDDecision("d0", "d0", decision.reason)


def test_kvherd_pd_avoids_a_decode_instance_short_of_memory() -> None:
    policy = load_pd_policy("kvherd")
    fleet = [
        inst("p0", "prefill"),
        inst("d0", "decode", free_blocks=10),
        inst("d1", "decode", num_running=3),
    ]
    assert policy.pair(request(4096), cluster(fleet)).decode == "d1"


def test_llmd_pd_threshold_counts_tokens_cached_on_the_decode_instance() -> None:
    policy = load_pd_policy("llmd", threshold=512)
    fleet = [inst("p0", "prefill"), inst("d0", "decode")]
    assert not policy.pair(request(496), cluster(fleet)).disaggregated
    assert policy.pair(request(4096), cluster(fleet)).disaggregated
    # 4096 - 16 * 240 = 256 < 512 tokens left to compute on d0: decode-only.
    assert not policy.pair(request(4096), cluster(fleet, {"d0": 240})).disaggregated


def test_dynamo_pd_remote_prefill_goes_to_the_least_queued_prefill_instance() -> None:
    policy = load_pd_policy("dynamo")
    fleet = [
        inst("p0", "prefill", waiting_prefill_tokens=9000),
        inst("p1", "prefill", pending_prefill_tokens=100),
        inst("d0", "decode"),
    ]
    assert policy.pair(request(4096), cluster(fleet)) == PDDecision(
        "p1", "d0", "4096 tokens: remote"
    )
    assert not policy.pair(request(992), cluster(fleet)).disaggregated


def test_pd_policies_are_deterministic_under_their_seed() -> None:
    fleet = [inst(f"p{i}", "prefill") for i in range(4)] + [
        inst(f"d{i}", "decode") for i in range(4)
    ]
    for name in PD_POLICIES:
        runs = [
            [
                load_pd_policy(name, seed=3).pair(request(4096, f"r{i}"), cluster(fleet))
                for i in range(20)
            ]
            for _ in range(2)
        ]
        assert runs[0] == runs[1]


def test_load_pd_policy_refuses_other_kinds() -> None:
    with pytest.raises(PolicyLoadError, match="not a P/D policy"):
        load_pd_policy("policies.kvherd:KvherdDispatch")
    with pytest.raises(PolicyLoadError, match="unknown pd policy"):
        load_pd_policy("nope")
    assert load_pd_policy("policies.pd_kvherd:KvherdPD", local_prefill_tokens=0).name == "kvherd"
