"""Every built-in dispatch policy side by side on the Mooncake trace at three load levels.

Each (load, policy) pair is one `kvherd sim` run on the same arrivals (rate-scaled Mooncake
synthetic trace, prefix-sharing prompts of ~15k tokens). The verdict line checks the default's claim:
at the highest load `kvherd` must beat the best other policy on mean and p99 TTFT, with a prefix hit
rate within 5% (relative) of the best hit rate.

    python bench/policy_compare.py [--instances 16] [--rates 0.5,0.75,1.0] [--max-requests K] [--jobs 2]
"""

from __future__ import annotations

import argparse
import json
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

MOONCAKE = Path(__file__).resolve().parents[1] / "traces" / "mooncake" / "synthetic_trace.jsonl"


def _run(
    job: tuple[str, int, float, int | None, str, str, str, int],
) -> tuple[float, str, dict[str, Any], float]:
    path, instances, rate, max_requests, policy, latency, migration, block_size = job
    from simulator.experiment import SimSettings, run_policy
    from simulator.instance import InstanceConfig
    from simulator.latency import load_latency_model
    from simulator.traces import head, load_trace, scale_rate

    trace = load_trace(path)
    if max_requests is not None:
        trace = head(trace, max_requests)
    trace = scale_rate(trace, rate)
    model = load_latency_model(latency)
    assert model.kv_capacity_tokens is not None
    settings = SimSettings(
        instances,
        model,
        InstanceConfig(num_blocks=model.kv_capacity_tokens // block_size, block_size=block_size),
        migration_policy=migration,
    )
    result = run_policy(trace, settings, policy)
    return rate, policy, result.summary, result.wall_s


def main() -> int:
    from policies.registry import DISPATCH_POLICIES

    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--trace", default=str(MOONCAKE))
    parser.add_argument("--instances", type=int, default=16)
    parser.add_argument("--rates", default="0.5,0.75,1.0", help="rate scales, lowest to highest")
    parser.add_argument("--max-requests", type=int, default=None)
    parser.add_argument("--policies", default=",".join(DISPATCH_POLICIES))
    parser.add_argument("--latency-model", default="roofline:llama-2-70b:a100-80gb:tp4")
    parser.add_argument("--migration-policy", default="none")
    parser.add_argument("--jobs", type=int, default=1)
    parser.add_argument("--block-size", type=int, default=16, help="engine KV block size")
    parser.add_argument(
        "--results", type=Path, default=None, help="append each run's summary here (JSON lines)"
    )
    args = parser.parse_args()
    if not Path(args.trace).is_file():
        print(f"trace {args.trace} not found", file=sys.stderr)
        return 2
    rates = sorted(float(r) for r in args.rates.split(","))
    policies = args.policies.split(",")
    jobs = [
        (
            args.trace,
            args.instances,
            rate,
            args.max_requests,
            policy,
            args.latency_model,
            args.migration_policy,
            args.block_size,
        )
        for rate in reversed(rates)  # the verdict's load level first
        for policy in policies
    ]
    results: dict[float, dict[str, dict[str, Any]]] = {rate: {} for rate in rates}
    with ProcessPoolExecutor(max_workers=args.jobs) as pool:
        for rate, policy, summary, wall in pool.map(_run, jobs):
            results[rate][policy] = summary
            print(f"rate x{rate:g} {policy}: {wall:.1f} s", file=sys.stderr, flush=True)
            if args.results is not None:
                with args.results.open("a") as f:
                    f.write(json.dumps({"rate": rate, "policy": policy, "summary": summary}) + "\n")
    print(
        f"Mooncake trace ({args.max_requests or 'all'} requests), {args.instances} instances, "
        f"{args.latency_model}, KV block {args.block_size}, migration {args.migration_policy}"
    )
    for rate in rates:
        print(f"\n### rate x{rate:g}\n")
        print(
            "| policy | TTFT mean ms | TTFT p50 | TTFT p99 | TPOT mean ms | E2E mean ms "
            "| hit rate | preemptions |"
        )
        print("|---|---:|---:|---:|---:|---:|---:|---:|")
        for policy, s in sorted(results[rate].items(), key=lambda kv: kv[1]["ttft_ms_mean"]):
            print(
                f"| {policy} | {s['ttft_ms_mean']:.0f} | {s['ttft_ms_p50']:.0f} | {s['ttft_ms_p99']:.0f} "
                f"| {s['tpot_ms_mean']:.1f} | {s['e2e_ms_mean']:.0f} | {s['prefix_hit_rate']:.1%} "
                f"| {s['preemptions']} |"
            )
    top = results[rates[-1]]
    if "kvherd" in top and len(top) > 1:
        ours = top["kvherd"]
        peers = {p: s for p, s in top.items() if p != "kvherd"}
        best_mean = min(peers, key=lambda p: peers[p]["ttft_ms_mean"])
        best_p99 = min(peers, key=lambda p: peers[p]["ttft_ms_p99"])
        best_hit = max(s["prefix_hit_rate"] for s in top.values())
        ok_mean = ours["ttft_ms_mean"] < peers[best_mean]["ttft_ms_mean"]
        ok_p99 = ours["ttft_ms_p99"] < peers[best_p99]["ttft_ms_p99"]
        ok_hit = ours["prefix_hit_rate"] >= 0.95 * best_hit
        print(
            f"\nverdict at x{rates[-1]:g}: kvherd mean TTFT {ours['ttft_ms_mean']:.0f} ms vs best peer "
            f"{best_mean} {peers[best_mean]['ttft_ms_mean']:.0f} ms "
            f"(ratio {ours['ttft_ms_mean'] / peers[best_mean]['ttft_ms_mean']:.2f}) "
            f"{'OK' if ok_mean else 'FAIL'}; "
            f"p99 {ours['ttft_ms_p99']:.0f} vs {best_p99} {peers[best_p99]['ttft_ms_p99']:.0f} "
            f"{'OK' if ok_p99 else 'FAIL'}; hit rate {ours['prefix_hit_rate']:.1%} vs best {best_hit:.1%} "
            f"{'OK' if ok_hit else 'FAIL'}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
