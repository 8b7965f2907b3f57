"""KV tiers in the simulator: hit rate and TTFT for GPU-only, +CPU, +CPU+disk, beside the limit.

One `kvherd sim` run per (tier configuration, policy) on the same arrivals: the Mooncake synthetic
trace (prefix-sharing prompts of ~15k tokens), 16 instances, each with the latency model's GPU KV
capacity, a CPU tier of `--cpu-factor` (4) times it and a disk tier of `--disk-factor` (16) times
it. Printed per run: prefix hit rate (all tiers), its CPU and disk shares, the physical limit (an
infinite cache shared by the fleet, `simulator.metrics.shared_cache_limit`), mean and p99 TTFT;
then the verdicts the tiering issue asks for (kvherd with each tier configuration against GPU-only,
against every peer policy given the same tiers, and its hit rate against the limit). `+cpu+pull`
adds cross-instance prefix pulls (`kvherd sim --prefix-pull`: the router's TTFT rule, 400 Gb/s
NICs, 2,048-token minimum gain) for every policy, peers included: the pull is the router's, not
the policy's. Peers price tiers with their own projects' weights (Dynamo host 0.75 / disk 0.25,
llm-d cpu 0.8).

    python bench/tier_sim.py [--max-requests 1200] [--rate 1.0] [--jobs 2] [--configs ...]
"""

from __future__ import annotations

import argparse
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

MOONCAKE = Path(__file__).resolve().parents[1] / "traces" / "mooncake" / "synthetic_trace.jsonl"
CONFIGS = ("gpu-only", "+cpu", "+cpu+disk", "+cpu+pull")


def _run(job: tuple[argparse.Namespace, str, str]) -> tuple[str, str, dict[str, Any], float]:
    args, config, policy = job
    from simulator.experiment import SimSettings, run_policy
    from simulator.instance import InstanceConfig
    from simulator.latency import load_latency_model
    from simulator.pull import PullConfig
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
    settings = SimSettings(args.instances, model, instance)
    if config.endswith("+pull"):
        settings.prefix_pull = PullConfig(args.pull_min_tokens, args.pull_bandwidth_gbps * 1e9 / 8)
    result = run_policy(trace, settings, policy)
    return config, policy, result.summary, result.wall_s


def _alone_ttft_ms(args: argparse.Namespace) -> tuple[float, float]:
    """Mean TTFT of each request alone on an idle instance, its prefix cached as the physical
    limit caches it (chunked at 8,192 tokens a step): what no routing or tiering can beat."""
    from simulator.latency import load_latency_model
    from simulator.traces import head, load_trace

    trace = head(load_trace(args.trace), args.max_requests)
    model = load_latency_model(args.latency_model)
    seen: set[int] = set()
    times: list[float] = []
    for r in sorted(trace.requests, key=lambda r: r.arrival_s):
        lead = 0
        while lead < len(r.hash_ids) and r.hash_ids[lead] in seen:
            lead += 1
        done, t = min(lead * trace.block_size, r.input_length - 1), 0.0
        while done < r.input_length:
            chunk = min(8192, r.input_length - done)
            t += model.step_time([(chunk, done)], [])
            done += chunk
        times.append(t * 1000.0)
        seen.update(r.hash_ids)
    return sum(times) / len(times), sorted(times)[int(0.99 * (len(times) - 1))]


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
    parser.add_argument("--pull-min-tokens", type=int, default=2048)
    parser.add_argument("--pull-bandwidth-gbps", type=float, default=400.0)
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--jobs", type=int, default=1)
    args = parser.parse_args()
    if not Path(args.trace).is_file():
        print(f"trace {args.trace} not found", file=sys.stderr)
        return 2
    policies = [p for p in args.policies.split(",") if p]
    configs = [c for c in args.configs.split(",") if c]
    jobs = [(args, config, policy) for config in configs for policy in policies]
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
    alone_mean, alone_p99 = _alone_ttft_ms(args)
    print(
        f"physical limit (infinite shared cache): hit rate {limit:.1%}; each request alone at "
        f"that hit rate: mean TTFT {alone_mean:.0f} ms, p99 {alone_p99:.0f} ms\n"
    )
    print(
        "| tiers | policy | hit rate | of limit | CPU | disk | pulled | pulls | mean TTFT ms "
        "| p99 TTFT ms |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for config, policy, s, _ in results:
        pulled = f"{s['hit_rate_pulled']:.1%}" if "pulls" in s else "-"
        print(
            f"| {config} | {policy} | {s['prefix_hit_rate']:.1%} | "
            f"{s['prefix_hit_rate'] / limit:.0%} | {s['hit_rate_cpu']:.1%} | "
            f"{s['hit_rate_disk']:.1%} | {pulled} | {s.get('pulls', '-')} | "
            f"{s['ttft_ms_mean']:.0f} | {s['ttft_ms_p99']:.0f} |"
        )
    if "kvherd" in policies and ("gpu-only", "kvherd") in table:
        base = table[("gpu-only", "kvherd")]
        print()
        for config in (c for c in configs[1:] if (c, "kvherd") in table):
            ours = table[(config, "kvherd")]
            print(
                f"kvherd {config} vs gpu-only: mean TTFT "
                f"{base['ttft_ms_mean'] / ours['ttft_ms_mean']:.2f}x, p99 "
                f"{base['ttft_ms_p99'] / ours['ttft_ms_p99']:.2f}x better (target 1.5x mean); "
                f"hit rate {ours['prefix_hit_rate'] / limit:.0%} of the limit (target 90%)"
            )
        print(
            f"bound: no run beats each request alone at the limit, "
            f"{base['ttft_ms_mean'] / alone_mean:.2f}x better than gpu-only on mean"
        )
    if "kvherd" in policies:
        for config in configs:
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
