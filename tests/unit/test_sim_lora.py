"""Models and LoRA adapters in the simulator: traces naming models, adapter slots, routing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvherd.block_hash import block_hash_chain
from kvherd.cli import main
from policies import load_dispatch_policy, load_migration_policy
from policies.pipeline import Pipeline
from simulator.cluster import ClusterConfig, SimCluster
from simulator.instance import InstanceConfig, make_request
from simulator.latency import load_latency_model
from simulator.lora import AdapterSlots
from simulator.models import FleetModels, parse_base_models
from simulator.synthetic import SyntheticSpec, generate
from simulator.traces import Trace, TraceError, TraceRequest, load_trace

LATENCY = "roofline:llama-2-7b:a100-80gb"


# -- adapter slots -------------------------------------------------------------------------------


def test_slots_load_once_evict_the_least_recent_unpinned_and_queue_when_all_pinned() -> None:
    slots: AdapterSlots[str] = AdapterSlots(max_loras=2, load_s=0.5)
    assert slots.acquire("a", 0.0, "r1") == 0.5  # loads
    assert slots.acquire("a", 0.2, "r2") == 0.5  # joins the load in flight
    assert slots.acquire("b", 0.3, "r3") == pytest.approx(0.8)
    assert slots.acquire("a", 1.0, "r4") == 1.0  # loaded: ready now
    assert slots.stats.loads == 2 and slots.active == ("a", "b")
    assert slots.acquire("c", 1.0, "r5") is None  # both slots pinned: it waits
    assert slots.acquire("d", 1.0, "r6") is None
    assert slots.stats.slot_waits == 2
    assert slots.release("a", 1.1) == []  # "a" is still pinned by r2 and r4
    assert slots.release("a", 1.2) == []
    # r1..r4's "a" is gone: "c" takes its slot ("a" evicted), "d" still finds none.
    assert slots.release("a", 1.3) == [("r5", pytest.approx(1.8))]
    assert slots.resident() == ("b", "c") and slots.stats.evictions == 1
    assert slots.release("b", 2.0) == [("r6", 2.5)]
    assert slots.resident() == ("c", "d") and slots.active == ("c", "d")


def test_a_waiting_request_whose_adapter_got_a_slot_overtakes_one_still_without() -> None:
    slots: AdapterSlots[str] = AdapterSlots(max_loras=1, load_s=0.1)
    slots.acquire("a", 0.0, "r1")
    assert slots.acquire("b", 0.0, "r2") is None
    assert slots.acquire("b", 0.0, "r3") is None
    # Both wait for "b"; once "a" ends both start on the one load.
    assert slots.release("a", 1.0) == [("r2", pytest.approx(1.1)), ("r3", pytest.approx(1.1))]
    assert slots.stats.loads == 2


# -- the catalogue -------------------------------------------------------------------------------


def _named(*models: tuple[str | None, str | None]) -> Trace:
    rows = [
        TraceRequest(i, i * 0.1, 64, 4, (i,), model=model, parent=parent)
        for i, (model, parent) in enumerate(models)
    ]
    return Trace("named", rows, block_size=64)


def test_catalogue_lists_adapters_under_their_parent_and_routes_like_the_proxy() -> None:
    fleet = FleetModels(parse_base_models("llama=0-1,qwen=2"))
    trace = _named(("llama", None), ("sql", "llama"), ("chat", "qwen"), ("qwen", None))
    ids = ["i0", "i1", "i2"]
    cards = fleet.cards(trace, ids)
    assert cards["i0"] == [{"id": "llama", "parent": None}, {"id": "sql", "parent": "llama"}]
    assert cards["i2"] == [{"id": "qwen", "parent": None}, {"id": "chat", "parent": "qwen"}]
    routes = fleet.index(trace, ids)
    assert routes.of("llama") == (frozenset({"i0", "i1"}), None)
    assert routes.of("sql") == (frozenset({"i0", "i1"}), "sql")
    assert routes.of("chat") == (frozenset({"i2"}), "chat")
    with pytest.raises(ValueError, match="names no parent"):
        fleet.cards(_named(("orphan", None)), ids)
    with pytest.raises(ValueError, match="no base model"):
        FleetModels().cards(_named(("sql", "llama")), ids)
    with pytest.raises(ValueError, match="FIRST-LAST"):
        parse_base_models("llama=a-b")


# -- traces --------------------------------------------------------------------------------------


def test_traces_carry_a_model_column(tmp_path: Path) -> None:
    jsonl = tmp_path / "m.jsonl"
    rows = [
        {"arrival_s": 0.0, "input_length": 600, "output_length": 3, "model": "sql"},
        {"arrival_s": 0.5, "input_length": 600, "output_length": 3, "model": "chat",
         "parent": "qwen"},
        {"arrival_s": 1.0, "input_length": 600, "output_length": 3},
    ]  # fmt: skip
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in rows))
    csv_path = tmp_path / "m.csv"
    csv_path.write_text(
        "arrival_s,input_length,output_length,model,parent\n"
        "0.0,600,3,sql,\n0.5,600,3,chat,qwen\n1.0,600,3,,\n"
    )
    for path in (jsonl, csv_path):
        trace = load_trace(path)
        assert trace.has_models
        assert [(r.model, r.parent) for r in trace.requests] == [
            ("sql", None),
            ("chat", "qwen"),
            (None, None),
        ]
    plain = tmp_path / "plain.csv"
    plain.write_text("arrival_s,input_length,output_length\n0.0,600,3\n")
    assert not load_trace(plain).has_models
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"arrival_s": 0, "input_length": 5, "output_length": 1, "model": 7}))
    with pytest.raises(TraceError, match=r"bad.jsonl:1: model must be a string"):
        load_trace(bad)
    orphan = tmp_path / "orphan.csv"
    orphan.write_text("arrival_s,input_length,output_length,model,parent\n0,5,1,,qwen\n")
    with pytest.raises(TraceError, match=r"orphan.csv:2: parent 'qwen' given without a model"):
        load_trace(orphan)


def test_synthetic_adapters_are_zipf_popular_and_change_nothing_else() -> None:
    plain = generate(SyntheticSpec(requests=3000, num_groups=4, seed=3))
    named = generate(SyntheticSpec(requests=3000, num_groups=4, seed=3, adapters=16))
    assert not plain.has_models and named.has_models
    assert [(r.arrival_s, r.input_length, r.output_length, r.hash_ids) for r in plain.requests] == [
        (r.arrival_s, r.input_length, r.output_length, r.hash_ids) for r in named.requests
    ]
    counts = [sum(r.model == f"lora-{k}" for r in named.requests) for k in range(16)]
    assert counts[0] > 2 * counts[3] > 0  # Zipf(1): rank 1 ~ 4x rank 4
    assert sum(counts) == 3000


# -- the simulated fleet -------------------------------------------------------------------------


def _cluster(
    instances: int, dispatch: object, models: FleetModels, num_blocks: int = 2000
) -> SimCluster:
    config = ClusterConfig(
        num_instances=instances,
        instance=InstanceConfig(num_blocks=num_blocks, block_size=16, max_num_seqs=32),
        models=models,
    )
    return SimCluster(config, load_latency_model(LATENCY), dispatch)  # type: ignore[arg-type]


def _burst(
    models: list[str], input_length: int = 64, output: int = 200, gap: float = 0.05
) -> Trace:
    rows = [
        TraceRequest(i, i * gap, input_length, output, (1000 + i,), model=model)
        for i, model in enumerate(models)
    ]
    return Trace("burst", rows, block_size=4096)


def _where(cluster: SimCluster) -> dict[int, str]:
    cols = cluster.metrics.columns()
    return dict(zip(cols["index"].astype(int).tolist(), cols["instance"].tolist(), strict=True))


def _assert_clean(cluster: SimCluster, trace: Trace) -> None:
    assert cluster.metrics.failed == 0
    assert len(cluster.metrics.columns()["index"]) == len(trace)
    for iid, inst in cluster.instances.items():
        inst.block_manager.check_integrity()
        assert not inst.scheduler.has_unfinished()
        assert cluster.adapter_slots[iid].active == ()  # every pin released


def test_adapter_requests_load_first_and_hash_with_the_adapter_name() -> None:
    load_s = 0.25
    models = FleetModels(max_loras=1, lora_load_s=load_s)
    # Same prompt three times: base model, adapter "a", adapter "a" again (a prefix hit).
    rows = [
        TraceRequest(i, i * 1.0, 256, 2, (7,), model=m) for i, m in enumerate(["base", "a", "a"])
    ]
    trace = Trace("same-prompt", rows, block_size=256)
    cluster = _cluster(1, load_dispatch_policy("round_robin"), models)
    cluster.run(trace)
    _assert_clean(cluster, trace)
    cols = cluster.metrics.columns()
    ttft = cols["first_token"] - cols["arrival"]
    assert ttft[1] >= ttft[0] + load_s  # the adapter loaded before its prefill
    assert ttft[2] < ttft[0]  # loaded already, and its blocks cached under the adapter's name
    cached = cols["cached_tokens"].astype(int).tolist()
    assert cached[1] == 0 and cached[2] == 240  # the base model's blocks never serve "a"
    assert cluster.adapter_slots["inst-0"].stats.loads == 1
    request = make_request(rows[1], 256, 16, 0.0, lora_name="a")
    assert request.block_hashes == block_hash_chain(request.token_ids, 16, lora_name="a")


def _affinity() -> Pipeline:
    return Pipeline.from_config(
        {"scorers": [{"type": "lora-affinity-scorer", "weight": 1}], "picker": "max-score-picker"}
    )


def test_lora_affinity_keeps_each_adapter_on_its_holder_where_round_robin_reloads() -> None:
    trace = _burst(["a", "a", "b", "b", "a", "b", "a", "b"])
    results = {}
    for name, policy in (("affinity", _affinity()), ("round_robin", None)):
        dispatch = policy or load_dispatch_policy("round_robin")
        cluster = _cluster(2, dispatch, FleetModels(max_loras=1))
        cluster.run(trace)
        _assert_clean(cluster, trace)
        where = _where(cluster)
        loads = sum(s.stats.loads for s in cluster.adapter_slots.values())
        results[name] = (where, loads)
    where, loads = results["affinity"]
    on_a = {where[i] for i, r in enumerate(trace.requests) if r.model == "a"}
    on_b = {where[i] for i, r in enumerate(trace.requests) if r.model == "b"}
    assert len(on_a) == len(on_b) == 1 and on_a != on_b  # each adapter stays where it is held
    assert loads == 2
    assert results["round_robin"][1] > 2  # alternating instances load each adapter again


def test_kvherd_prefers_the_holder_until_its_queue_costs_more_than_a_load() -> None:
    # One adapter, two instances with a free slot each: short prompts cost less than the
    # load (256 prefill tokens) and stay on the holder; long ones go to the idle instance.
    kvherd = load_dispatch_policy("kvherd")
    spread = {}
    for prompt in (32, 4000):
        trace = _burst(["a"] * 4, input_length=prompt, output=300, gap=0.001)
        cluster = _cluster(2, kvherd, FleetModels(max_loras=1, lora_load_s=0.02))
        cluster.run(trace)
        _assert_clean(cluster, trace)
        spread[prompt] = set(_where(cluster).values())
    assert len(spread[32]) == 1
    assert spread[4000] == {"inst-0", "inst-1"}


def test_requests_go_only_to_instances_serving_their_model() -> None:
    trace = _burst(["llama", "qwen", "sql", "qwen", "llama", "sql", "nobody"] * 2, output=20)
    rows = [
        TraceRequest(r.index, r.arrival_s, r.input_length, r.output_length, r.hash_ids,
                     model=r.model, parent="qwen" if r.model in ("sql", "nobody") else None)
        for r in trace.requests
    ]  # fmt: skip
    trace = Trace("models", rows, block_size=4096)
    models = FleetModels(parse_base_models("llama=0,qwen=1-2,gone=7"), max_loras=2)
    cluster = _cluster(3, load_dispatch_policy("round_robin"), models)
    cluster.run(trace)
    where = _where(cluster)
    for i, r in enumerate(trace.requests):
        if r.model == "llama":
            assert where[i] == "inst-0"
        elif r.model != "nobody":
            assert where[i] in ("inst-1", "inst-2")
    assert cluster.metrics.failed == 0  # "nobody" is an adapter of qwen: served there
    gone = Trace("gone", [TraceRequest(0, 0.0, 64, 2, (1,), model="gone")], block_size=4096)
    cluster = _cluster(3, load_dispatch_policy("round_robin"), models)
    cluster.run(gone)
    assert cluster.metrics.failed == 1  # no instance serves it: the proxy's 404


def test_models_refuse_migrations_for_now() -> None:
    config = ClusterConfig(
        num_instances=2, instance=InstanceConfig(num_blocks=500), models=FleetModels()
    )
    cluster = SimCluster(
        config,
        load_latency_model(LATENCY),
        load_dispatch_policy("kvherd"),
        load_migration_policy("llumnix"),
    )
    with pytest.raises(ValueError, match="not yet"):
        cluster.run(_burst(["a"]))


def test_cli_serves_a_model_column_and_refuses_bad_model_flags(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = tmp_path / "lora.csv"
    trace.write_text(
        "arrival_s,input_length,output_length,model\n"
        + "".join(f"{i * 0.05},300,20,{'base' if i % 4 == 0 else f'a{i % 3}'}\n" for i in range(40))
    )
    common = ["sim", str(trace), "--instances", "2", "--latency-model", LATENCY, "--quiet"]
    out = tmp_path / "out"
    flags = ["--max-loras", "2", "--lora-load-ms", "30", "--no-plots"]
    assert main([*common, *flags, "--policy", "kvherd", "--out", str(out)]) == 0
    assert "| LoRA adapter loads |" in capsys.readouterr().out
    summary = json.loads((out / "summary.json").read_text())
    assert summary["meta"]["models"] == {
        "base_models": "base",
        "max_loras": 2,
        "lora_load_ms": 30.0,
    }
    kvherd = summary["results"]["kvherd"]
    assert kvherd["completed"] == 40 and kvherd["failed"] == 0
    assert 3 <= kvherd["lora_loads"] <= 40 - 10  # each adapter once, at most every adapter request
    cases = [
        (["--max-loras", "0"], "max_loras must be at least 1"),
        (["--base-models", "base=2-1"], "wants 0 <= FIRST <= LAST"),
        (["--migration-policy", "llumnix"], "runs without P/D, --prefix-pull or migrations"),
    ]
    for extra, needle in cases:
        assert main([*common, *extra, "--out", str(tmp_path / "o")]) == 2
        err = capsys.readouterr().err
        assert needle in err and "Traceback" not in err


def test_decode_fast_forward_gives_the_step_by_step_results_with_adapters() -> None:
    trace = generate(
        SyntheticSpec(requests=120, rate=30, input_mean=300, output_mean=60, adapters=6, seed=4)
    )
    runs = []
    for fast in (True, False):
        config = ClusterConfig(
            num_instances=3,
            instance=InstanceConfig(num_blocks=600, block_size=16, max_num_seqs=16),
            models=FleetModels(max_loras=2, lora_load_s=0.03),
        )
        cluster = SimCluster(
            config, load_latency_model(LATENCY), load_dispatch_policy("kvherd"), fast_forward=fast
        )
        cluster.run(trace)
        _assert_clean(cluster, trace)
        cols = cluster.metrics.columns()
        runs.append((cols, sum(s.stats.loads for s in cluster.adapter_slots.values())))
    (fast_cols, fast_loads), (slow_cols, slow_loads) = runs
    assert fast_loads == slow_loads > 6
    for name in ("first_token", "last_token", "cached_tokens", "preemptions"):
        assert fast_cols[name].tolist() == slow_cols[name].tolist(), name
    assert fast_cols["instance"].tolist() == slow_cols["instance"].tolist()
