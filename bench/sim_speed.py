"""Simulator speed and memory: wall time and peak RSS per policy run, linearity, extrapolation.

Scenarios (each policy run in a fresh subprocess, so peak RSS is that run's own):
  azure     Azure LLM inference conv trace (19,366 requests) on 4 instances, llama-2-7b / A100.
  mooncake  Mooncake synthetic trace (3,993 requests, 15k-token prompts) on 16 instances,
            llama-2-70b / 4x A100.
  linear    the Azure trace at 1/4, 1/2 and all of its requests: seconds per request must stay flat.
  million   a synthetic 1M-request trace on 256 instances; `--million-sample K` runs its first K
            requests and extrapolates linearly to 1M (the printout says so).
`--forms` runs each azure/mooncake policy as interleaved pairs, the compiled form of the hot pure
modules (kvherd/compiled.py) and the plain one (KVHERD_PURE_PYTHON=1), and prints the medians and
the speed-up of sim CPU s (`--pairs` pairs; both forms must report the same steps and mean TTFT).
`--step-by-step` also runs every azure/mooncake policy with the decode fast-forward off (one
`schedule()` per engine step, the simulator before the fast-forward) and prints the speed-up; both
runs must report the same steps and mean TTFT.
Wall time is what the targets name; sim CPU s (the run's own process time) is the steadier
figure on a shared machine. Baseline printed side by side: Vidur on the same Azure run (~50 s,
~4 GB, the issue's figures for these machines; Vidur is not installed here) and the targets
(<= 5 s and <= 500 MB per policy run, 1M requests in <= 10 min).

    python bench/sim_speed.py [--scenarios azure,mooncake,linear,million] [--policies round_robin,kvherd]
                              [--forms [--pairs 3]]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

TRACES = Path(__file__).resolve().parents[2] / "shared" / "traces"
AZURE = TRACES / "azure-llm-2023" / "AzureLLMInferenceTrace_conv.csv"
MOONCAKE = TRACES / "mooncake" / "synthetic_trace.jsonl"
MILLION = (
    "synthetic:requests=1000000,rate=2000,input_mean=1024,output_mean=128,num_groups=5000,"
    "prefix_tokens=512,max_input=8192,seed=0"
)
AZURE_MODEL = "roofline:llama-2-7b:a100-80gb"
MOONCAKE_MODEL = "roofline:llama-2-70b:a100-80gb:tp4"
VIDUR_AZURE = {"wall_s": 50.0, "peak_rss_mb": 4096.0}


def _one(
    trace_spec: str,
    instances: int,
    policy: str,
    latency: str,
    max_requests: int | None,
    fast_forward: bool = True,
) -> None:
    """Child mode: one policy run; prints a JSON line with its figures."""
    from simulator.experiment import SimSettings, run_policy
    from simulator.instance import InstanceConfig
    from simulator.latency import load_latency_model
    from simulator.synthetic import generate, parse_spec
    from simulator.traces import head, load_trace

    start = time.perf_counter()
    if trace_spec.startswith("synthetic:"):
        spec = parse_spec(trace_spec)
        if max_requests is not None:  # the first K requests of the very same trace
            spec = type(spec)(
                **{**{f: getattr(spec, f) for f in spec.__slots__}, "requests": max_requests}
            )
        trace = generate(spec)
    else:
        trace = load_trace(trace_spec)
        if max_requests is not None:
            trace = head(trace, max_requests)
    load_s = time.perf_counter() - start
    model = load_latency_model(latency)
    assert model.kv_capacity_tokens is not None
    settings = SimSettings(
        instances,
        model,
        InstanceConfig(num_blocks=model.kv_capacity_tokens // 16),
        fast_forward=fast_forward,
    )
    cpu_start = time.process_time()
    result = run_policy(trace, settings, policy)
    cpu_s = time.process_time() - cpu_start
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0
    print(
        json.dumps(
            {
                "requests": len(trace),
                "load_s": load_s,
                "sim_s": result.wall_s,
                "sim_cpu_s": cpu_s,
                "peak_rss_mb": peak_mb,
                "steps": result.num_steps,
                "completed": result.summary["completed"],
                "ttft_ms_mean": result.summary["ttft_ms_mean"],
            }
        )
    )


def _spawn(
    trace: str,
    instances: int,
    policy: str,
    latency: str,
    max_requests: int | None,
    fast_forward: bool = True,
    pure: bool = False,
) -> dict[str, float]:
    cmd = [sys.executable, __file__, "--child", trace, str(instances), policy, latency]
    cmd += [str(max_requests or 0), str(int(fast_forward))]
    env = {k: v for k, v in os.environ.items() if k != "KVHERD_PURE_PYTHON"}
    env.update({"KVHERD_PURE_PYTHON": "1"} if pure else {})
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env).stdout
    return json.loads(out.strip().splitlines()[-1])


def _row(name: str, policy: str, r: dict[str, float], note: str = "") -> str:
    total = r["load_s"] + r["sim_s"]
    return (
        f"| {name} | {policy} | {int(r['requests']):,} | {total:.1f} | {r['sim_cpu_s']:.1f} "
        f"| {r['sim_s'] / r['requests'] * 1e3:.2f} "
        f"| {r['peak_rss_mb']:.0f} | {int(r['steps']):,} | {note} |"
    )


def _forms(
    pairs: int, name: str, policy: str, trace: str, instances: int, latency: str, k: int | None
) -> None:
    """Interleaved pairs of the compiled and the plain form; medians and the speed-up."""
    compiled: list[dict[str, float]] = []
    plain: list[dict[str, float]] = []
    for _ in range(pairs):
        compiled.append(_spawn(trace, instances, policy, latency, k))
        plain.append(_spawn(trace, instances, policy, latency, k, pure=True))
    same = all(
        (p["steps"], p["ttft_ms_mean"]) == (c["steps"], c["ttft_ms_mean"])
        for c, p in zip(compiled, plain, strict=True)
    )
    ratios = [p["sim_cpu_s"] / c["sim_cpu_s"] for c, p in zip(compiled, plain, strict=True)]

    def median(runs: list[dict[str, float]]) -> dict[str, float]:
        return {key: statistics.median(r[key] for r in runs) for key in runs[0]}

    note = f"median of {pairs} pairs: compiled {statistics.median(ratios):.2f}x faster (sim CPU)"
    print(_row(name, f"{policy} (plain)", median(plain)), flush=True)
    print(_row(name, f"{policy} (compiled)", median(compiled), f"{note}; same results: {same}"))


def _runs(
    step_by_step: bool,
    name: str,
    policy: str,
    trace: str,
    instances: int,
    latency: str,
    k: int | None,
) -> None:
    """One policy run (and, with `step_by_step`, the same run without the fast-forward)."""
    r = _spawn(trace, instances, policy, latency, k)
    print(_row(name, policy, r), flush=True)
    if step_by_step:
        slow = _spawn(trace, instances, policy, latency, k, fast_forward=False)
        same = slow["steps"] == r["steps"] and slow["ttft_ms_mean"] == r["ttft_ms_mean"]
        note = f"fast-forward {slow['sim_s'] / r['sim_s']:.2f}x faster; same results: {same}"
        print(_row(name, f"{policy} (step by step)", slow, note), flush=True)


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child = sys.argv[2:]
        _one(child[0], int(child[1]), child[2], child[3], int(child[4]) or None, child[5] == "1")
        return 0
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--scenarios", default="azure,mooncake,linear,million")
    parser.add_argument("--policies", default="round_robin,kvherd")
    parser.add_argument("--million-sample", type=int, default=20000)
    parser.add_argument(
        "--fraction", type=float, default=1.0, help="run this fraction of azure/mooncake"
    )
    parser.add_argument(
        "--forms",
        action="store_true",
        help="run azure/mooncake as interleaved compiled/plain pairs and print the speed-up",
    )
    parser.add_argument("--pairs", type=int, default=3, help="compiled/plain pairs with --forms")
    parser.add_argument(
        "--step-by-step",
        action="store_true",
        help="also run azure/mooncake with the decode fast-forward off, side by side",
    )
    args = parser.parse_args()
    scenarios = args.scenarios.split(",")
    policies = args.policies.split(",")
    print(
        "| scenario | policy | requests | wall s (load+sim) | sim CPU s | sim ms/request "
        "| peak RSS MB | engine steps | note |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|---|")
    if "azure" in scenarios and AZURE.is_file():
        k = None if args.fraction >= 1 else int(19366 * args.fraction)
        for policy in policies:
            if args.forms:
                _forms(args.pairs, "azure conv, 4 inst", policy, str(AZURE), 4, AZURE_MODEL, k)
                continue
            _runs(args.step_by_step, "azure conv, 4 inst", policy, str(AZURE), 4, AZURE_MODEL, k)
        v = VIDUR_AZURE
        print(
            f"| azure conv, 4 inst | Vidur (issue's figure) | 19,366 | ~{v['wall_s']:.0f} "
            f"| | | ~{v['peak_rss_mb']:.0f} | | not run here |"
        )
        print("| target | | | <= 5 | | | <= 500 | | |")
    if "mooncake" in scenarios and MOONCAKE.is_file():
        k = None if args.fraction >= 1 else int(3993 * args.fraction)
        for policy in policies:
            if args.forms:
                name = "mooncake, 16 inst"
                _forms(args.pairs, name, policy, str(MOONCAKE), 16, MOONCAKE_MODEL, k)
                continue
            _runs(
                args.step_by_step, "mooncake, 16 inst", policy, str(MOONCAKE), 16, MOONCAKE_MODEL, k
            )
    if "linear" in scenarios and AZURE.is_file():
        for frac in (0.25, 0.5, 1.0):
            k = int(19366 * frac * args.fraction)
            r = _spawn(str(AZURE), 4, policies[0], "roofline:llama-2-7b:a100-80gb", k)
            print(_row(f"azure first {frac:.0%}", policies[0], r), flush=True)
    if "million" in scenarios:
        for policy in policies:
            r = _spawn(MILLION, 256, policy, "roofline:llama-2-7b:a100-80gb", args.million_sample)
            per_request = (r["load_s"] + r["sim_s"]) / r["requests"]
            cpu_per_request = (r["load_s"] + r["sim_cpu_s"]) / r["requests"]
            note = (
                f"first {int(r['requests']):,} of 1M; 1M extrapolated: "
                f"{per_request * 1e6 / 60:.1f} min ({cpu_per_request * 1e6 / 60:.1f} min of CPU)"
            )
            print(_row("synthetic 1M, 256 inst", policy, r, note), flush=True)
        print("| target | | 1,000,000 | <= 600 | | | | | |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
