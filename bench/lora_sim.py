"""Many LoRA adapters in the simulator: TTFT and adapter loads per policy, on the same arrivals.

A synthetic workload (`simulator.synthetic`, ``adapters=N``): every request names one of
`--adapters` (64) LoRA adapters of one base model, Zipf(`--zipf`, 1.0) popular, log-normal
prompts (`--input-mean` 1,024 tokens) and outputs (`--output-mean` 128). `--instances` (8)
simulated instances each hold `--max-loras` (4) adapters at once, so the fleet's 32 slots cannot
hold the 64 adapters; loading one takes `--lora-load-ms` (20, the `kvherd` policy's own price of
a load). Policies, each through the proxy's own router (model index, adapter views):
``round_robin``; ``llmd`` (llm-d's default profile, blind to adapters); ``llmd+lora`` (the same
profile plus llm-d's ``lora-affinity-scorer`` at weight 2, the queue scorer's); ``kvherd``
(adapter loads and evictions priced in prefill tokens). Each seed is a different draw of the
workload; the table shows medians over seeds.

    python bench/lora_sim.py [--requests 1500] [--rate 20] [--seeds 0,1,2] [--jobs 2]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import yaml

POLICIES = ("round_robin", "llmd", "llmd+lora", "kvherd")
# llm-d's default profile (`policies.llmd`) with its LoRA affinity scorer beside the others.
LLMD_LORA = {
    "scorers": [
        {"type": "prefix-cache-scorer", "weight": 3},
        {"type": "queue-scorer", "weight": 2},
        {"type": "kv-cache-utilization-scorer", "weight": 2},
        {"type": "lora-affinity-scorer", "weight": 2},
    ],
    "picker": "max-score-picker",
}
ROWS = ("ttft_ms_mean", "ttft_ms_p50", "ttft_ms_p99", "lora_loads", "lora_slot_waits")


def _run(job: tuple[argparse.Namespace, str, str, int]) -> tuple[str, int, dict[str, Any]]:
    args, policy, spec, seed = job
    from simulator.experiment import SimSettings, run_policy
    from simulator.instance import InstanceConfig
    from simulator.latency import load_latency_model
    from simulator.models import FleetModels
    from simulator.synthetic import SyntheticSpec, generate

    trace = generate(
        SyntheticSpec(
            requests=args.requests,
            rate=args.rate,
            input_mean=args.input_mean,
            output_mean=args.output_mean,
            max_input=8192,
            adapters=args.adapters,
            adapter_zipf_s=args.zipf,
            seed=seed,
        )
    )
    model = load_latency_model(args.latency_model)
    assert model.kv_capacity_tokens is not None
    settings = SimSettings(
        args.instances,
        model,
        InstanceConfig(num_blocks=model.kv_capacity_tokens // 16, block_size=16),
        seed=seed,
        models=FleetModels(max_loras=args.max_loras, lora_load_s=args.lora_load_ms / 1000.0),
    )
    return policy, seed, run_policy(trace, settings, spec).summary


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--requests", type=int, default=1500)
    parser.add_argument("--rate", type=float, default=20.0, help="arrivals per second")
    parser.add_argument("--adapters", type=int, default=64)
    parser.add_argument("--zipf", type=float, default=1.0, help="adapter popularity exponent")
    parser.add_argument("--input-mean", type=int, default=1024)
    parser.add_argument("--output-mean", type=int, default=128)
    parser.add_argument("--instances", type=int, default=8)
    parser.add_argument("--max-loras", type=int, default=4)
    parser.add_argument("--lora-load-ms", type=float, default=20.0)
    parser.add_argument("--latency-model", default="roofline:llama-2-7b:a100-80gb:tp1")
    parser.add_argument("--policies", default=",".join(POLICIES))
    parser.add_argument("--seeds", default="0,1,2", help="workload draws (medians over them)")
    parser.add_argument("--jobs", type=int, default=1)
    args = parser.parse_args()
    policies = [p for p in args.policies.split(",") if p]
    seeds = [int(s) for s in args.seeds.split(",") if s]
    with tempfile.TemporaryDirectory() as tmp:
        pipeline = Path(tmp) / "llmd-lora.yaml"
        pipeline.write_text(yaml.safe_dump(LLMD_LORA))
        specs = {p: str(pipeline) if p == "llmd+lora" else p for p in policies}
        jobs = [(args, p, specs[p], seed) for seed in seeds for p in policies]
        if args.jobs > 1:
            with ProcessPoolExecutor(args.jobs) as pool:
                results = list(pool.map(_run, jobs))
        else:
            results = [_run(job) for job in jobs]
    by_policy: dict[str, list[dict[str, Any]]] = {p: [] for p in policies}
    for policy, _, summary in results:
        by_policy[policy].append(summary)
    print(
        f"{args.requests} requests at {args.rate:g}/s over {args.adapters} adapters "
        f"(Zipf {args.zipf:g}), {args.instances} instances x {args.max_loras} adapter slots, "
        f"{args.lora_load_ms:g} ms a load, {args.latency_model}; medians over seeds {args.seeds}\n"
    )
    print("| policy | TTFT mean ms | TTFT p50 ms | TTFT p99 ms | adapter loads | slot waits |")
    print("|---|---:|---:|---:|---:|---:|")
    medians: dict[str, dict[str, float]] = {}
    for policy, runs in by_policy.items():
        failed = sum(s["failed"] + s["unfinished"] for s in runs)
        assert failed == 0, f"{policy}: {failed} requests failed or did not finish"
        medians[policy] = {k: statistics.median(s[k] for s in runs) for k in ROWS}
        m = medians[policy]
        print(
            f"| {policy} | {m['ttft_ms_mean']:.0f} | {m['ttft_ms_p50']:.0f} | "
            f"{m['ttft_ms_p99']:.0f} | {m['lora_loads']:.0f} | {m['lora_slot_waits']:.0f} |"
        )
    if "kvherd" in medians:
        ours = medians["kvherd"]
        print()
        for peer in (p for p in policies if p != "kvherd"):
            theirs = medians[peer]
            print(
                f"kvherd vs {peer}: TTFT mean {theirs['ttft_ms_mean'] / ours['ttft_ms_mean']:.2f}x, "
                f"p99 {theirs['ttft_ms_p99'] / ours['ttft_ms_p99']:.2f}x lower; adapter loads "
                f"{ours['lora_loads']:.0f} vs {theirs['lora_loads']:.0f}"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
