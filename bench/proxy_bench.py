"""Proxy overhead: kvherd vs nginx round-robin vs straight to the backend, from one run.

What it does: starts two `bench/fast_backend.py` servers (a trivial OpenAI-compatible backend, so
only the proxy's own cost shows), ``kvherd serve`` in front of both, and nginx (Debian package,
installed with apt-get when missing; a plain production round-robin with keep-alive upstreams) in
front of both, each as a child process on loopback. One load generator (HTTP/1.1 keep-alive, raw
asyncio) sends the same non-streamed ``/v1/completions`` requests to every target.

Added latency is a small difference of two noisy numbers on a shared machine, so it is measured in
many short rounds that interleave the targets (the order rotates each round) and each figure is
the median of per-round differences against the backend measured in that same round; the
interquartile range of those differences is printed next to it, so the noise is visible:
- sequential: per round, ``--round-requests`` requests one after another on one connection per
  target -> p50/p99 per round; "added" = target minus direct, same round;
- under load: per round, ``--load-rps`` requests/s arrive open-loop (Poisson, the same arrival
  times for every target in a round) over at most ``--load-connections`` connections for
  ``--load-seconds``; latency counts from the arrival, so queueing a target causes is charged to it.
  This is where proxies differ: a proxy's CPU per request turns into queueing delay under load;
- throughput: ``--concurrency`` connections in a closed loop for ``--duration`` s -> req/s
  (median over ``--throughput-rounds``);
- CPU per request of the target's own processes during the sequential rounds (from /proc): unlike
  latency, it barely moves when other work shares the machine.
Prints the tables side by side and checks the targets: kvherd adds <= 1 ms at p50, at most 3x what
nginx adds, and sustains >= 1,000 req/s.

Run: ``python bench/proxy_bench.py`` (``--policy round_robin`` to isolate forwarding from routing;
``--traced`` adds a second kvherd with ``--otlp-endpoint`` (every request traced, exported to a
fast backend taking ``/v1/traces``): tracing's cost beside the untraced one; ``--json FILE`` to keep
the figures, per round included). Every child process is stopped on exit.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
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


Connection = tuple[asyncio.StreamReader, asyncio.StreamWriter]


@dataclass
class Target:
    name: str
    port: int
    pid: int
    payload: bytes = b""
    conn: Connection | None = None  # the sequential phase's connection, kept across rounds
    pool: list[Connection] = field(default_factory=list)  # the load phase's connections


async def connect(target: Target, warmup: int) -> Connection:
    conn = await asyncio.open_connection("127.0.0.1", target.port)
    for _ in range(warmup):
        await _one(*conn, target.payload)
    return conn


async def sequential_round(target: Target, n: int) -> list[float]:
    """Latencies of `n` requests sent one after another on the target's connection."""
    assert target.conn is not None
    reader, writer = target.conn
    payload = target.payload
    clock = time.perf_counter
    samples = []
    for _ in range(n):
        t0 = clock()
        await _one(reader, writer, payload)
        samples.append(clock() - t0)
    return samples


def arrival_times(rate: float, seconds: float, seed: int) -> list[float]:
    """Poisson arrival offsets (seconds from the round's start); the same for every target."""
    rng = random.Random(seed)
    times, t = [], rng.expovariate(rate)
    while t < seconds:
        times.append(t)
        t += rng.expovariate(rate)
    return times


async def load_round(target: Target, arrivals: list[float]) -> list[float]:
    """Latencies of open-loop arrivals over the target's connection pool (a request waits for a
    free connection: that wait is the target's queueing and counts in its latency)."""
    free: asyncio.Queue[Connection] = asyncio.Queue()
    for conn in target.pool:
        free.put_nowait(conn)
    samples: list[float] = []
    clock = time.perf_counter

    async def request() -> None:
        t0 = clock()
        conn = await free.get()
        try:
            await _one(*conn, target.payload)
        finally:
            free.put_nowait(conn)
        samples.append(clock() - t0)

    tasks = []
    start = clock()
    for at in arrivals:
        delay = start + at - clock()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(request()))
    await asyncio.gather(*tasks)
    return samples


async def measure_throughput(target: Target, connections: int, duration: float) -> float:
    done = 0
    stop_at = 0.0

    async def worker() -> None:
        nonlocal done
        reader, writer = await connect(target, warmup=20)  # warms the target's pools too
        try:
            await started.wait()
            while time.perf_counter() < stop_at:
                await _one(reader, writer, target.payload)
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


def quantile(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


@dataclass
class Rounds:
    """Per-round p50/p99 (ms) of one target in one phase."""

    p50: list[float] = field(default_factory=list)
    p99: list[float] = field(default_factory=list)

    def add(self, samples: list[float]) -> None:
        self.p50.append(quantile(samples, 0.5) * 1e3)
        self.p99.append(quantile(samples, 0.99) * 1e3)


@dataclass
class Added:
    """Median and interquartile range of per-round differences against direct (ms)."""

    p50: float
    p50_q1: float
    p50_q3: float
    p99: float

    @staticmethod
    def of(target: Rounds, direct: Rounds) -> Added:
        d50 = sorted(t - d for t, d in zip(target.p50, direct.p50, strict=True))
        d99 = [t - d for t, d in zip(target.p99, direct.p99, strict=True)]
        return Added(
            statistics.median(d50), quantile(d50, 0.25), quantile(d50, 0.75), statistics.median(d99)
        )


@dataclass
class Result:
    target: str
    seq: Rounds
    load: Rounds
    rps: list[float]
    cpu_us: float  # CPU the target's own processes spent per request (sequential phase)
    seq_added: Added | None = None
    load_added: Added | None = None


async def run_rounds(targets: list[Target], args: argparse.Namespace) -> list[Result]:
    results = [Result(t.name, Rounds(), Rounds(), [], 0.0) for t in targets]
    for target in targets:
        target.conn = await connect(target, warmup=300)
        target.pool = [await connect(target, warmup=5) for _ in range(args.load_connections)]
    order = list(range(len(targets)))
    # Sequential rounds; the order of targets rotates so none always runs after another.
    cpu = [0.0] * len(targets)
    for r in range(args.rounds):
        for i in order[r % len(order) :] + order[: r % len(order)]:
            before = tree_cpu_seconds(targets[i].pid)
            samples = await sequential_round(targets[i], args.round_requests)
            cpu[i] += tree_cpu_seconds(targets[i].pid) - before
            results[i].seq.add(samples)
    for i, result in enumerate(results):
        result.cpu_us = cpu[i] / (args.rounds * args.round_requests) * 1e6
    for r in range(args.load_rounds):
        arrivals = arrival_times(args.load_rps, args.load_seconds, seed=r)
        for i in order[r % len(order) :] + order[: r % len(order)]:
            results[i].load.add(await load_round(targets[i], arrivals))
    for target in targets:
        for _, writer in [target.conn, *target.pool] if target.conn else target.pool:
            writer.close()
    for r in range(args.throughput_rounds):
        for i in order[r % len(order) :] + order[: r % len(order)]:
            results[i].rps.append(
                await measure_throughput(targets[i], args.concurrency, args.duration)
            )
    direct = results[0]
    for result in results[1:]:
        result.seq_added = Added.of(result.seq, direct.seq)
        result.load_added = Added.of(result.load, direct.load)
    return results


def ratio(kv: float, ng: float) -> str:
    return f"{kv / ng:.1f}x" if ng > 0 else f"n/a (nginx adds {ng * 1e3:+.0f} us)"


def report(results: list[Result], args: argparse.Namespace) -> dict[str, bool]:
    print(
        f"\nproxy overhead, non-streamed /v1/completions, {os.cpu_count()} cores, "
        f"kvherd policy {args.policy!r}; added = median of per-round differences vs direct "
        "[IQR of those differences]"
    )
    print(
        f"\nsequential, one connection: {args.rounds} rounds x {args.round_requests} requests"
        f"\n{'target':<8} {'p50 ms':>8} {'p99 ms':>8} {'+p50 ms':>8} {'[IQR]':>17} "
        f"{'+p99 ms':>8} {'CPU us/req':>10}"
    )
    for r in results:
        a = r.seq_added
        iqr = f"[{a.p50_q1:+.3f}, {a.p50_q3:+.3f}]" if a else ""
        print(
            f"{r.target:<8} {statistics.median(r.seq.p50):8.3f} {statistics.median(r.seq.p99):8.3f}"
            f" {a.p50 if a else 0:+8.3f} {iqr:>17} {a.p99 if a else 0:+8.3f} {r.cpu_us:10.1f}"
        )
    print(
        f"\nunder load: {args.load_rps:.0f} req/s open loop over <= {args.load_connections} "
        f"connections, {args.load_rounds} rounds x {args.load_seconds:.1f} s"
        f"\n{'target':<8} {'p50 ms':>8} {'p99 ms':>8} {'+p50 ms':>8} {'[IQR]':>17} {'+p99 ms':>8}"
    )
    for r in results:
        a = r.load_added
        iqr = f"[{a.p50_q1:+.3f}, {a.p50_q3:+.3f}]" if a else ""
        print(
            f"{r.target:<8} {statistics.median(r.load.p50):8.3f} "
            f"{statistics.median(r.load.p99):8.3f} {a.p50 if a else 0:+8.3f} {iqr:>17} "
            f"{a.p99 if a else 0:+8.3f}"
        )
    print(
        f"\nthroughput: {args.concurrency} connections, closed loop, median of "
        f"{args.throughput_rounds} x {args.duration:.1f} s"
    )
    for r in results:
        print(f"{r.target:<8} {statistics.median(r.rps):8.0f} req/s")
    print("(CPU us/req: the target's own processes; for direct, the backend's)")
    by_name = {r.target: r for r in results}
    kv = by_name["kvherd"]
    assert kv.seq_added is not None and kv.load_added is not None
    checks = {
        "kvherd adds <= 1 ms at p50": kv.seq_added.p50 <= 1.0,
        "kvherd sustains >= 1000 req/s": statistics.median(kv.rps) >= 1000,
    }
    ng = by_name.get("nginx")
    if ng is not None and ng.seq_added is not None and ng.load_added is not None:
        print(
            f"kvherd/nginx: added p50 sequential {ratio(kv.seq_added.p50, ng.seq_added.p50)}, "
            f"under load {ratio(kv.load_added.p50, ng.load_added.p50)}; "
            f"req/s {statistics.median(kv.rps) / statistics.median(ng.rps):.2f}x; "
            f"CPU per request {kv.cpu_us / ng.cpu_us:.1f}x"
        )
        for phase, kv_added, ng_added in (
            ("sequential", kv.seq_added.p50, ng.seq_added.p50),
            ("under load", kv.load_added.p50, ng.load_added.p50),
        ):
            checks[f"kvherd adds <= 3x nginx at p50 ({phase})"] = kv_added <= 3 * max(ng_added, 0)
    traced = by_name.get("traced")
    if traced is not None and traced.seq_added is not None and traced.load_added is not None:
        print(
            f"tracing on/off: added p50 sequential {traced.seq_added.p50 - kv.seq_added.p50:+.3f} "
            f"ms, under load {traced.load_added.p50 - kv.load_added.p50:+.3f} ms; CPU per "
            f"request {traced.cpu_us / kv.cpu_us:.2f}x; req/s "
            f"{statistics.median(traced.rps) / statistics.median(kv.rps):.2f}x"
        )
    for name, ok in checks.items():
        print(f"  [{'ok' if ok else 'MISS'}] {name}")
    return checks


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--policy", default="kvherd", help="kvherd's dispatch policy")
    parser.add_argument("--rounds", type=int, default=20, help="sequential rounds")
    parser.add_argument("--round-requests", type=int, default=400)
    parser.add_argument("--load-rounds", type=int, default=8)
    parser.add_argument("--load-rps", type=float, default=500.0)
    parser.add_argument("--load-connections", type=int, default=16)
    parser.add_argument("--load-seconds", type=float, default=1.0)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--duration", type=float, default=3.0)
    parser.add_argument("--throughput-rounds", type=int, default=3)
    parser.add_argument("--json", default=None, help="also write the figures here")
    parser.add_argument("--no-nginx", action="store_true")
    parser.add_argument("--traced", action="store_true", help="also kvherd with tracing on")
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
            # The fast backends are not kvherd agents and have no tokenizer of their own: route
            # by byte tokens (kvherd serve refuses to guess in front of such a fleet).
            "--tokenizer",
            "byte",
        ]
        for port in backends:
            cmd += ["--instance", f"http://127.0.0.1:{port}"]
        cmd += args.kvherd_arg
        env = {**os.environ, "KVHERD_ADMIN_TOKEN": "bench"}
        procs.append(subprocess.Popen(cmd, env=env, cwd=ROOT))
        wait_port(proxy_port, procs[-1])
        targets = [
            Target("direct", backends[0], procs[0].pid),
            Target("kvherd", proxy_port, procs[-1].pid),
        ]
        if args.traced:
            sink = free_port()  # the span exporter's collector: another fast backend
            procs.append(
                subprocess.Popen(
                    [sys.executable, str(ROOT / "bench" / "fast_backend.py"), "--port", str(sink)],
                    stdout=subprocess.DEVNULL,
                )
            )
            wait_port(sink, procs[-1])
            traced_port, traced_admin = free_port(), free_port()
            traced = [*cmd, "--otlp-endpoint", f"http://127.0.0.1:{sink}"]
            traced[traced.index(str(proxy_port))] = str(traced_port)
            traced[traced.index(str(admin_port))] = str(traced_admin)
            procs.append(subprocess.Popen(traced, env=env, cwd=ROOT))
            wait_port(traced_port, procs[-1])
            targets.append(Target("traced", traced_port, procs[-1].pid))
        if not args.no_nginx:
            nginx_port = free_port()
            conf = nginx_config(tmp, nginx_port, backends)
            procs.append(subprocess.Popen([ensure_nginx(), "-c", conf, "-p", tmp]))
            wait_port(nginx_port, procs[-1])
            targets.append(Target("nginx", nginx_port, procs[-1].pid))
        body = json.dumps({"prompt": PROMPT, "max_tokens": 1}).encode()
        for target in targets:
            target.payload = request_bytes(target.port, body)
        results = asyncio.run(run_rounds(targets, args))

    checks = report(results, args)
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"results": [asdict(r) for r in results], "checks": checks}, handle, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
