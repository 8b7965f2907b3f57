"""Proxy overhead: kvherd vs nginx round-robin vs straight to the backend, from one run.

What it does: starts two `bench/fast_backend.py` servers (a trivial OpenAI-compatible backend, so
only the proxy's own cost shows), ``kvherd serve`` in front of both, and nginx (Debian package,
installed with apt-get when missing) round-robin in front of both, each as a child process on
loopback. One load generator (HTTP/1.1 keep-alive, raw asyncio) then measures, for each target in
turn and with the same requests:
- latency: ``--latency-requests`` sequential non-streamed ``/v1/completions`` requests on one
  connection -> p50/p99; "added" is the target's p50/p99 minus the backend's;
- throughput: ``--concurrency`` connections in a closed loop for ``--duration`` seconds -> req/s;
- CPU per request of the target's own processes (from /proc, during the latency phase): unlike
  latency, it barely moves when other work shares the machine.
Prints one table, kvherd and the baselines side by side, and checks the targets: kvherd adds
<= 1 ms at p50, at most 3x what nginx adds, and sustains >= 1,000 req/s.

Run: ``python bench/proxy_bench.py`` (``--policy round_robin`` to isolate forwarding from routing;
``--json FILE`` to keep the figures). Every child process is stopped on exit.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROMPT = "You are a helpful assistant. Answer briefly. " * 8


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def request_bytes(port: int, body: bytes) -> bytes:
    return (
        b"POST /v1/completions HTTP/1.1\r\nhost: 127.0.0.1:%d\r\n"
        b"content-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
    ) % (port, len(body), body)


async def _one(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, payload: bytes) -> None:
    writer.write(payload)
    head = await reader.readuntil(b"\r\n\r\n")
    if not head.startswith(b"HTTP/1.1 200"):
        raise RuntimeError(f"unexpected response: {head[:200]!r}")
    lowered = head.lower()
    start = lowered.find(b"content-length:")
    if start < 0:
        raise RuntimeError("response without content-length")
    length = int(lowered[start + 15 : lowered.find(b"\r\n", start)])
    await reader.readexactly(length)


async def measure_latency(port: int, payload: bytes, n: int, warmup: int) -> list[float]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        for _ in range(warmup):
            await _one(reader, writer, payload)
        samples = []
        clock = time.perf_counter
        for _ in range(n):
            t0 = clock()
            await _one(reader, writer, payload)
            samples.append(clock() - t0)
        return samples
    finally:
        writer.close()


async def measure_throughput(port: int, payload: bytes, connections: int, duration: float) -> float:
    done = 0
    stop_at = 0.0

    async def worker() -> None:
        nonlocal done
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            for _ in range(20):  # warm the connection and the target's pools
                await _one(reader, writer, payload)
            await started.wait()
            while time.perf_counter() < stop_at:
                await _one(reader, writer, payload)
                done += 1
        finally:
            writer.close()

    started = asyncio.Event()
    tasks = [asyncio.create_task(worker()) for _ in range(connections)]
    await asyncio.sleep(0.5)
    t0 = time.perf_counter()
    stop_at = t0 + duration
    started.set()
    await asyncio.gather(*tasks)
    return done / (time.perf_counter() - t0)


@dataclass
class Result:
    target: str
    p50_ms: float
    p99_ms: float
    rps: float
    cpu_us: float  # CPU the target's own processes spent per request (latency phase)
    added_p50_ms: float = 0.0
    added_p99_ms: float = 0.0


def tree_cpu_seconds(pid: int) -> float:
    """User + system CPU of `pid` and its direct children (nginx's workers), from /proc."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0.0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as handle:
                fields = handle.read().rsplit(")", 1)[1].split()
        except OSError:
            continue  # exited meanwhile
        if int(entry) == pid or int(fields[1]) == pid:
            total += (int(fields[11]) + int(fields[12])) / tick
    return total


def _quantile(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def wait_port(port: int, proc: subprocess.Popen[bytes], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args!r} exited with {proc.returncode}")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.2):
            return
        time.sleep(0.05)  # the child is still binding its port
    raise TimeoutError(f"port {port} not open after {timeout}s")


@contextlib.contextmanager
def children() -> Iterator[list[subprocess.Popen[bytes]]]:
    procs: list[subprocess.Popen[bytes]] = []
    try:
        yield procs
    finally:
        for proc in reversed(procs):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in reversed(procs):
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def ensure_nginx() -> str:
    found = shutil.which("nginx") or (
        "/usr/sbin/nginx" if os.path.exists("/usr/sbin/nginx") else None
    )
    if found:
        return found
    print("nginx not found: installing the Debian package", flush=True)
    subprocess.run(["apt-get", "install", "-y", "nginx"], check=True, capture_output=True)
    return shutil.which("nginx") or "/usr/sbin/nginx"


def nginx_config(tmp: str, port: int, backends: list[int]) -> str:
    servers = "".join(f"    server 127.0.0.1:{p};\n" for p in backends)
    conf = f"""
worker_processes 1;
daemon off;
pid {tmp}/nginx.pid;
error_log {tmp}/error.log warn;
events {{ worker_connections 4096; }}
http {{
  access_log off;
  client_body_temp_path {tmp}/body;
  proxy_temp_path {tmp}/proxy;
  fastcgi_temp_path {tmp}/fastcgi;
  uwsgi_temp_path {tmp}/uwsgi;
  scgi_temp_path {tmp}/scgi;
  upstream backends {{
{servers}    keepalive 256;
    keepalive_requests 1000000;
  }}
  server {{
    listen 127.0.0.1:{port};
    keepalive_requests 1000000;
    location / {{
      proxy_pass http://backends;
      proxy_http_version 1.1;
      proxy_set_header Connection "";
      proxy_buffering off;
    }}
  }}
}}
"""
    path = os.path.join(tmp, "nginx.conf")
    with open(path, "w") as handle:
        handle.write(conf)
    return path


async def bench_target(name: str, port: int, pid: int, args: argparse.Namespace) -> Result:
    payload = request_bytes(port, json.dumps({"prompt": PROMPT, "max_tokens": 1}).encode())
    cpu_before = tree_cpu_seconds(pid)
    samples = await measure_latency(port, payload, args.latency_requests, warmup=200)
    cpu_us = (tree_cpu_seconds(pid) - cpu_before) / (args.latency_requests + 200) * 1e6
    rps = await measure_throughput(port, payload, args.concurrency, args.duration)
    p50, p99 = _quantile(samples, 0.5) * 1e3, _quantile(samples, 0.99) * 1e3
    return Result(name, p50, p99, rps, cpu_us)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--policy", default="kvherd", help="kvherd's dispatch policy")
    parser.add_argument("--latency-requests", type=int, default=3000)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--duration", type=float, default=5.0)
    parser.add_argument("--rounds", type=int, default=3, help="figures are medians over rounds")
    parser.add_argument("--json", default=None, help="also write the figures here")
    parser.add_argument("--no-nginx", action="store_true")
    parser.add_argument(
        "--kvherd-arg", action="append", default=[], help="extra kvherd serve flag; repeatable"
    )
    args = parser.parse_args()
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass

    with children() as procs, tempfile.TemporaryDirectory(prefix="kvherd-bench-") as tmp:
        backends = [free_port(), free_port()]
        for port in backends:
            procs.append(
                subprocess.Popen(
                    [sys.executable, str(ROOT / "bench" / "fast_backend.py"), "--port", str(port)],
                    stdout=subprocess.DEVNULL,
                )
            )
            wait_port(port, procs[-1])
        proxy_port, admin_port = free_port(), free_port()
        cmd = [
            sys.executable,
            "-m",
            "kvherd",
            "serve",
            "--port",
            str(proxy_port),
            "--admin-port",
            str(admin_port),
            "--policy",
            args.policy,
            "--log-level",
            "warning",
        ]
        for port in backends:
            cmd += ["--instance", f"http://127.0.0.1:{port}"]
        cmd += args.kvherd_arg
        env = {**os.environ, "KVHERD_ADMIN_TOKEN": "bench"}
        procs.append(subprocess.Popen(cmd, env=env, cwd=ROOT))
        wait_port(proxy_port, procs[-1])
        targets = [("direct", backends[0], procs[0].pid), ("kvherd", proxy_port, procs[-1].pid)]
        if not args.no_nginx:
            nginx_port = free_port()
            conf = nginx_config(tmp, nginx_port, backends)
            procs.append(subprocess.Popen([ensure_nginx(), "-c", conf, "-p", tmp]))
            wait_port(nginx_port, procs[-1])
            targets.append(("nginx", nginx_port, procs[-1].pid))

        async def run_all() -> list[Result]:
            # Rounds interleave the targets so a noisy neighbour hurts all of them alike;
            # each figure is the median over the rounds.
            rounds = [
                [await bench_target(name, port, pid, args) for name, port, pid in targets]
                for _ in range(args.rounds)
            ]
            return [
                Result(
                    name,
                    statistics.median(r[i].p50_ms for r in rounds),
                    statistics.median(r[i].p99_ms for r in rounds),
                    statistics.median(r[i].rps for r in rounds),
                    statistics.median(r[i].cpu_us for r in rounds),
                )
                for i, (name, _, _) in enumerate(targets)
            ]

        results = asyncio.run(run_all())

    direct = results[0]
    for result in results[1:]:
        result.added_p50_ms = result.p50_ms - direct.p50_ms
        result.added_p99_ms = result.p99_ms - direct.p99_ms
    by_name = {r.target: r for r in results}
    print(
        f"\nproxy overhead, non-streamed /v1/completions, {os.cpu_count()} cores, "
        f"kvherd policy {args.policy!r}, medians of {args.rounds} rounds"
    )
    print(
        f"{'target':<8} {'p50 ms':>8} {'p99 ms':>8} {'+p50 ms':>8} {'+p99 ms':>8} {'req/s':>8} "
        f"{'CPU us/req':>10}"
    )
    for r in results:
        print(
            f"{r.target:<8} {r.p50_ms:8.3f} {r.p99_ms:8.3f} {r.added_p50_ms:8.3f} "
            f"{r.added_p99_ms:8.3f} {r.rps:8.0f} {r.cpu_us:10.1f}"
        )
    print("(CPU us/req: the target's own processes; for direct, the backend's)")
    kv = by_name["kvherd"]
    checks = {
        "kvherd adds <= 1 ms at p50": kv.added_p50_ms <= 1.0,
        "kvherd sustains >= 1000 req/s": kv.rps >= 1000,
    }
    if "nginx" in by_name:
        ng = by_name["nginx"]
        ratio = kv.added_p50_ms / ng.added_p50_ms if ng.added_p50_ms > 0 else float("inf")
        print(
            f"kvherd/nginx: added p50 {ratio:.2f}x, req/s {kv.rps / ng.rps:.2f}x, "
            f"CPU per request {kv.cpu_us / ng.cpu_us:.2f}x"
        )
        checks["kvherd adds <= 3x nginx at p50"] = ratio <= 3.0
    for name, ok in checks.items():
        print(f"  [{'ok' if ok else 'MISS'}] {name}")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"results": [asdict(r) for r in results], "checks": checks}, handle, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
