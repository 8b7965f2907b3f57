"""KV tiers and prefix pulls on this machine's CPU agents: pull against recompute, and a working
set larger than the GPU pool.

What it does, with real ``kvherd agent`` processes (``--model small``, one torch thread each) and
a real ``kvherd serve``:
- ``crossover``: two agents; for each prefix length in ``--tokens``, ``--repeats`` times on a
  prompt of its own, ``a`` computes it (unmeasured), then ``b`` serves it three ways, a greedy
  one-token completion each: ``recompute`` (a ``cache_salt`` of its own: every token
  prefilled), ``pull`` (``X-Kvherd-Pull`` from ``a``), ``local hit`` (the same again on ``b``).
  The pull must land every full block and give the recompute's output, or the run fails.
  Prints median milliseconds per length and the crossover (the shortest prefix from which
  pulling beats recomputing at every longer length measured).
- ``working set``: two agents whose GPU pools hold ``--pool-prefixes`` of the workload's
  ``--prefixes`` shared prefixes (``--prefix-tokens`` each), behind ``kvherd serve`` (the
  ``kvherd`` policy), ``--requests`` requests (a prefix drawn Zipf(1.1), a suffix of its own)
  from ``--clients`` closed-loop clients; configurations: GPU only, + a CPU tier holding every
  prefix, + CPU tier and ``--prefix-pull``. Prints TTFT median/p90 (one-token completions: the
  response time) and the prefix-cache hit rate (``cached_tokens`` over prompt tokens).

Run: ``python bench/tier_fleet.py`` (``--json FILE`` keeps the figures). Processes are stopped on
exit. The machine is shared: compare the rows of one run, not runs.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "support"))
from agent_process import AgentProcess, agent_processes  # noqa: E402
from serve_process import serve_process  # noqa: E402

BLOCK = 16
AGENT_FLAGS = ("--model", "small", "--block-size", str(BLOCK), "--torch-threads", "1")
WAYS = ("recompute", "pull", "local hit")


def prompt_of(seed: int, tokens: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 250) for _ in range(tokens)]


def complete(url: str, prompt: list[int], headers: dict[str, str] | None = None,
             **extra: Any) -> tuple[float, httpx.Response]:  # fmt: skip
    body = {"prompt": prompt, "max_tokens": 1, "temperature": 0.0, **extra}
    started = time.perf_counter()
    response = httpx.post(f"{url}/v1/completions", json=body, headers=headers, timeout=300)
    elapsed = time.perf_counter() - started
    response.raise_for_status()
    return elapsed, response


def cached(response: httpx.Response) -> int:
    return int(response.json()["usage"]["prompt_tokens_details"]["cached_tokens"] or 0)


def pull_address(agent: AgentProcess) -> str:
    return str(httpx.get(f"{agent.url}/kvherd/v1/state").json()["pull_address"])


def crossover_rows(tokens: list[int], repeats: int) -> list[dict[str, Any]]:
    rows = []
    with agent_processes(2, *AGENT_FLAGS, kv_events=False) as (a, b):
        complete(a.url, prompt_of(0, 8)), complete(b.url, prompt_of(0, 8))  # warm up
        source = pull_address(a)
        for n in tokens:
            times: dict[str, list[float]] = {way: [] for way in WAYS}
            for r in range(repeats):
                prompt = prompt_of(n * 1000 + r, n + 1)  # n tokens of full blocks, one more
                complete(a.url, prompt)
                t_re, recomputed = complete(b.url, prompt, cache_salt=f"recompute-{n}-{r}")
                header = {"X-Kvherd-Pull": f"{source} blocks={n // BLOCK}"}
                t_pull, pulled = complete(b.url, prompt, header)
                t_hit, _ = complete(b.url, prompt)
                if cached(pulled) != n or cached(recomputed) != 0:
                    raise SystemExit(f"{n} tokens: pulled {cached(pulled)} of {n}")
                if pulled.json()["choices"][0]["text"] != recomputed.json()["choices"][0]["text"]:
                    raise SystemExit(f"{n} tokens: the pulled prefix changed the output")
                for way, seconds in zip(WAYS, (t_re, t_pull, t_hit), strict=True):
                    times[way].append(seconds * 1000)
            rows.append({"tokens": n, **{way: statistics.median(ms) for way, ms in times.items()}})
    return rows


def crossover(rows: list[dict[str, Any]]) -> int | None:
    """The shortest prefix from which pull beats recompute at every longer length."""
    best: int | None = None
    for row in reversed(rows):
        if row["pull"] >= row["recompute"]:
            break
        best = row["tokens"]
    return best


async def run_workload(url: str, args: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(7)
    weights = [1 / (k + 1) ** 1.1 for k in range(args.prefixes)]
    prefixes = [prompt_of(10_000 + k, args.prefix_tokens) for k in range(args.prefixes)]
    jobs = [
        prefixes[rng.choices(range(args.prefixes), weights)[0]] + prompt_of(20_000 + i, 8)
        for i in range(args.requests)
    ]
    ttft: list[float] = []
    hit = total = 0
    async with httpx.AsyncClient(timeout=300) as client:

        async def worker() -> None:
            nonlocal hit, total
            while jobs:
                prompt = jobs.pop()
                body = {"prompt": prompt, "max_tokens": 1, "temperature": 0.0}
                started = time.perf_counter()
                r = await client.post(f"{url}/v1/completions", json=body)
                ttft.append(time.perf_counter() - started)
                r.raise_for_status()
                usage = r.json()["usage"]
                hit += usage["prompt_tokens_details"]["cached_tokens"] or 0
                total += usage["prompt_tokens"]

        await asyncio.gather(*(worker() for _ in range(args.clients)))
    ttft.sort()
    return {
        "ttft_p50_ms": statistics.median(ttft) * 1000,
        "ttft_p90_ms": ttft[int(0.9 * (len(ttft) - 1))] * 1000,
        "hit_rate": hit / total,
    }


def working_set_rows(args: argparse.Namespace) -> list[dict[str, Any]]:
    blocks_per_prefix = args.prefix_tokens // BLOCK + 1
    gpu = blocks_per_prefix * args.pool_prefixes + 8
    cpu = blocks_per_prefix * args.prefixes + 8
    configs = {
        "GPU only": ((), ()),
        "+CPU tier": (("--num-cpu-blocks", str(cpu)), ()),
        "+CPU tier +pull": (
            ("--num-cpu-blocks", str(cpu)),
            ("--prefix-pull", "--pull-min-tokens", str(args.prefix_tokens // 2)),
        ),
    }
    rows = []
    for name, (agent_flags, serve_flags) in configs.items():
        flags = (*AGENT_FLAGS, "--num-gpu-blocks", str(gpu), *agent_flags)
        with (
            agent_processes(2, *flags) as agents,
            serve_process([a.instance_spec() for a in agents], *serve_flags) as served,
        ):
            row = asyncio.run(run_workload(served.url, args))
            with contextlib.suppress(httpx.HTTPError):
                metrics = httpx.get(f"{served.url}/metrics").text
                row["pulls"] = sum(
                    float(line.rsplit(" ", 1)[1])
                    for line in metrics.splitlines()
                    if line.startswith('kvherd_prefix_pulls_total{outcome="landed"}')
                )
        rows.append({"config": name, **row})
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", default="256,512,1024,2048", help="prefix lengths")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--prefixes", type=int, default=8)
    parser.add_argument("--prefix-tokens", type=int, default=512)
    parser.add_argument("--pool-prefixes", type=int, default=2)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args(argv)
    lengths = [int(n) for n in args.tokens.split(",")]
    if any(n % BLOCK for n in lengths):
        parser.error(f"--tokens: multiples of the block size ({BLOCK})")
    cross = crossover_rows(lengths, args.repeats)
    print(f"{'prefix':>12} {'recompute ms':>13} {'pull ms':>9} {'local hit ms':>13} {'pull/rec':>9}")
    for row in cross:
        print(
            f"{row['tokens']:>8} tok {row['recompute']:>13.1f} {row['pull']:>9.1f}"
            f" {row['local hit']:>13.1f} {row['pull'] / row['recompute']:>9.2f}"
        )
    at = crossover(cross)
    print(f"crossover: pull wins from {at} tokens on" if at else "crossover: none measured")
    rows = working_set_rows(args)
    print(
        f"\nworking set: {args.prefixes} prefixes of {args.prefix_tokens} tokens, GPU pools for "
        f"{args.pool_prefixes}, {args.requests} requests, {args.clients} clients"
    )
    print(f"{'config':>16} {'TTFT p50 ms':>12} {'TTFT p90 ms':>12} {'hit rate':>9} {'pulls':>6}")
    for row in rows:
        print(
            f"{row['config']:>16} {row['ttft_p50_ms']:>12.1f} {row['ttft_p90_ms']:>12.1f}"
            f" {row['hit_rate']:>9.1%} {row.get('pulls', 0):>6.0f}"
        )
    if args.json:
        Path(args.json).write_text(json.dumps({"crossover": cross, "working_set": rows}, indent=1))


if __name__ == "__main__":
    main()
