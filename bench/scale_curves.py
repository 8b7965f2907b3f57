"""How the router's decisions and the simulator grow with the fleet, plotted.

Router: fleets of `--router-instances` instances, each holding `--blocks-per-instance` indexed
blocks (4,096 x 2,500 = 10.2M at the top, a little less once duplicates merge), built as in
``bench/route_bench.py`` (real KV events, re-hashed; half shared documents, half private text);
per point the thread-CPU p50/p99 of a decision (hashing, prefix match, kvherd policy) for 2k-token
prompts, and the index's memory as the process's RSS growth while it fills, per indexed block (an
upper bound). Simulator: a synthetic trace of `--requests-per-instance` requests per instance at a
fixed rate per instance, on `--sim-instances` instances (to 1,024), kvherd policy: sim CPU seconds
per request and peak RSS. Every point runs in a fresh process (its RSS is its own). Writes the
table, and the curves to ``--plot`` (PNG); CPU time is the column to read on a shared machine.

    python bench/scale_curves.py                       # to 4,096 instances / 10M blocks, ~10 min
    python bench/scale_curves.py --router-instances 64,256 --sim-instances 16,64   # quick
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
SIM_LATENCY = "roofline:llama-2-7b:a100-80gb"


def router_point(instances: int, blocks_per_instance: int, queries: int) -> dict[str, float]:
    sys.path.insert(0, str(BENCH))
    import gc

    import route_bench

    from policies import load_dispatch_policy
    from scheduler.core.router import Router

    args = argparse.Namespace(
        instances=instances, blocks=instances * blocks_per_instance, documents=64, seed=0
    )
    start = time.perf_counter()
    cluster, documents, grown, indexed = route_bench.build(args, trace_memory=False)
    build_s = time.perf_counter() - start
    gc.freeze()
    router = Router(cluster, load_dispatch_policy("kvherd"))
    batch = route_bench.prompts(documents, 2048, queries, seed=2048)
    route_bench.time_routes(router, batch[:10], "warm")
    _, cpu = route_bench.time_routes(router, batch, "t")
    return {
        "instances": instances,
        "blocks": indexed,
        "build_s": build_s,
        "p50_ms": route_bench.ms(cpu, 0.5),
        "p99_ms": route_bench.ms(cpu, 0.99),
        "bytes_per_block": grown / indexed,
        "rss_mb": route_bench.rss_bytes() / 2**20,
    }


def sim_point(instances: int, requests_per_instance: int) -> dict[str, float]:
    from simulator.experiment import SimSettings, run_policy
    from simulator.instance import InstanceConfig
    from simulator.latency import load_latency_model
    from simulator.synthetic import generate, parse_spec

    requests = instances * requests_per_instance
    trace = generate(
        parse_spec(
            f"synthetic:requests={requests},rate={2.0 * instances},input_mean=1024,"
            f"output_mean=128,num_groups={max(8, instances * 4)},prefix_tokens=512,"
            "max_input=8192,seed=0"
        )
    )
    model = load_latency_model(SIM_LATENCY)
    assert model.kv_capacity_tokens is not None
    settings = SimSettings(
        instances, model, InstanceConfig(num_blocks=model.kv_capacity_tokens // 16)
    )
    cpu_start = time.process_time()
    result = run_policy(trace, settings, "kvherd")
    cpu_s = time.process_time() - cpu_start
    return {
        "instances": instances,
        "requests": requests,
        "sim_cpu_s": cpu_s,
        "cpu_ms_per_request": cpu_s / requests * 1e3,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0,
        "completed": result.summary["completed"],
    }


def _spawn(*child: str) -> dict[str, float]:
    cmd = [sys.executable, __file__, "--child", *child]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def _plot(routes: list[dict[str, float]], sims: list[dict[str, float]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, middle, right) = plt.subplots(1, 3, figsize=(13, 3.8))
    if routes:
        xs = [r["instances"] for r in routes]
        left.plot(xs, [r["p50_ms"] for r in routes], "o-", label="p50")
        left.plot(xs, [r["p99_ms"] for r in routes], "s--", label="p99")
        left.set(xscale="log", xlabel="instances (blocks grow with them)", ylabel="ms CPU")
        left.set_xticks(xs, [f"{int(x):,}" for x in xs], minor=False)
        left.minorticks_off()
        left.set_title("router decision, 2k-token prompt")
        left.legend()
        middle.plot(
            [r["blocks"] / 1e6 for r in routes], [r["bytes_per_block"] for r in routes], "o-"
        )
        middle.set(xscale="log", xlabel="indexed blocks (millions)", ylabel="bytes per block")
        middle.set_title("prefix index memory (RSS growth)")
        middle.set_ylim(bottom=0)
    if sims:
        xs = [s["instances"] for s in sims]
        right.plot(xs, [s["cpu_ms_per_request"] for s in sims], "o-", label="CPU ms / request")
        right.set(xscale="log", xlabel="simulated instances", ylabel="CPU ms per request")
        right.set_xticks(xs, [f"{int(x):,}" for x in xs], minor=False)
        right.minorticks_off()
        right.set_title("simulator")
        right.set_ylim(bottom=0)
        twin = right.twinx()
        twin.plot(xs, [s["peak_rss_mb"] for s in sims], "s--", color="tab:red", label="peak RSS")
        twin.set_ylabel("peak RSS MB", color="tab:red")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        kind, *rest = sys.argv[2:]
        point = router_point(*map(int, rest)) if kind == "router" else sim_point(*map(int, rest))
        print(json.dumps(point))
        return 0
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--router-instances", default="256,1024,4096")
    parser.add_argument("--blocks-per-instance", type=int, default=2500)
    parser.add_argument("--queries", type=int, default=300)
    parser.add_argument("--sim-instances", default="64,256,1024")
    parser.add_argument("--requests-per-instance", type=int, default=40)
    parser.add_argument("--plot", type=Path, default=BENCH / "scale_curves.png")
    args = parser.parse_args()
    routes, sims = [], []
    print("| router: instances | indexed blocks | build s | p50 ms CPU | p99 ms CPU "
          "| bytes/block | RSS MB |")  # fmt: skip
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for n in filter(None, args.router_instances.split(",")):
        r = _spawn("router", n, str(args.blocks_per_instance), str(args.queries))
        routes.append(r)
        print(
            f"| {int(r['instances']):,} | {int(r['blocks']):,} | {r['build_s']:.0f} "
            f"| {r['p50_ms']:.3f} | {r['p99_ms']:.3f} | {r['bytes_per_block']:.0f} "
            f"| {r['rss_mb']:.0f} |",
            flush=True,
        )
    print("\n| sim: instances | requests | sim CPU s | CPU ms/request | peak RSS MB |")
    print("|---:|---:|---:|---:|---:|")
    for n in filter(None, args.sim_instances.split(",")):
        s = _spawn("sim", n, str(args.requests_per_instance))
        sims.append(s)
        assert s["completed"] == s["requests"], s
        print(
            f"| {int(s['instances']):,} | {int(s['requests']):,} | {s['sim_cpu_s']:.1f} "
            f"| {s['cpu_ms_per_request']:.2f} | {s['peak_rss_mb']:.0f} |",
            flush=True,
        )
    _plot(routes, sims, args.plot)
    print(f"\ncurves: {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
