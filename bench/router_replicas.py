"""Router replicas in front of one fleet: one router against 2 and 3 replicas, with and without
``--peer`` (the replicas reading each other's in-flight charges).

What it does, per round and configuration, with two real ``kvherd agent`` processes (``--model
small``, one torch thread each) and real ``kvherd serve`` replicas (``kvherd`` policy, each
started afresh per configuration): ``--clients`` closed-loop clients, client ``i`` talking to
replica ``i mod N``, send ``--requests`` streamed greedy requests in all: a prefix drawn
Zipf(1.1) from ``--prefixes`` shared prefixes of ``--prefix-tokens`` tokens, an 8-token suffix
of its own, ``--max-tokens`` tokens out; each replica reads the agents' load every
``--load-interval`` seconds. Reports TTFT p50/p99, the prefix-cache hit rate
(``cached_tokens`` over prompt tokens) and the share of requests the busier agent took.

Run: ``python bench/router_replicas.py`` (``--json FILE`` keeps the figures). The machine is
shared: compare the rows of one run.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import statistics
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "support"))
from agent_process import agent_processes, free_port  # noqa: E402
from serve_process import Served, serve_process  # noqa: E402

BLOCK = 16
AGENT_FLAGS = ("--model", "small", "--block-size", str(BLOCK), "--torch-threads", "1")
CONFIGS = (("1 router", 1, False), ("2 replicas", 2, False), ("2 replicas --peer", 2, True),
           ("3 replicas", 3, False), ("3 replicas --peer", 3, True))  # fmt: skip


def tokens_of(seed: int, count: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 250) for _ in range(count)]


def zipf_choice(rng: random.Random, n: int, s: float = 1.1) -> int:
    weights = [1.0 / (k + 1) ** s for k in range(n)]
    return rng.choices(range(n), weights)[0]


def one_request(client: httpx.Client, base: str, prompt: list[int], max_tokens: int) -> dict[str, Any]:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    started = time.perf_counter()
    ttft = None
    cached = prompt_tokens = 0
    with client.stream("POST", f"{base}/v1/completions", json=body) as response:
        response.raise_for_status()
        instance = response.headers.get("x-kvherd-instance", "")
        for line in response.iter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            if ttft is None and event.get("choices"):
                ttft = time.perf_counter() - started
            usage = event.get("usage")
            if usage:
                prompt_tokens = usage["prompt_tokens"]
                cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return {"ttft": ttft or 0.0, "instance": instance, "cached": cached, "prompt": prompt_tokens}


def run_config(replicas: int, peers: bool, args: argparse.Namespace, seed: int) -> dict[str, Any]:
    prefixes = [tokens_of(seed + i, args.prefix_tokens) for i in range(args.prefixes)]
    with agent_processes(2, *AGENT_FLAGS) as agents, contextlib.ExitStack() as stack:
        specs = [agent.instance_spec() for agent in agents]
        ports = [(free_port(), free_port()) for _ in range(replicas)]
        served: list[Served] = []
        for n, own in enumerate(ports):
            flags = ["--policy", "kvherd", "--expose-instance", "--load-interval", args.load_interval]
            if peers:
                for m, other in enumerate(ports):
                    if m != n:
                        flags += ["--peer", f"http://127.0.0.1:{other[1]}"]
            served.append(stack.enter_context(serve_process(specs, *flags, ports=own)))
        with httpx.Client(timeout=300) as warm:  # each agent compiles its first forward
            for agent in agents:
                warm.post(f"{agent.url}/v1/completions", json={"prompt": [5], "max_tokens": 1})
        rng = random.Random(seed)
        work = [
            prefixes[zipf_choice(rng, len(prefixes))] + tokens_of(seed * 7 + r, 8)
            for r in range(args.requests)
        ]
        results: list[dict[str, Any]] = []
        lock = threading.Lock()

        def client_loop(index: int) -> None:
            base = served[index % replicas].url
            with httpx.Client(timeout=300) as client:
                while True:
                    with lock:
                        if not work:
                            return
                        prompt = work.pop()
                    result = one_request(client, base, prompt, args.max_tokens)
                    with lock:
                        results.append(result)

        threads = [threading.Thread(target=client_loop, args=(i,)) for i in range(args.clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    ttfts = sorted(r["ttft"] for r in results)
    per_instance = Counter(r["instance"] for r in results)
    return {
        "ttft_p50_ms": 1000 * statistics.median(ttfts),
        "ttft_p99_ms": 1000 * ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))],
        "hit_rate": sum(r["cached"] for r in results) / max(1, sum(r["prompt"] for r in results)),
        "busier_share": max(per_instance.values()) / len(results),
        "requests": len(results),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prefixes", type=int, default=12)
    parser.add_argument("--prefix-tokens", type=int, default=256)
    parser.add_argument("--requests", type=int, default=120)
    parser.add_argument("--clients", type=int, default=6)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--load-interval", default="0.1", help="each replica's --load-interval")
    parser.add_argument("--configs", default=",".join(c[0] for c in CONFIGS))
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    chosen = [c for c in CONFIGS if c[0] in args.configs.split(",")]
    rows = []
    for r in range(args.rounds):
        for name, replicas, peers in chosen:
            row = {"round": r + 1, "config": name, **run_config(replicas, peers, args, 100 * r)}
            rows.append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)
    print("| round | config | TTFT p50 ms | TTFT p99 ms | hit rate | busier agent's share |")
    print("|---|---|---:|---:|---:|---:|")
    for row in rows:
        print(f"| {row['round']} | {row['config']} | {row['ttft_p50_ms']:.0f} | "
              f"{row['ttft_p99_ms']:.0f} | {row['hit_rate']:.2f} | {row['busier_share']:.2f} |")  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
