"""Routing by model: the model index, the core's view limited to a model's instances, and
vLLM's LoRA figures (``/v1/models`` cards, ``vllm:lora_requests_info``) as the scheduler reads them."""

from __future__ import annotations

import pytest

from policies import load_dispatch_policy
from scheduler.core.cluster_state import ClusterState
from scheduler.core.load_report import LoadReport, parse_prometheus
from scheduler.core.model_index import ModelIndex, UnknownModelError
from scheduler.core.router import Router
from scheduler.model_poller import ModelListError, parse_models

# What vLLM 0.32 answers on GET /v1/models with --lora-modules A=... B=... (trimmed of
# "permission"), checked against the real server (tests/vllm/test_vllm_models.py).
VLLM_MODELS = {
    "object": "list",
    "data": [
        {"id": "tiny", "object": "model", "owned_by": "vllm", "root": "/m/tiny", "parent": None,
         "max_model_len": 4096, "permission": [{"id": "modelperm-1"}]},
        {"id": "A", "object": "model", "owned_by": "vllm", "root": "/m/lora_A", "parent": "tiny",
         "max_model_len": None},
        {"id": "B", "object": "model", "owned_by": "vllm", "root": "/m/lora_B", "parent": "tiny",
         "max_model_len": None},
    ],
}  # fmt: skip


def card(name: str, parent: str | None = None) -> dict[str, object]:
    return {"id": name, "object": "model", "parent": parent}


def test_vllm_model_list_keeps_adapters_with_their_parent() -> None:
    cards = parse_models(VLLM_MODELS)
    assert [(c["id"], c["parent"]) for c in cards] == [("tiny", None), ("A", "tiny"), ("B", "tiny")]
    assert "permission" not in cards[0] and cards[1]["root"] == "/m/lora_A"
    for bad in ({}, {"data": [{"object": "model"}]}, {"data": [{"id": "x", "parent": 3}]}, []):
        with pytest.raises(ModelListError):
            parse_models(bad)


def test_index_routes_each_model_to_its_instances_and_rebuilds_on_change() -> None:
    index = ModelIndex()
    assert index.set_models("a", [card("tiny"), card("A", "tiny"), card("B", "tiny")])
    assert index.set_models("b", [card("tiny"), card("C", "tiny")])
    assert not index.set_models("b", [card("tiny"), card("C", "tiny")])  # a steady poll
    restamped = [{**card("tiny"), "created": 2}, {**card("C", "tiny"), "created": 2}]
    assert not index.set_models("b", restamped)  # vLLM stamps every listing with its time
    assert index.route("tiny") is None  # every instance: no restriction
    assert index.route(None) is None
    assert index.route("A") == index.route("B") == frozenset({"a"})
    assert index.route("C") == frozenset({"b"})
    assert index.route("A") is index.route("A")  # the same object: cheap as a cache key
    assert index.parent("A") == "tiny" and index.parent("tiny") is None
    with pytest.raises(UnknownModelError):
        index.route("D")
    assert [c["id"] for c in index.cards()] == ["tiny", "A", "B", "C"]
    index.set_models("b", [card("tiny"), card("C", "tiny"), card("A", "tiny")])  # loaded A
    assert index.route("A") is None
    index.remove_instance("a")  # B was served by "a" alone
    with pytest.raises(UnknownModelError):
        index.route("B")
    assert index.models_of("b") == ["tiny", "C", "A"] and index.models_of("a") is None


def test_an_instance_whose_models_are_unknown_may_take_any_model() -> None:
    index = ModelIndex()
    index.set_models("known", [card("m1")])
    index.set_models("silent", None)
    assert index.route("m1") is None  # both may
    assert index.route("m2") == frozenset({"silent"})
    index.remove_instance("silent")
    with pytest.raises(UnknownModelError):
        index.route("m2")


def prompt(i: int) -> list[int]:
    return list(range(1000 * i, 1000 * i + 40))


def test_router_dispatches_only_among_the_models_instances() -> None:
    cluster = ClusterState(block_size=16)
    for name in ("a", "b", "c", "d"):
        cluster.add_instance(name)
    router = Router(cluster, load_dispatch_policy("kvherd"))
    only = frozenset({"b", "d"})
    chosen = [router.route(f"r{i}", prompt(i), now=0.0, only=only).instance_id for i in range(8)]
    assert set(chosen) == {"b", "d"}  # balanced over the two, never elsewhere
    assert cluster.view(0.0, only=only).dispatchable[0].instance_id == "b"
    with pytest.raises(ValueError, match="already routed"):
        router.route("r0", prompt(0), now=0.0, only=only)
    # Excluding one of them (a retry) leaves the other; a policy never sees the rest.
    retry = router.route("x", prompt(20), now=0.0, only=only, exclude={"b"})
    assert retry.instance_id == "d"
    cluster.remove_instance("d")  # membership changes drop the cached positions
    assert router.route("y", prompt(21), now=0.0, only=only).instance_id == "b"


def test_vllm_lora_gauge_newest_sample_is_the_current_state() -> None:
    # vLLM 0.32 keeps one sample per label set ever seen, valued with the time it was set.
    text = "\n".join(
        [
            "# HELP vllm:lora_requests_info Running stats on lora requests.",
            "# TYPE vllm:lora_requests_info gauge",
            'vllm:lora_requests_info{max_lora="2",running_lora_adapters="A",'
            'waiting_lora_adapters="A"} 1.796173280855264e+09',
            'vllm:lora_requests_info{max_lora="2",running_lora_adapters="B,C",'
            'waiting_lora_adapters="C"} 1.79617331e+09',
            'vllm:lora_requests_info{max_lora="2",running_lora_adapters="",'
            'waiting_lora_adapters=""} 1.7961732809e+09',
            "",
        ]
    )
    report = parse_prometheus(text)
    assert report.active_adapters == ("B", "C") and report.lora_slots == 2
    assert parse_prometheus("vllm:num_requests_running 1\n").active_adapters is None


def test_adapters_in_flight_count_as_active_until_they_finish() -> None:
    cluster = ClusterState(block_size=16)
    cluster.add_instance("a")
    cluster.apply_report("a", LoadReport(active_adapters=("X",), lora_slots=2), now=0.0)
    router = Router(cluster, load_dispatch_policy("kvherd"))
    router.route("r", list(range(20)), now=0.0, adapter="Y")
    view = cluster.view(0.0)["a"]
    assert view.active_adapters == {"X", "Y"} and view.lora_slots == 2
    router.on_finish("r", now=1.0)
    assert cluster.view(1.0)["a"].active_adapters == {"X"}
