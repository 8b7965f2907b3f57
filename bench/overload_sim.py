"""A 10x flood on the live fleet and in `kvherd sim --admission`, side by side: does the simulator
show what the proxy refuses, and how soon service recovers?

For each case (prompt of 25 tokens; 32- or 256-token outputs; agents with batches of 8 or 64):
  1. `kvherd profile` fits the built-in engine's step time for that batch limit (the stepping
     thread's CPU time, one torch thread: robust to the rest of the machine's load);
  2. the chaos suite's flood on a real fleet (`tests/support/overload_flood.py`: two agents,
     ``kvherd serve`` with the shipped admission, capacity measured closed-loop, normal load,
     10x for 4 s, normal load again);
  3. the same shape (`simulator.overload.flood_trace`, at the capacity the live fleet measured)
     through the simulator with the same admission settings and the profiled engine, its serving
     loop's per-step cost set so that a full batch decodes at the live fleet's capacity.
Printed per case: capacity (req/s; the sim's from the flood's served requests), the share of flood
requests refused (429), 5xx, and the recovery (`simulator.overload.recovered_s`, one rule for both).

    python bench/overload_sim.py [--cases short,long,long-large-batch]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "support"))

from overload_flood import BASELINE_S, FLOOD_FACTOR, FLOOD_S, RECOVERY_WINDOW_S, flood  # noqa: E402

from policies import load_dispatch_policy  # noqa: E402
from scheduler.core.admission import AdmissionSettings  # noqa: E402
from simulator.cluster import ClusterConfig, SimCluster  # noqa: E402
from simulator.instance import InstanceConfig  # noqa: E402
from simulator.latency import load_latency_model  # noqa: E402
from simulator.overload import flood_trace, recovered_s  # noqa: E402

CASES = {"short": (32, 8), "long": (256, 8), "long-large-batch": (256, 64)}


def profile(max_num_seqs: int, out: Path) -> Path:
    path = out / f"profile_{max_num_seqs}.json"
    subprocess.run(
        [sys.executable, "-m", "kvherd", "profile", "--model", "tiny", "--max-num-seqs",
         str(max_num_seqs), "--max-batch", str(max_num_seqs), "--max-context", "512",
         "--clock", "thread", "--torch-threads", "1", "--out", str(path)],
        check=True, capture_output=True,
    )  # fmt: skip
    return path


def simulate(
    profile_path: Path, capacity: float, max_tokens: int, max_num_seqs: int
) -> dict[str, float | None]:
    every = max(0.1, 2.0 / capacity)
    shape = flood_trace(
        capacity,
        factor=FLOOD_FACTOR,
        before_s=BASELINE_S,
        flood_s=FLOOD_S,
        after_s=10.0,
        normal_gap_s=every,
        input_tokens=25,
        output_tokens=max_tokens,
    )
    latency = load_latency_model(f"calibrated:{profile_path}")
    engine = json.loads(profile_path.read_text())["engine"]
    # One number calibrates the serving loop: the agents' step as the live capacity implies it
    # (two agents, full batches of `max_tokens` decode steps) less the profiled engine step.
    live_step = 2 * max_num_seqs / (capacity * max_tokens)
    engine_step = latency.step_time([], [25 + max_tokens // 2] * max_num_seqs)
    config = ClusterConfig(
        num_instances=2,
        instance=InstanceConfig(**engine, step_overhead_s=max(0.0, live_step - engine_step)),
        admission=AdmissionSettings(),
    )
    cluster = SimCluster(config, latency, load_dispatch_policy("round_robin"))
    metrics = cluster.run(shape.trace)
    cols = metrics.columns()
    index = cols["index"].astype(int)
    total = cols["last_token"] - cols["arrival"]
    baseline = float(np.median(total[cols["arrival"] < shape.flood_start_s]))
    probes = [
        (float(a), float(t), 200)
        for i, a, t in zip(index, cols["arrival"], total, strict=True)
        if shape.probe(i)
    ]
    probes += [(a, 0.0, 429) for a in metrics.refused_arrivals if a >= shape.flood_end_s]
    in_flood = (cols["arrival"] >= shape.flood_start_s) & (cols["arrival"] < shape.flood_end_s)
    refused = [a for a in metrics.refused_arrivals if shape.flood_start_s <= a < shape.flood_end_s]
    flooded = int(in_flood.sum()) + len(refused)
    normal = max(2 * baseline, baseline + 0.25)
    return {
        "capacity": float(in_flood.sum()) / FLOOD_S,
        "refused": len(refused) / flooded if flooded else None,
        "recovered_s": recovered_s(probes, shape.flood_end_s, normal, RECOVERY_WINDOW_S),
        "baseline_s": baseline,
    }


def _fmt(value: float | None, fmt: str) -> str:
    return "never" if value is None else fmt.format(value)


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--cases", default=",".join(CASES))
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.cases.split(","):
            max_tokens, max_num_seqs = CASES[name]
            path = profile(max_num_seqs, Path(tmp))
            live = await flood(max_tokens, max_num_seqs)
            sent = sum(live.statuses.values())
            sim = simulate(path, live.capacity, max_tokens, max_num_seqs)
            rows.append((name, live, sent, sim))
    print(
        "| case | capacity live (req/s) | served in flood, sim (req/s) | refused live | "
        "refused sim | 5xx live | recovery live (s) | recovery sim (s) |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for name, live, sent, sim in rows:
        refused_live = live.statuses.get(429, 0) / sent if sent else None
        errors = sum(n for status, n in live.statuses.items() if status >= 500)
        print(
            f"| {name} | {live.capacity:.1f} | {_fmt(sim['capacity'], '{:.1f}')} | "
            f"{_fmt(refused_live, '{:.0%}')} | {_fmt(sim['refused'], '{:.0%}')} | {errors} | "
            f"{_fmt(live.recovered_s, '{:.2f}')} | {_fmt(sim['recovered_s'], '{:.2f}')} |"
        )


if __name__ == "__main__":
    asyncio.run(main())
