"""Scale-in with and without the prefix hand-over, on this machine's CPU agents.

What it does, per round and mode, with two real ``kvherd agent`` processes (``--model small``,
one torch thread each) registered with a real ``kvherd serve`` (the ``kvherd`` policy):
- warm: ``--prefixes`` shared prefixes of ``--prefix-tokens`` tokens, each sent ``--repeats``
  times with a suffix of its own (one-token greedy completions), so the router spreads them over
  both agents by affinity and load;
- scale-in: SIGTERM on the agent that holds more blocks (it drains, then, in mode ``handover``,
  the survivor pulls its prefixes; in mode ``drain_only``, ``serve --no-handover``, they are lost
  as when a peer scales in); the seconds until it exits;
- after: the same prefixes again, new suffixes, all on the survivor: prompt tokens it recomputes
  (its ``vllm:prefix_cache_queries - hits``; apart: what the hand-over's own one-token
  completions computed), hit rate, TTFT p50/p90; then once more (steady).

Run: ``python bench/scale_in.py`` (``--json FILE`` keeps the figures). The machine is shared:
compare the rows of one run.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "support"))
from agent_process import AgentProcess, agent_processes  # noqa: E402
from serve_process import ADMIN_TOKEN, Served, serve_process  # noqa: E402

from scheduler.core.prom_text import samples  # noqa: E402

BLOCK = 16
AGENT_FLAGS = ("--model", "small", "--block-size", str(BLOCK), "--torch-threads", "1")
MODES = ("drain_only", "handover")


def metric_sum(text: str, name: str, **labels: str) -> float:
    """The sum of `name`'s samples in Prometheus `text` whose labels include `labels`."""
    found = samples(text, {name})
    return sum(v for _, got, v in found if labels.items() <= got.items())


def tokens_of(seed: int, count: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 250) for _ in range(count)]


def phase(served: Served, prefixes: list[list[int]], repeats: int, seed: int) -> list[float]:
    """Each prefix `repeats` times, a suffix of its own each time: the response times."""
    times = []
    with httpx.Client(timeout=300) as client:
        for r in range(repeats):
            for i, prefix in enumerate(prefixes):
                body = {"prompt": prefix + tokens_of(seed + r * 1000 + i, 8), "max_tokens": 1,
                        "temperature": 0.0}  # fmt: skip
                started = time.perf_counter()
                client.post(f"{served.url}/v1/completions", json=body).raise_for_status()
                times.append(time.perf_counter() - started)
    return times


def counters(agent: AgentProcess) -> tuple[float, float]:
    text = httpx.get(f"{agent.url}/metrics", timeout=10).text
    return (metric_sum(text, "vllm:prefix_cache_queries_total"),
            metric_sum(text, "vllm:prefix_cache_hits_total"))  # fmt: skip


def cached_blocks(agent: AgentProcess) -> int:
    return int(httpx.get(f"{agent.url}/kvherd/v1/state", timeout=10).json()["cached_blocks"])


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def run_mode(mode: str, args: argparse.Namespace, seed: int) -> dict[str, Any]:
    prefixes = [tokens_of(seed + i, args.prefix_tokens) for i in range(args.prefixes)]
    flags: tuple[str, ...] = ("--policy", "kvherd", "--load-interval", "0.1")
    flags += ("--no-handover",) if mode == "drain_only" else ()
    with serve_process([], *flags) as served:
        join = ("--scheduler", served.admin_url, "--heartbeat-interval", "0.2")
        env = {"KVHERD_ADMIN_TOKEN": ADMIN_TOKEN}
        with agent_processes(2, *AGENT_FLAGS, *join, env=env) as agents:
            instances = f"{served.admin_url}/admin/v1/instances"
            while len(httpx.get(instances, headers=served.admin_headers).json()["data"]) < 2:
                time.sleep(0.1)
            phase(served, prefixes, args.repeats, seed + 10_000)
            leaving, staying = sorted(agents, key=cached_blocks, reverse=True)
            held = cached_blocks(leaving), cached_blocks(staying)
            c0 = counters(staying)
            started = time.perf_counter()
            assert leaving.terminate(300) == 0, leaving.log()
            exit_s = time.perf_counter() - started
            c1 = counters(staying)
            metrics = httpx.get(f"{served.url}/metrics").text
            handed = metric_sum(metrics, "kvherd_handover_blocks_total", outcome="pulled")
            after = phase(served, prefixes, args.repeats, seed + 20_000)
            c2 = counters(staying)
            steady = phase(served, prefixes, args.repeats, seed + 30_000)
    queries, hits = c2[0] - c1[0], c2[1] - c1[1]
    return {
        "mode": mode,
        "blocks_before": held,
        "handed_over_blocks": handed,
        "exit_s": exit_s,
        "handover_computed_tokens": (c1[0] - c0[0]) - (c1[1] - c0[1]),
        "recomputed_tokens": queries - hits,
        "prompt_tokens": queries,
        "hit_rate": hits / queries if queries else 0.0,
        "after_ms": [1000 * statistics.median(after), 1000 * quantile(after, 0.9)],
        "steady_ms": [1000 * statistics.median(steady), 1000 * quantile(steady, 0.9)],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prefixes", type=int, default=8)
    parser.add_argument("--prefix-tokens", type=int, default=384)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    rows = [run_mode(m, args, 1000 * r) for r in range(args.rounds) for m in MODES]
    print("| round | mode | blocks held (leaver, survivor) | handed over | exit s | tokens the "
          "hand-over computed | prompt tokens recomputed after | hit rate after | "
          "TTFT after p50/p90 ms | TTFT steady p50/p90 ms |")  # fmt: skip
    print("|---|---|---|---:|---:|---:|---:|---:|---|---|")
    for n, row in enumerate(rows):
        print(f"| {n // len(MODES) + 1} | {row['mode']} | {row['blocks_before']} | "
              f"{row['handed_over_blocks']:.0f} | {row['exit_s']:.1f} | "
              f"{row['handover_computed_tokens']:.0f} | "
              f"{row['recomputed_tokens']:.0f} of {row['prompt_tokens']:.0f} | "
              f"{row['hit_rate']:.2f} | {row['after_ms'][0]:.0f} / {row['after_ms'][1]:.0f} | "
              f"{row['steady_ms'][0]:.0f} / {row['steady_ms'][1]:.0f} |")  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
