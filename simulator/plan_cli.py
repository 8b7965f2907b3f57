"""`kvherd plan`: the cheapest fleet that meets the SLOs on a trace, by simulation.

The space is the product of --policy x --cpu-tokens x --block-size; each configuration's least
instance count in --instances LO:HI is binary-searched (`simulator.plan`, which assumes meeting
the SLOs is monotone in the count). Simulations run in --workers local processes, or as Ray tasks
on the cluster at --ray (a lost task is retried; the answer is the local one). Prints the frontier
(per configuration: the least count meeting the SLOs, its SLO values and those at one instance
fewer) and the cheapest configuration; --json and --plot write them to files. Bad arguments exit
with status 2 and one line on stderr; "no configuration meets the SLOs" exits with status 1.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from concurrent.futures import Executor, ProcessPoolExecutor
from pathlib import Path
from typing import Any

from simulator.plan import FleetConfig, Outcome, Plan
from simulator.slo import RequestTargets, Slo

_DEFAULT_MODEL = "roofline:llama-2-70b:a100-80gb:tp4"
# Engine knobs a calibrated profile may set for the simulated instances.
_ENGINE_KNOBS = ("max_num_seqs", "max_num_batched_tokens", "max_model_len")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from simulator.latency import SPEC_HELP

    parser.add_argument("trace", help="trace file or synthetic spec, as for `kvherd sim`")
    parser.add_argument(
        "--id-block-size", type=int, default=512, help="tokens per hash id in the trace (512)"
    )
    parser.add_argument(
        "--slo",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="an SLO to meet (repeatable): ttft|tpot|e2e|queue with _pQ or _mean, in seconds "
        "(e.g. ttft_p99=2.0, tpot_p50=0.1), or attainment=FRACTION / goodput=REQ_PER_S of the "
        "requests meeting --request-ttft and --request-tpot",
    )
    parser.add_argument(
        "--request-ttft", type=float, default=None, metavar="S", help="per-request TTFT target"
    )
    parser.add_argument(
        "--request-tpot", type=float, default=None, metavar="S", help="per-request TPOT target"
    )
    space = parser.add_argument_group("the configurations searched (comma-separated lists)")
    space.add_argument(
        "--instances", default="1:16", metavar="LO:HI", help="instance counts (default 1:16)"
    )
    space.add_argument("--policy", default="kvherd", help="dispatch policies (default kvherd)")
    space.add_argument(
        "--cpu-tokens", default="0", help="host-DRAM KV tier sizes per instance, tokens (0)"
    )
    space.add_argument(
        "--block-size",
        default=None,
        help="KV block sizes (default: a calibrated profile's engine block size, else 16)",
    )
    sim = parser.add_argument_group("the simulated fleet, as for `kvherd sim`")
    sim.add_argument(
        "--latency-model", default=_DEFAULT_MODEL, help=f"{SPEC_HELP} (default {_DEFAULT_MODEL})"
    )
    sim.add_argument(
        "--kv-tokens",
        type=int,
        default=None,
        help="GPU KV capacity per instance in tokens (default: the latency model's)",
    )
    sim.add_argument(
        "--profile",
        default=None,
        metavar="FILE",
        help="the host (request path) from a profile's host section, as `kvherd sim --profile` "
        "(`kvherd profile --url` of a running vLLM writes one)",
    )
    sim.add_argument("--rate-scale", type=float, default=1.0, help="multiply the arrival rate")
    sim.add_argument(
        "--diurnal", default=None, metavar="PERIOD:TROUGH", help="a daily shape, as for `kvherd sim`"
    )
    sim.add_argument("--max-requests", type=int, default=None, help="first K requests only")
    sim.add_argument("--seed", type=int, default=0, help="seed for the policies")
    runs = parser.add_argument_group("where the simulations run")
    runs.add_argument(
        "--workers",
        type=int,
        default=os.cpu_count() or 1,
        help="local processes, or Ray CPUs with --ray local (default: the CPU count)",
    )
    runs.add_argument(
        "--ray",
        default=None,
        metavar="ADDRESS",
        help="run each simulation as a Ray task: auto, ray://HOST:PORT, or local (start one here)",
    )
    parser.add_argument("--json", type=Path, default=None, metavar="FILE", help="write the plan")
    parser.add_argument("--plot", type=Path, default=None, metavar="FILE", help="write a PNG")


def _fail(message: str) -> int:
    print(f"kvherd plan: error: {message}", file=sys.stderr)
    return 2


def _ints(text: str, flag: str) -> list[int]:
    try:
        values = [int(float(part)) for part in text.split(",") if part.strip()]
    except ValueError:
        raise ValueError(f"{flag}: {text!r} is not a comma-separated list of integers") from None
    if not values:
        raise ValueError(f"{flag} names nothing")
    return values


def _count_range(text: str) -> tuple[int, int]:
    lo, sep, hi = text.partition(":")
    try:
        bounds = (int(lo), int(hi)) if sep else (int(lo), int(lo))
    except ValueError:
        raise ValueError(f"--instances must be LO:HI, got {text!r}") from None
    if not 1 <= bounds[0] <= bounds[1]:
        raise ValueError(f"--instances needs 1 <= LO <= HI, got {text!r}")
    return bounds


def configs_of(args: argparse.Namespace, engine_block_size: int = 16) -> list[FleetConfig]:
    policies = [p.strip() for p in args.policy.split(",") if p.strip()]
    if not policies:
        raise ValueError("--policy names no policy")
    tiers = _ints(args.cpu_tokens, "--cpu-tokens")
    blocks = _ints(args.block_size or str(engine_block_size), "--block-size")
    if min(tiers) < 0 or min(blocks) < 1:
        raise ValueError("--cpu-tokens must be >= 0 and --block-size >= 1")
    return [
        FleetConfig(policy, tier, block)
        for policy in policies
        for tier in tiers
        for block in blocks
    ]


def _slos(args: argparse.Namespace) -> tuple[list[Slo], RequestTargets]:
    from simulator.slo import parse_slo

    slos = [parse_slo(text) for text in args.slo]
    if not slos:
        raise ValueError("give at least one --slo")
    targets = RequestTargets(args.request_ttft, args.request_tpot)
    needs_targets = any(not slo.upper for slo in slos)
    if needs_targets and targets == RequestTargets():
        raise ValueError("attainment and goodput SLOs need --request-ttft and/or --request-tpot")
    return slos, targets


def _executor(args: argparse.Namespace) -> Executor:
    if args.ray is not None:
        from simulator.ray_executor import RayExecutor

        return RayExecutor(args.ray, num_cpus=args.workers)
    return ProcessPoolExecutor(max_workers=args.workers)


def run(args: argparse.Namespace) -> int:
    from policies.registry import PolicyLoadError, load_dispatch_policy
    from simulator.experiment import SimSettings
    from simulator.host_model import HostModel
    from simulator.instance import InstanceConfig
    from simulator.latency import LatencyModelError, load_latency_model
    from simulator.latency.calibrated import CalibratedModel
    from simulator.plan import search
    from simulator.plan_run import evaluator
    from simulator.synthetic import generate, parse_spec
    from simulator.traces import TraceError, diurnal, head, load_trace, parse_diurnal, scale_rate

    if args.workers < 1:
        return _fail("--workers must be at least 1")
    try:
        lo, hi = _count_range(args.instances)
        slos, targets = _slos(args)
        latency = load_latency_model(args.latency_model)
        engine = latency.engine if isinstance(latency, CalibratedModel) else {}
        configs = configs_of(args, int(engine.get("block_size") or 16))
        host = HostModel() if args.profile is None else HostModel.from_file(args.profile)
        for config in configs:
            load_dispatch_policy(config.policy)
        if args.trace.startswith("synthetic:"):
            trace = generate(parse_spec(args.trace))
        else:
            trace = load_trace(args.trace, args.id_block_size)
        if args.max_requests is not None:
            trace = head(trace, args.max_requests)
        trace = scale_rate(trace, args.rate_scale)
        if args.diurnal:
            trace = diurnal(trace, *parse_diurnal(args.diurnal))
    except (ValueError, LatencyModelError, PolicyLoadError, TraceError) as exc:
        return _fail(str(exc))
    kv_tokens = args.kv_tokens or latency.kv_capacity_tokens
    if not kv_tokens:
        return _fail("the latency model does not know the KV capacity; pass --kv-tokens")
    knobs: dict[str, Any] = {k: engine[k] for k in _ENGINE_KNOBS if k in engine}
    instance = dataclasses.replace(InstanceConfig(num_blocks=kv_tokens // 16), **knobs)
    base = SimSettings(
        num_instances=lo, latency=latency, instance=instance, seed=args.seed, host=host
    )
    start = time.perf_counter()
    executor = _executor(args)
    try:
        plan = search(
            configs, lo, hi, evaluator(executor, trace, base, slos, targets), args.workers
        )
    finally:
        executor.shutdown()
    elapsed = time.perf_counter() - start
    print(
        f"{len(trace)} requests ({trace.name}), {latency.name}, SLOs: " + ", ".join(map(str, slos))
    )
    print(frontier_table(plan, slos))
    best = plan.best
    print(
        f"{len(plan.probes)} simulations of a {len(configs) * (hi - lo + 1)}-point grid "
        f"({len(configs)} configurations x {lo}..{hi} instances) in {elapsed:.1f} s "
        f"({sum(o.wall_s for o in plan.probes.values()):.1f} s of simulation between them)"
    )
    if best is None:
        print(f"no configuration meets the SLOs with at most {hi} instances")
    else:
        print(f"cheapest: {best.instances} instances, {best.config.label}")
    if args.json is not None:
        args.json.write_text(json.dumps(plan_json(plan, slos, lo, hi), indent=2) + "\n")
    if args.plot is not None:
        plot_plan(args.plot, plan, slos)
    return 0 if best is not None else 1


def _values(outcome: Outcome, slos: list[Slo]) -> str:
    return ", ".join(f"{slo.metric}={outcome.values[slo.metric]:.4g}" for slo in slos)


def frontier_table(plan: Plan, slos: list[Slo]) -> str:
    rows = [
        "| configuration | instances | SLO values | one instance fewer |",
        "|---|---:|---|---|",
    ]
    for point in plan.frontier:
        if point.outcome is None:
            rows.append(f"| {point.config.label} | none | - | - |")
            continue
        below = "-" if point.below is None else "fails: " + _values(point.below, slos)
        flag = "" if point.monotone else " (not monotone)"
        rows.append(
            f"| {point.config.label} | {point.instances}{flag} | "
            f"{_values(point.outcome, slos)} | {below} |"
        )
    return "\n".join(rows)


def plan_json(plan: Plan, slos: list[Slo], lo: int, hi: int) -> dict[str, Any]:
    def config(c: FleetConfig) -> dict[str, Any]:
        return {"policy": c.policy, "cpu_tokens": c.cpu_tokens, "block_size": c.block_size}

    best = plan.best
    return {
        "slos": [str(slo) for slo in slos],
        "instances": [lo, hi],
        "cheapest": None if best is None else {**config(best.config), "instances": best.instances},
        "frontier": [
            {
                **config(p.config),
                "instances": p.instances,
                "monotone": p.monotone,
                "values": None if p.outcome is None else p.outcome.values,
                "values_one_fewer": None if p.below is None else p.below.values,
            }
            for p in plan.frontier
        ],
        "probes": [
            {**config(probe.config), "instances": probe.instances, "met": o.met, **o.values}
            for probe, o in plan.probes.items()
        ],
    }


def worst_ratio(outcome: Outcome, slos: list[Slo]) -> float:
    """The probe's worst SLO as value/limit (limit/value for lower bounds): <= 1 meets."""

    def ratio(low: float, high: float) -> float:  # how far `low <= high` holds
        return low / high if high > 0 else (0.0 if low <= 0 else float("inf"))

    return max(
        ratio(outcome.values[s.metric], s.limit)
        if s.upper
        else ratio(s.limit, outcome.values[s.metric])
        for s in slos
    )


def plot_plan(path: Path, plan: Plan, slos: list[Slo]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    labels = [p.config.label for p in plan.frontier]
    counts = [p.instances or 0 for p in plan.frontier]
    bars = left.barh(labels, counts, color="tab:blue")
    for bar, point in zip(bars, plan.frontier, strict=True):
        text = "none" if point.instances is None else str(point.instances)
        left.text(bar.get_width(), bar.get_y() + bar.get_height() / 2, f" {text}", va="center")
    left.set_xlabel("least instances meeting the SLOs")
    left.invert_yaxis()
    by_config: dict[FleetConfig, list[tuple[int, float]]] = {}
    for probe, outcome in plan.probes.items():
        by_config.setdefault(probe.config, []).append((probe.instances, worst_ratio(outcome, slos)))
    for config, points in by_config.items():
        points.sort()
        right.plot(*zip(*points, strict=True), marker="o", label=config.label)
    right.axhline(1.0, color="black", linestyle="--", linewidth=1)
    right.set_yscale("log")
    right.set_xlabel("instances (simulated probes)")
    right.set_ylabel("worst SLO value / limit (<= 1 meets)")
    right.legend(fontsize="small")
    fig.suptitle("kvherd plan: " + ", ".join(map(str, slos)))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
