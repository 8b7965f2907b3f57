"""KV tiers in the simulator: hit rate and TTFT for GPU-only, +CPU, +CPU+disk, beside the limit.

One `kvherd sim` run per (tier configuration, policy) on the same arrivals: the Mooncake synthetic
trace (prefix-sharing prompts of ~15k tokens), 16 instances, each with the latency model's GPU KV
capacity, a CPU tier of `--cpu-factor` (4) times it and a disk tier of `--disk-factor` (16) times
it. Printed per run: prefix hit rate (all tiers), its CPU and disk shares, the physical limit (an
infinite cache shared by the fleet, `simulator.metrics.shared_cache_limit`), mean and p99 TTFT;
then the verdicts the tiering issue asks for (kvherd with CPU against GPU-only, against every peer
policy given the same tiers, and its hit rate against the limit). Peers price tiers with their own
projects' weights (Dynamo host 0.75 / disk 0.25, llm-d cpu 0.8).

    python bench/tier_sim.py [--max-requests 1200] [--rate 1.0] [--jobs 2]
"""

from __future__ import annotations

import argparse
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

MOONCAKE = (
    Path(__file__).resolve().parents[2] / "shared" / "traces" / "mooncake" / "synthetic_trace.jsonl"
)
CONFIGS = ("gpu-only", "+cpu", "+cpu+disk")


def _run(job: tuple[argparse.Namespace, str, str]) -> tuple[str, str, dict[str, Any], float]:
    args, config, policy = job
    from simulator.experiment import SimSettings, run_policy
    from simulator.instance import InstanceConfig
    from simulator.latency import load_latency_model
    from simulator.traces import head, load_trace, scale_rate

    trace = scale_rate(head(load_trace(args.trace), args.max_requests), args.rate)
    model = load_latency_model(args.latency_model)
    assert model.kv_capacity_tokens is not None
    gpu_blocks = model.kv_capacity_tokens // args.block_size
    instance = InstanceConfig(
        num_blocks=gpu_blocks,
        block_size=args.block_size,
        num_cpu_blocks=0 if config == "gpu-only" else args.cpu_factor * gpu_blocks,
        num_disk_blocks=args.disk_factor * gpu_blocks if config == "+cpu+disk" else 0,
    )
    result = run_policy(trace, SimSettings(args.instances, model, instance), policy)
    return config, policy, result.summary, result.wall_s


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--trace", default=str(MOONCAKE))
    parser.add_argument("--instances", type=int, default=16)
    parser.add_argument("--max-requests", type=int, default=1200)
    parser.add_argument("--rate", type=float, default=1.0, help="arrival rate scale")
    parser.add_argument("--policies", default="kvherd,llmd,dynamo_kv")
    parser.add_argument("--latency-model", default="roofline:llama-2-70b:a100-80gb:tp4")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--cpu-factor", type=int, default=4)
    parser.add_argument("--disk-factor", type=int, default=16)
    parser.add_argument("--jobs", type=int, default=1)
    args = parser.parse_args()
    if not Path(args.trace).is_file():
        print(f"trace {args.trace} not found", file=sys.stderr)
        return 2
    policies = [p for p in args.policies.split(",") if p]
    jobs = [(args, config, policy) for config in CONFIGS for policy in policies]
    if args.jobs > 1:
        with ProcessPoolExecutor(args.jobs) as pool:
            results = list(pool.map(_run, jobs))
    else:
        results = [_run(job) for job in jobs]
    table = {(config, policy): summary for config, policy, summary, _ in results}
    limit = results[0][2]["shared_cache_limit"]
    print(
        f"{args.max_requests} Mooncake requests x{args.rate:g}, {args.instances} instances, "
        f"{args.latency_model}; CPU tier {args.cpu_factor}x, disk {args.disk_factor}x the GPU KV"
    )
    print(f"physical limit (infinite shared cache): hit rate {limit:.1%}\n")
    print("| tiers | policy | hit rate | of limit | CPU | disk | mean TTFT ms | p99 TTFT ms |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for config, policy, s, _ in results:
        print(
            f"| {config} | {policy} | {s['prefix_hit_rate']:.1%} | "
            f"{s['prefix_hit_rate'] / limit:.0%} | {s['hit_rate_cpu']:.1%} | "
            f"{s['hit_rate_disk']:.1%} | {s['ttft_ms_mean']:.0f} | {s['ttft_ms_p99']:.0f} |"
        )
    if "kvherd" in policies:
        base, cpu = table[("gpu-only", "kvherd")], table[("+cpu", "kvherd")]
        print(
            f"\nkvherd +cpu vs gpu-only: mean TTFT {base['ttft_ms_mean'] / cpu['ttft_ms_mean']:.2f}x"
            f" better (target 1.5x); hit rate {cpu['prefix_hit_rate'] / limit:.0%} of the limit"
            " (target 90%, with pull)"
        )
        for config in CONFIGS:
            ours = table[(config, "kvherd")]
            for peer in (p for p in policies if p != "kvherd"):
                theirs = table[(config, peer)]
                wins = (
                    ours["ttft_ms_mean"] < theirs["ttft_ms_mean"]
                    and ours["ttft_ms_p99"] < theirs["ttft_ms_p99"]
                )
                print(
                    f"{config}: kvherd vs {peer}: mean {ours['ttft_ms_mean']:.0f} / "
                    f"{theirs['ttft_ms_mean']:.0f} ms, p99 {ours['ttft_ms_p99']:.0f} / "
                    f"{theirs['ttft_ms_p99']:.0f} ms: {'beats' if wins else 'does NOT beat'}"
                )
    for config, policy, _, wall in results:
        print(f"{config} {policy}: simulated in {wall:.1f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
