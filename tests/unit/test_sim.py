"""The simulator: conservation, determinism, migration, ideal hit rate, CLI behaviour."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kvherd.block_hash import block_hash_chain
from kvherd.cli import main
from policies import ClusterView, Decision, RequestView, load_dispatch_policy, load_migration_policy
from simulator.cluster import ClusterConfig, SimCluster
from simulator.host_model import HostModel
from simulator.instance import InstanceConfig
from simulator.latency import LatencyModelError, load_latency_model
from simulator.prompts import synthesize_prompt
from simulator.synthetic import SyntheticSpec, generate
from simulator.traces import Trace, TraceRequest, load_trace, scale_rate

MOONCAKE = Path(__file__).resolve().parents[2] / "traces" / "mooncake" / "synthetic_trace_600.jsonl"
LATENCY = "roofline:llama-2-7b:a100-80gb"


def _trace(n: int = 150, seed: int = 1, rate: float = 8.0) -> Trace:
    return generate(
        SyntheticSpec(
            requests=n,
            rate=rate,
            input_mean=700,
            output_mean=40,
            num_groups=6,
            prefix_tokens=1024,
            max_input=3000,
            seed=seed,
        )
    )


def _cluster(
    instances: int, num_blocks: int, dispatch: object, migration: object = None
) -> SimCluster:
    config = ClusterConfig(
        num_instances=instances,
        instance=InstanceConfig(
            num_blocks=num_blocks, block_size=16, max_num_seqs=32, max_num_batched_tokens=2048
        ),
        migration_interval_s=0.05,
    )
    return SimCluster(config, load_latency_model(LATENCY), dispatch, migration)  # type: ignore[arg-type]


def _assert_conserved(cluster: SimCluster, trace: Trace) -> None:
    cols = cluster.metrics.columns()
    assert cluster.metrics.failed == 0
    assert sorted(cols["index"].astype(int).tolist()) == [r.index for r in trace.requests]
    expected = {r.index: r.output_length for r in trace.requests}
    for index, out in zip(
        cols["index"].astype(int), cols["output_tokens"].astype(int), strict=True
    ):
        assert out == expected[index]
    assert (cols["first_token"] >= cols["arrival"]).all()
    assert (cols["last_token"] >= cols["first_token"]).all()
    for inst in cluster.instances.values():
        inst.block_manager.check_integrity()
        assert not inst.scheduler.has_unfinished()
        assert inst.block_manager.owners() == []  # nothing leaked, migration reservations included


def test_conservation_under_preemption() -> None:
    trace = _trace(rate=60.0)
    # A small pool per instance: requests preempt each other and are recomputed.
    cluster = _cluster(3, 260, load_dispatch_policy("round_robin"))
    cluster.run(trace)
    _assert_conserved(cluster, trace)
    assert cluster.metrics.summary()["preemptions"] > 0


class _AllToFirst:
    """Overloads one instance so the migration policy has work."""

    name = "all_to_first"

    def choose(self, request: RequestView, cluster: ClusterView) -> Decision:
        return Decision(cluster.instances[0].instance_id)


def test_conservation_with_live_migration() -> None:
    trace = _trace(n=120, seed=2, rate=20.0)
    cluster = _cluster(3, 600, _AllToFirst(), load_migration_policy("llumnix"))
    cluster.run(trace)
    _assert_conserved(cluster, trace)
    stats = cluster.migration_stats
    assert stats.committed > 0
    assert cluster.metrics.summary()["migrations"] == stats.committed
    assert stats.bytes_sent > 0 and all(d >= 0 for d in stats.downtime_s)
    served_elsewhere = {i for i in cluster.metrics.columns()["instance"]} - {"inst-0"}
    assert served_elsewhere  # migrated requests finished on another instance


def _engine_ideal_hit_rate(trace: Trace, block_size: int) -> float:
    """Prompt tokens an unbounded, single-instance prefix cache serves: the leading engine blocks
    seen before, never the last prompt token (the engine must compute one position)."""
    seen: set[int] = set()
    hit = total = 0
    for r in trace.requests:
        prompt = synthesize_prompt(r.hash_ids, r.input_length, trace.block_size)
        chain = block_hash_chain(prompt, block_size)
        usable = (len(prompt) - 1) // block_size
        n = 0
        while n < usable and chain[n] in seen:
            n += 1
        hit += n * block_size
        total += len(prompt)
        seen.update(chain)
    return hit / total


def test_unbounded_cache_reaches_the_traces_ideal_hit_rate() -> None:
    full = load_trace(MOONCAKE)
    # One output token per request and arrivals 1000x apart: each request runs alone, so the hit
    # rate is the cache's alone (no concurrent prefills of the same prefix).
    rows = [type(r)(r.index, r.arrival_s, r.input_length, 1, r.hash_ids) for r in full.requests]
    trace = scale_rate(Trace(full.name, rows, full.block_size, True), 0.001)
    block_size = 512
    blocks = sum(-(-r.input_length // block_size) + 1 for r in trace.requests)
    config = ClusterConfig(
        num_instances=1,
        instance=InstanceConfig(
            num_blocks=blocks, block_size=block_size, max_num_batched_tokens=65536
        ),
    )
    cluster = SimCluster(config, load_latency_model(LATENCY), load_dispatch_policy("round_robin"))
    cluster.run(trace)
    summary = cluster.metrics.summary()
    assert summary["completed"] == len(trace)
    ideal_engine = _engine_ideal_hit_rate(trace, block_size)
    assert summary["prefix_hit_rate"] == pytest.approx(ideal_engine, abs=1e-12)
    # ... which is the sample's 11% block hit ratio, less partial blocks and last tokens.
    assert trace.ideal_block_hit_ratio() == pytest.approx(0.11, abs=0.005)
    assert summary["prefix_hit_rate"] == pytest.approx(trace.ideal_block_hit_ratio(), abs=0.03)


def _write_trace(tmp_path: Path, trace: Trace) -> Path:
    path = tmp_path / "t.jsonl"
    path.write_text(
        "".join(
            json.dumps(
                {
                    "timestamp": round(r.arrival_s * 1000),
                    "input_length": r.input_length,
                    "output_length": r.output_length,
                    "hash_ids": [h % 100_000 for h in r.hash_ids],
                }
            )
            + "\n"
            for r in trace.requests
        )
    )
    return path


def test_cli_is_deterministic_and_writes_every_output(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _write_trace(tmp_path, _trace(n=60, rate=10.0))
    args = [
        "sim",
        str(path),
        "--instances",
        "2",
        "--policy",
        "random,kvherd",
        "--latency-model",
        LATENCY,
        "--slo-ttft",
        "2000",
        "--slo-tpot",
        "100",
        "--seed",
        "7",
        "--quiet",
    ]
    assert main([*args, "--out", str(tmp_path / "a")]) == 0
    table = capsys.readouterr().out
    assert "| TTFT p99 (ms) |" in table and "| random | kvherd |" in table
    assert main([*args, "--out", str(tmp_path / "b"), "--no-plots"]) == 0
    a = (tmp_path / "a" / "summary.json").read_text()
    assert a == (tmp_path / "b" / "summary.json").read_text()
    assert (tmp_path / "a" / "summary.csv").read_text() == (
        tmp_path / "b" / "summary.csv"
    ).read_text()
    for name in (
        "ttft_cdf.png",
        "load_random.png",
        "load_kvherd.png",
        "requests_kvherd.csv",
        "timing.json",
    ):
        assert (tmp_path / "a" / name).stat().st_size > 0
    results = json.loads(a)["results"]
    assert results["kvherd"]["completed"] == 60 and results["random"]["completed"] == 60
    assert 0.0 <= results["kvherd"]["slo_attainment"] <= 1.0


def test_cli_bad_inputs_exit_2_with_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0, "input_length": 5, "output_length": 1}\n{"timestamp": 1}\n')
    good = tmp_path / "good.jsonl"
    good.write_text('{"timestamp": 0, "input_length": 5, "output_length": 1}\n')
    cases = [
        ([str(bad)], f"{bad}:2: missing field 'input_length'"),
        ([str(tmp_path / "none.csv")], "no such file"),
        ([str(bad), "--latency-model", "roofline:gpt-9:a100"], "unknown roofline model"),
        ([str(bad), "--policy", "no_such_policy"], "unknown dispatch policy"),
        ([str(good), "--max-requests", "0"], "no requests left"),
        ([str(good), "--instances", "0"], "--instances must be at least 1"),
        ([str(good), "--request-overhead-ms", "-1"], "--request-overhead-ms must be a non-neg"),
        ([str(good), "--request-overhead-per-busy-ms", "nan"], "must be a non-negative number"),
        ([str(good), "--step-slowdown-per-busy", "-0.5"], "--step-slowdown-per-busy must be"),
        ([str(good), "--request-overhead-idle", "0.5:1,0.1:2"], "strictly ascending"),
        ([str(good), "--request-overhead-idle", "0.5"], "'0.5' is not IDLE_S:MS"),
        ([str(good), "--request-overhead-idle=-1:3"], "'-1:3' is not IDLE_S:MS"),
        ([str(good), "--request-overhead-spread", "3,1"], "at least two quantiles, ascending"),
        ([str(good), "--request-overhead-spread", "2"], "at least two quantiles, ascending"),
        ([str(good), "--request-overhead-spread", "1,nan"], "is not a list of numbers"),
    ]
    for extra, needle in cases:
        assert main(["sim", *extra, "--out", str(tmp_path / "o"), "--quiet"]) == 2
        err = capsys.readouterr().err
        assert needle in err and "Traceback" not in err
        assert err.startswith("kvherd sim: error: ")


def _run_cluster(
    requests: list[TraceRequest],
    instance: InstanceConfig,
    *,
    policy: str = "round_robin",
    **config: object,
) -> tuple[dict[str, Any], SimCluster]:
    """`requests` (ids in 512-token blocks) on 2 instances: the result columns and the cluster."""
    cluster = SimCluster(
        ClusterConfig(num_instances=2, instance=instance, **config),  # type: ignore[arg-type]
        load_latency_model(LATENCY),
        load_dispatch_policy(policy),
    )
    return cluster.run(Trace("test", requests, block_size=512)).columns(), cluster


def _co_located(**config: object) -> tuple[dict[str, list[float]], int]:
    """Two round-robin instances: a long prompt keeps inst-0 prefilling in 8 chunks, a short
    request on inst-1 arrives and finishes inside that prefill, and a third one comes after
    everything went quiet. Returns its time columns (seconds after arrival, and arrival) and
    the engine steps taken."""
    requests = [
        TraceRequest(0, 0.0, 4000, 4, tuple(range(100, 108))),
        TraceRequest(1, 0.01, 64, 4, (200,)),
        TraceRequest(2, 30.0, 64, 4, (300,)),
    ]
    cols, cluster = _run_cluster(
        requests, InstanceConfig(num_blocks=4096, max_num_batched_tokens=512), **config
    )
    times = {k: (cols[k] - cols["arrival"]).tolist() for k in ("first_token", "last_token")}
    times["arrival"] = cols["arrival"].tolist()
    return times, sum(i.num_steps for i in cluster.instances.values())


def test_request_overhead_grows_with_the_other_busy_instances() -> None:
    """Co-located instances: a request pays `request_overhead_per_busy_s` for each other instance
    busy when it arrives, and nothing more."""
    plain = _co_located(host=HostModel(request_overhead_s=0.002))[0]["first_token"]
    loaded = _co_located(
        host=HostModel(request_overhead_s=0.002, request_overhead_per_busy_s=0.005)
    )[0]["first_token"]
    assert loaded[0] == pytest.approx(plain[0])  # nothing else busy at its arrival
    assert loaded[1] == pytest.approx(plain[1] + 0.005)  # inst-0 busy with the long prefill
    assert loaded[2] == pytest.approx(plain[2])


def test_request_overhead_follows_the_fleet_idle_time() -> None:
    """A host slow to wake idle processes: a request pays `request_overhead_idle` at the time
    the whole fleet has been idle when it arrives (none while an instance computes)."""

    def run(points: tuple[tuple[float, float], ...]) -> dict[str, list[float]]:
        host = HostModel(request_overhead_s=0.002, request_overhead_idle=points)
        return _co_located(host=host)[0]

    ttft = run(())["first_token"]
    loaded = run(((0.0, 0.001), (100.0, 0.101)))  # 1 ms + 1 ms per idle second
    got = loaded["first_token"]
    assert got[0] == pytest.approx(ttft[0] + 0.001)  # nothing ran before: idle 0
    assert got[1] == pytest.approx(ttft[1] + 0.001)  # inst-0 is still prefilling: idle 0
    # The fleet idled since the first two finished.
    arrivals, lasts = loaded["arrival"][:2], loaded["last_token"][:2]
    idle = 30.0 - max(a + t for a, t in zip(arrivals, lasts, strict=True))
    assert got[2] == pytest.approx(ttft[2] + 0.001 + idle * 0.001)
    # Past the last point the function is flat, and the path never goes below zero.
    got = run(((0.0, -0.005), (1.0, 0.004)))["first_token"]
    assert got[0] == pytest.approx(ttft[0] - 0.002)  # 2 ms - 5 ms: clamped at no delay
    assert got[2] == pytest.approx(ttft[2] + 0.004)


def _isolated_ttfts(policy: str = "round_robin", **config: object) -> list[float]:
    """TTFT (s) of 300 short requests, each alone on the fleet (1 s apart), on 2 instances."""
    requests = [TraceRequest(i, float(i), 64, 2, (1000 + i,)) for i in range(300)]
    cols, _ = _run_cluster(requests, InstanceConfig(num_blocks=512), policy=policy, **config)
    return (cols["first_token"] - cols["arrival"]).tolist()


def test_request_overhead_spread_is_drawn_per_request() -> None:
    """Each request's path time draws from the quantiles of `request_overhead_spread` (here
    uniform on -1..+3 ms), the same draws for every policy and seed-determined; a total below
    zero is no delay."""
    plain = _isolated_ttfts(host=HostModel(request_overhead_s=0.002))
    spread = (-0.001, 0.003)
    with_spread = HostModel(request_overhead_s=0.002, request_overhead_spread=spread)
    drawn = _isolated_ttfts(host=with_spread)
    extra = [d - p for d, p in zip(drawn, plain, strict=True)]
    assert all(-0.001 - 1e-9 <= e <= 0.003 + 1e-9 for e in extra)
    assert sorted(extra)[150] == pytest.approx(0.001, abs=0.0004)  # the median of -1..+3 ms
    assert sum(e < 0 for e in extra) == pytest.approx(75, abs=25)  # a quarter below zero
    other_policy = _isolated_ttfts("least_requests", host=with_spread)
    assert other_policy == pytest.approx(drawn, abs=1e-12)
    assert _isolated_ttfts(host=with_spread) == drawn
    reseeded = _isolated_ttfts(host=with_spread, seed=1)
    assert reseeded != drawn
    below = _isolated_ttfts(
        host=HostModel(request_overhead_s=0.002, request_overhead_spread=(-0.005, -0.004))
    )
    assert below == pytest.approx([p - 0.002 for p in plain], abs=1e-12)


def test_steps_stretch_with_the_other_busy_instances() -> None:
    """Co-located instances: every step takes (1 + `step_slowdown_per_busy` x other busy
    instances at its start) times as long; alone, an instance runs at the model's speed."""
    (plain, plain_steps), (loaded, loaded_steps) = (
        _co_located(host=HostModel(step_slowdown_per_busy=0.0)),
        _co_located(host=HostModel(step_slowdown_per_busy=0.5)),
    )
    assert loaded_steps == plain_steps
    for key in ("first_token", "last_token"):
        assert loaded[key][1] == pytest.approx(1.5 * plain[key][1])  # all inside inst-0's work
        assert loaded[key][2] == pytest.approx(plain[key][2])  # alone
    # inst-0's first chunk starts alone, some of the next ones while inst-1 works.
    assert plain["first_token"][0] < loaded["first_token"][0] < 1.5 * plain["first_token"][0]


def test_latency_models_are_sane() -> None:
    for spec in (
        "roofline:llama-2-70b:a100-80gb:tp4",
        "roofline:llama-2-70b:h200:tp4",
        "splitwise:llama2-70b:a100:tp4",
        "distserve:opt-13b",
    ):
        model = load_latency_model(spec)  # the measured ones from traces/profiles
        prefill = [model.step_time([(n, 0)], []) for n in (128, 1024, 8192)]
        decode = [model.step_time([], [1000] * b) for b in (1, 16, 64)]
        assert 0 < prefill[0] < prefill[1] < prefill[2], spec
        assert 0 < decode[0] <= decode[1] <= decode[2], spec
        assert decode[0] < prefill[2], spec
        assert model.kv_capacity_tokens and model.kv_capacity_tokens > 10_000
    fast = load_latency_model("roofline:llama-2-70b:h200:tp4")
    slow = load_latency_model("roofline:llama-2-70b:a100-80gb:tp4")
    assert fast.step_time([], [4096] * 32) < slow.step_time([], [4096] * 32)
    for bad in ("roofline:llama-2-7b", "splitwise:llama2-70b:a100:tpx", "calibrated:", "nope:x"):
        with pytest.raises(LatencyModelError):
            load_latency_model(bad)


def test_metrics_follow_vllm_bench_definitions() -> None:
    from simulator.metrics import MetricsCollector

    m = MetricsCollector()
    m.on_arrival("a", 0.0, 100)
    m.on_scheduled("a", 0.25)
    for t in (1.0, 1.5, 2.5):
        m.on_token("a", t)
    m.on_finished_ids("a", 0, 40, 1, 0, "i0")
    m.on_arrival("b", 1.0, 300)
    m.on_scheduled("b", 1.0)
    m.on_token("b", 3.0)
    m.on_finished_ids("b", 1, 0, 0, 2, "i1")
    m.on_arrival("c", 1.0, 10)
    m.on_failed("c")
    s = m.summary(slo_ttft_ms=1500, slo_tpot_ms=1000)
    assert s["completed"] == 2 and s["failed"] == 1
    assert s["ttft_ms_mean"] == pytest.approx(1500.0)  # (1000 + 2000) / 2
    assert s["tpot_ms_mean"] == pytest.approx(750.0)  # only requests with > 1 token
    assert s["itl_ms_mean"] == pytest.approx(750.0)  # gaps 500 and 1000
    assert s["itl_ms_p99"] == pytest.approx(1000.0, rel=0.005)
    assert s["itl_ms_p50"] == pytest.approx(500.0, rel=0.005)
    assert s["e2e_ms_p50"] == pytest.approx(2250.0)
    assert s["queue_ms_mean"] == pytest.approx(125.0)
    assert s["duration_s"] == pytest.approx(3.0)
    assert s["output_throughput"] == pytest.approx(4 / 3.0)
    assert s["goodput"] == pytest.approx(1 / 3.0)  # b misses the TTFT SLO
    assert s["prefix_hit_rate"] == pytest.approx(40 / 400)
    assert s["preemptions"] == 1 and s["migrations"] == 2


def test_itl_histogram_counted_entries_equal_single_adds_in_any_order() -> None:
    """A decode run adds a step's gap once per request of the batch as one counted entry; the
    counts must equal one add per token and the compensated mean must not see the order."""
    import math
    import random

    from simulator.metrics import LogHistogram

    rng = random.Random(7)
    gaps = [rng.choice((0.0123, 0.0456, 1e-9, 250.0)) * rng.uniform(0.5, 2.0) for _ in range(300)]
    batch = [rng.randint(1, 40) for _ in gaps]
    one_by_one = LogHistogram()
    for gap, n in zip(gaps, batch, strict=True):
        for _ in range(n):
            one_by_one.add(gap)
    counted = LogHistogram()
    pairs = list(zip(gaps, batch, strict=True))
    rng.shuffle(pairs)
    counted.add_counted(pairs)
    assert counted.n == one_by_one.n == sum(batch)
    assert counted.counts.tolist() == one_by_one.counts.tolist()
    exact = math.fsum(g * n for g, n in zip(gaps, batch, strict=True)) / sum(batch)
    assert counted.mean() == pytest.approx(exact, rel=1e-15)
    assert one_by_one.mean() == pytest.approx(exact, rel=1e-15)
    assert counted.percentile(50) == one_by_one.percentile(50)


def test_cpu_tier_loads_evicted_prefixes_back_and_reports_hits_per_tier() -> None:
    """A pool too small for the shared prefixes: with a CPU tier they come back as loads (priced
    on the link), the hit rate rises, and the summary splits it by tier beside the limit."""
    from simulator.experiment import SimSettings, run_policy
    from simulator.instance import InstanceConfig
    from simulator.latency import load_latency_model
    from simulator.synthetic import generate, parse_spec

    trace = generate(
        parse_spec(
            "synthetic:requests=120,rate=4,input_mean=2048,output_mean=8,num_groups=12,"
            "prefix_tokens=1536,seed=3"
        )
    )
    latency = load_latency_model("roofline:llama-2-7b:h100")
    runs = {}
    for cpu in (0, 4096):
        settings = SimSettings(2, latency, InstanceConfig(num_blocks=640, num_cpu_blocks=cpu))
        runs[cpu] = run_policy(trace, settings, "kvherd").summary
    gpu_only, tiered = runs[0], runs[4096]
    assert gpu_only["hit_rate_cpu"] == 0 and gpu_only["loads"] == 0
    assert tiered["loads"] > 0 and tiered["hit_rate_cpu"] > 0.05
    assert tiered["prefix_hit_rate"] > gpu_only["prefix_hit_rate"] + 0.05
    assert tiered["prefix_hit_rate"] <= tiered["shared_cache_limit"] + 1e-9
    assert tiered["completed"] == gpu_only["completed"] == 120
