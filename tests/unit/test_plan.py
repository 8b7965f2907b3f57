"""`kvherd plan`: the binary search per configuration, SLO parsing, the found plan re-simulated
(it meets the SLOs, one instance fewer does not), local processes and Ray giving one answer, and a
Ray task whose worker dies retried to the same outcome."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from concurrent.futures import Executor, ProcessPoolExecutor
from pathlib import Path

import pytest

from kvherd.cli import main
from simulator.experiment import SimSettings
from simulator.instance import InstanceConfig
from simulator.latency import load_latency_model
from simulator.plan import Evaluate, FleetConfig, Outcome, Plan, Probe, search
from simulator.plan_run import Job, evaluator, simulate
from simulator.slo import RequestTargets, Slo, parse_slo
from simulator.synthetic import SyntheticSpec, generate

SPEC = SyntheticSpec(
    requests=150, rate=25.0, input_mean=1024, output_mean=48, num_groups=6, max_input=4096, seed=3
)
SYNTHETIC = (
    "synthetic:requests=150,rate=25,input_mean=1024,output_mean=48,num_groups=6,max_input=4096,"
    "seed=3"
)
LATENCY = "roofline:llama-2-7b:a100-80gb"
SLOS = (parse_slo("ttft_p99=0.5"), parse_slo("tpot_p50=0.03"))
CONFIGS = [FleetConfig("kvherd"), FleetConfig("round_robin", cpu_tokens=100_000)]


def _threshold_evaluator(needs: dict[FleetConfig, int], calls: list[list[Probe]]) -> Evaluate:
    def evaluate(probes: Sequence[Probe]) -> list[Outcome]:
        calls.append(list(probes))
        return [Outcome(p.instances >= needs[p.config], {"n": float(p.instances)}) for p in probes]

    return evaluate


def test_search_finds_each_least_count_in_logarithmic_probes() -> None:
    a, b, c = FleetConfig("a"), FleetConfig("b", cpu_tokens=10), FleetConfig("c")
    needs = {a: 37, b: 37, c: 10_000}  # c: not feasible in range; b ties a with a bigger tier
    calls: list[list[Probe]] = []
    plan = search([b, a, c], 1, 100, _threshold_evaluator(needs, calls))
    found = {p.config: p.instances for p in plan.frontier}
    assert found == {a: 37, b: 37, c: None}
    assert plan.best is not None and plan.best.config == a
    for point in plan.frontier[:2]:
        assert point.below is not None and point.below.values["n"] == 36 and not point.below.met
    probes = [p for round_ in calls for p in round_]
    assert len(probes) == len(set(probes)) == len(plan.probes)
    assert len(probes) <= 3 * 7  # ceil(log2(100 + 1)) per configuration, not 300
    assert all(len({p.config for p in round_}) == len(round_) for round_ in calls)


def test_parallel_probes_give_the_same_answer_in_fewer_rounds() -> None:
    configs = [FleetConfig("a"), FleetConfig("b")]
    needs = {configs[0]: 5, configs[1]: 61}
    serial: list[list[Probe]] = []
    wide: list[list[Probe]] = []
    one = search(configs, 1, 64, _threshold_evaluator(needs, serial))
    many = search(configs, 1, 64, _threshold_evaluator(needs, wide), 8)
    assert [p.instances for p in one.frontier] == [p.instances for p in many.frontier] == [5, 61]
    assert len(wide) < len(serial)
    assert all(p.monotone for p in many.frontier)


def test_a_non_monotone_outcome_is_flagged() -> None:
    config = FleetConfig("odd")

    def evaluate(probes: Sequence[Probe]) -> list[Outcome]:  # passes at 5 and from 9 on only
        return [Outcome(p.instances == 5 or p.instances >= 9, {}) for p in probes]

    plan = search([config], 1, 12, evaluate, parallel=4)
    (point,) = plan.frontier
    assert point.instances == 5 and not point.monotone


def test_slo_parsing() -> None:
    assert parse_slo("ttft_p99=2.0") == Slo("ttft_p99", 2.0)
    assert parse_slo("tpot_mean=0.1").upper and not parse_slo("attainment=0.9").upper
    assert Slo("goodput", 5.0).met(5.0) and not Slo("goodput", 5.0).met(4.9)
    assert not Slo("ttft_p50", 1.0).met(float("nan"))
    for bad in ("ttft=1", "ttft_p0=1", "ttft_p101=1", "itl_p50=1", "ttft_p99", "ttft_p99=-1"):
        with pytest.raises(ValueError):
            parse_slo(bad)


def _base() -> SimSettings:
    model = load_latency_model(LATENCY)
    assert model.kv_capacity_tokens is not None
    return SimSettings(1, model, InstanceConfig(num_blocks=model.kv_capacity_tokens // 16))


def _plan(executor: Executor) -> Plan:
    trace = generate(SPEC)
    evaluate = evaluator(executor, trace, _base(), SLOS, RequestTargets())
    return search(CONFIGS, 1, 8, evaluate, parallel=2)


@pytest.fixture(scope="module")
def local_plan() -> Plan:
    with ProcessPoolExecutor(max_workers=2) as pool:
        return _plan(pool)


def test_the_plan_meets_the_slos_and_one_instance_fewer_does_not(local_plan: Plan) -> None:
    trace = generate(SPEC)
    best = local_plan.best
    assert best is not None and best.instances is not None and best.instances > 1
    again = simulate(
        Job(trace, _base(), SLOS, RequestTargets(), Probe(best.config, best.instances))
    )
    assert best.outcome is not None and again.met and again.values == best.outcome.values
    fewer = simulate(
        Job(trace, _base(), SLOS, RequestTargets(), Probe(best.config, best.instances - 1))
    )
    assert not fewer.met
    assert len(local_plan.probes) < len(CONFIGS) * 8


def test_ray_gives_the_local_answer_and_retries_a_lost_task(
    local_plan: Plan, tmp_path: Path
) -> None:
    pytest.importorskip("ray")
    from simulator.ray_executor import RayExecutor

    executor = RayExecutor("local", num_cpus=2)
    try:
        ray_plan = _plan(executor)
        marker = tmp_path / "died-once"

        def dies_once(job: Job) -> Outcome:  # the first attempt loses its worker process
            if not marker.exists():
                marker.touch()
                os._exit(1)
            return simulate(job)

        job = Job(generate(SPEC), _base(), SLOS, RequestTargets(), Probe(CONFIGS[0], 2))
        retried = executor.submit(dies_once, job).result()
    finally:
        executor.shutdown()
    assert marker.exists()
    assert retried == local_plan.probes[job.probe]
    assert ray_plan.frontier == local_plan.frontier
    assert list(ray_plan.probes) == list(local_plan.probes)


def test_cli_prints_the_frontier_and_writes_json_and_plot(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out, png = tmp_path / "plan.json", tmp_path / "plan.png"
    argv = ["plan", SYNTHETIC, "--latency-model", LATENCY, "--slo", "ttft_p99=0.5"]
    argv += ["--slo", "tpot_p50=0.03", "--instances", "1:8", "--workers", "1"]
    assert main([*argv, "--json", str(out), "--plot", str(png)]) == 0
    printed = capsys.readouterr().out
    assert "| kvherd, block 16 |" in printed and "cheapest:" in printed
    written = json.loads(out.read_text())
    assert written["cheapest"]["policy"] == "kvherd" and png.stat().st_size > 0
    assert main([*argv[:-2], "--instances", "1:1"]) == 1  # nothing meets the SLOs with one
    assert main([*argv, "--slo", "nope=1"]) == 2
    assert "kvherd plan: error: SLO 'nope'" in capsys.readouterr().err
