"""What a refusal costs the proxy, next to what a forwarded request costs, from one run.

Two ``kvherd serve`` processes, each in front of two `bench/fast_backend.py` servers (no model
work: only the proxy's own cost shows):
- "forwarded": backends that report nothing queued; every request is routed, forwarded, relayed;
- "refused": backends whose ``/metrics`` say 1,000 requests wait (``--queued``), behind a proxy
  allowed 1 ms of queue wait; once its load poll has seen the queue and a few admitted requests
  have measured the rate, every request is refused by expected wait (429, ``queue_wait``).
The same load generator (HTTP/1.1 keep-alive, raw asyncio) sends `--requests` requests to each in
interleaved rounds, over `--connections` connections. Printed per kind, as medians over the rounds:
the proxy's CPU per request (user + system, from /proc: robust to other load on the machine),
its latency p50/p99, and the refusal's CPU as a share of a forwarded request's. Target: a refusal
costs a small fraction of a forwarded request (<= 0.5x) and is answered in milliseconds.

    python bench/refusal_cost.py [--requests 2000] [--rounds 5] [--connections 8]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from proxy_bench import children, free_port, request_bytes, tree_cpu_seconds, wait_port

ROOT = Path(__file__).resolve().parent.parent
BODY = json.dumps({"prompt": "You are a helpful assistant. " * 8, "max_tokens": 1}).encode()


async def _post(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, payload: bytes) -> int:
    writer.write(payload)
    head = await reader.readuntil(b"\r\n\r\n")
    lowered = head.lower()
    start = lowered.find(b"content-length:")
    length = int(lowered[start + 15 : lowered.find(b"\r\n", start)])
    await reader.readexactly(length)
    return int(head[9:12])


async def load(port: int, requests: int, connections: int) -> tuple[list[float], dict[int, int]]:
    payload = request_bytes(port, BODY)
    latencies: list[float] = []
    statuses: dict[int, int] = {}
    left = requests

    async def worker() -> None:
        nonlocal left
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        while left > 0:
            left -= 1
            start = time.perf_counter()
            status = await _post(reader, writer, payload)
            latencies.append(time.perf_counter() - start)
            statuses[status] = statuses.get(status, 0) + 1
            if status == 429:  # the proxy closes nothing on a 429: keep the connection
                continue
        writer.close()

    await asyncio.gather(*(worker() for _ in range(connections)))
    return latencies, statuses


def start_fleet(procs: list[subprocess.Popen[bytes]], queued: int | None) -> tuple[int, int]:
    backends = []
    for _ in range(2):
        port = free_port()
        cmd = [sys.executable, str(ROOT / "bench" / "fast_backend.py"), "--port", str(port)]
        if queued is not None:
            cmd += ["--queued", str(queued)]
        procs.append(subprocess.Popen(cmd, stdout=subprocess.DEVNULL))
        wait_port(port, procs[-1])
        backends.append(port)
    port, admin = free_port(), free_port()
    cmd = [sys.executable, "-m", "kvherd", "serve", "--port", str(port), "--admin-port", str(admin)]
    cmd += ["--log-level", "warning", "--tokenizer", "byte", "--load-interval", "0.1"]
    if queued is not None:
        cmd += ["--max-queue-wait", "0.001", "--standing-queue-wait", "0.001"]
    for backend in backends:
        cmd += ["--instance", f"http://127.0.0.1:{backend}"]
    env = {**os.environ, "KVHERD_ADMIN_TOKEN": "bench"}
    procs.append(subprocess.Popen(cmd, env=env, cwd=ROOT))
    wait_port(port, procs[-1])
    return port, procs[-1].pid


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--connections", type=int, default=8)
    args = parser.parse_args()
    with children() as procs:
        fleets = {"forwarded": start_fleet(procs, None), "refused": start_fleet(procs, 1000)}
        for port, _ in fleets.values():  # warm up; the refusing proxy learns its queue and rate
            await load(port, 200, args.connections)
        await asyncio.sleep(0.5)
        for port, _ in fleets.values():
            await load(port, 200, args.connections)
        figures: dict[str, dict[str, list[float]]] = {k: {} for k in fleets}
        for _ in range(args.rounds):
            for kind, (port, pid) in fleets.items():
                cpu = tree_cpu_seconds(pid)
                latencies, statuses = await load(port, args.requests, args.connections)
                used = tree_cpu_seconds(pid) - cpu
                expected = 200 if kind == "forwarded" else 429
                if statuses.get(expected, 0) != args.requests:
                    raise RuntimeError(f"{kind}: expected only {expected}s, got {statuses}")
                latencies.sort()
                row = figures[kind]
                row.setdefault("cpu_us", []).append(used / args.requests * 1e6)
                row.setdefault("p50_ms", []).append(latencies[len(latencies) // 2] * 1000)
                row.setdefault("p99_ms", []).append(latencies[int(len(latencies) * 0.99)] * 1000)
    med = {k: {f: statistics.median(v) for f, v in row.items()} for k, row in figures.items()}
    print("| kind | proxy CPU per request (us) | latency p50 (ms) | latency p99 (ms) |")
    print("|---|---:|---:|---:|")
    for kind, stats in med.items():
        print(
            f"| {kind} | {stats['cpu_us']:.0f} | {stats['p50_ms']:.2f} | {stats['p99_ms']:.2f} |"
        )
    ratio = med["refused"]["cpu_us"] / med["forwarded"]["cpu_us"]
    print(f"\na refusal costs {ratio:.2f}x a forwarded request's proxy CPU (target <= 0.5x)")


if __name__ == "__main__":
    asyncio.run(main())
