"""LoRA affinity (llm-d's lora-affinity-scorer): held > free slot > must evict, and load can win."""

from __future__ import annotations

from policies import ClusterView, InstanceView, RequestView
from policies.kvherd import KvherdDispatch
from policies.lora_affinity import EVICT, FREE_SLOT, LOADED, LoraAffinityScorer, affinity
from policies.pipeline import Pipeline

HELD = InstanceView("held", active_adapters=frozenset({"A", "B"}), lora_slots=2)
FREE = InstanceView("free", active_adapters=frozenset({"B"}), lora_slots=2)
FULL = InstanceView("full", active_adapters=frozenset({"B", "C"}), lora_slots=2)
UNKNOWN = InstanceView("unknown")  # no LoRA request seen yet: slots unknown


def lora_request(adapter: str | None = "A", rid: str = "r") -> RequestView:
    return RequestView(rid, 160, tuple(range(1, 11)), 16, adapter=adapter)


def test_affinity_tiers() -> None:
    assert affinity("A", HELD) == LOADED
    assert affinity("A", FREE) == FREE_SLOT == affinity("A", UNKNOWN)
    assert affinity("A", FULL) == EVICT
    assert affinity(None, FULL) == LOADED  # base-model requests do not care
    view = ClusterView([HELD, FREE, FULL], now=0.0)
    scores = LoraAffinityScorer().score(lora_request(), view, view.instances)
    assert scores == {"held": 1.0, "free": 0.8, "full": 0.0}


def test_kvherd_prefers_held_then_free_slot_then_evict() -> None:
    policy = KvherdDispatch()
    for instances, expected in (
        ([FULL, FREE, HELD], "held"),
        ([FULL, FREE], "free"),
        ([FULL], "full"),  # evicting still serves
    ):
        view = ClusterView(instances, now=0.0, matcher=lambda r: {})
        assert policy.choose(lora_request(), view).instance_id == expected
    # Without an adapter the residency is irrelevant: equal instances tie.
    view = ClusterView([FULL, HELD], now=0.0, matcher=lambda r: {})
    costs = policy.choose(lora_request(None), view).scores
    assert costs["full"] == costs["held"]


def test_load_can_outweigh_affinity() -> None:
    busy_held = InstanceView(
        "held", active_adapters=frozenset({"A"}), lora_slots=2, waiting_prefill_tokens=5000
    )
    view = ClusterView([busy_held, FREE], now=0.0, matcher=lambda r: {})
    assert KvherdDispatch().choose(lora_request(), view).instance_id == "free"


def test_vectorised_and_scalar_decisions_agree_for_an_adapter() -> None:
    policy = KvherdDispatch()
    fleet = [FULL, FREE, HELD] * 8
    fleet = [
        InstanceView(
            f"{inst.instance_id}{i}",
            active_adapters=inst.active_adapters,
            lora_slots=inst.lora_slots,
            waiting_prefill_tokens=37 * i,
        )
        for i, inst in enumerate(fleet)
    ]
    view = ClusterView(fleet, now=0.0, matcher=lambda r: {})
    assert (
        policy.choose_scalar(lora_request(), view).instance_id
        == policy.choose_vectorised(lora_request(), view).instance_id
    )


def test_pipeline_declares_the_scorer_by_llmd_name() -> None:
    pipeline = Pipeline.from_config(
        {"scorers": [{"type": "lora-affinity-scorer", "weight": 1}], "picker": "max-score-picker"}
    )
    view = ClusterView([FULL, FREE, HELD], now=0.0, matcher=lambda r: {})
    assert pipeline.choose(lora_request(), view).instance_id == "held"
