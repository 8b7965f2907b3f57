"""Proxy overhead: kvherd vs the Rust LLM routers vs nginx vs straight to the backend, one run.

What it does: starts two `bench/fast_backend.py` servers (a trivial OpenAI-compatible backend, so
only the proxy's own cost shows) and, in front of both, each as a child process on loopback, the
targets of `TARGETS`: ``kvherd serve``; nginx (Debian package, installed with apt-get when
missing; a plain production round-robin with keep-alive upstreams); sglang-router and vllm-router,
each with its ``cache_aware`` policy (the prefix-aware routing kvherd's is compared with; their
Python packages start the Rust routers in-process) from the venv python that ``--sglang-router`` /
``--vllm-router`` name (default: env KVHERD_SGLANG_ROUTER / KVHERD_VLLM_ROUTER; a router whose
python is not given is skipped, and the run says so). vllm-router's cache_aware asks the backend
to render every prompt (``/v1/completions/render``) before forwarding it: that round trip is part
of what it adds. Every router logs at warning level, as kvherd does here. One load generator
(HTTP/1.1 keep-alive, raw asyncio) sends the same non-streamed ``/v1/completions`` requests (model
``tiny``, the backends' one model) to every target.

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
Prints one table and checks the targets: kvherd adds <= 1 ms at p50, at most 3x what nginx adds,
sustains >= 1,000 req/s, and adds no more than sglang-router on each of the three added-latency
figures (sequential p50 and p99, p50 under load; issue 27), with the ratios kvherd/sglang-router.

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
from collections.abc import Callable, Iterator
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
        for proc in reversed(procs):  # one at a time: a proxy's helper outlives the proxy
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
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


def ratio(kv: float, base: float) -> str:
    return f"{kv / base:.2f}x" if base > 0 else f"n/a ({base * 1e3:+.0f} us)"


def figures(r: Result) -> dict[str, float]:
    """The figures compared between targets: three added latencies (ms), req/s, CPU us/request."""
    assert r.seq_added is not None and r.load_added is not None
    return {
        "added p50 sequential": r.seq_added.p50,
        "added p99 sequential": r.seq_added.p99,
        "added p50 under load": r.load_added.p50,
        "req/s": statistics.median(r.rps),
        "CPU us/request": r.cpu_us,
    }


LATENCIES = ("added p50 sequential", "added p99 sequential", "added p50 under load")


def report(results: list[Result], args: argparse.Namespace) -> dict[str, bool]:
    print(
        f"\nproxy overhead, non-streamed /v1/completions, {os.cpu_count()} cores, load average "
        f"{os.getloadavg()[0]:.2f} at the end, kvherd policy {args.policy!r}; added = median of "
        "per-round differences vs direct [IQR of those differences]"
    )
    print(
        f"sequential, one connection: {args.rounds} rounds x {args.round_requests} requests; "
        f"under load: {args.load_rps:.0f} req/s open loop over <= {args.load_connections} "
        f"connections, {args.load_rounds} rounds x {args.load_seconds:.1f} s; throughput: "
        f"{args.concurrency} connections, closed loop, median of {args.throughput_rounds} x "
        f"{args.duration:.1f} s; CPU: the target's own processes (direct: the backend's)\n"
    )
    print(
        f"{'target':<14} {'seq p50':>8} {'+p50 ms':>8} {'[IQR]':>17} {'+p99 ms':>8} "
        f"{'load p50':>8} {'+p50 ms':>8} {'[IQR]':>17} {'+p99 ms':>8} {'req/s':>8} {'CPU us':>7}"
    )
    for r in results:
        seq, load = r.seq_added, r.load_added
        seq_iqr = f"[{seq.p50_q1:+.3f}, {seq.p50_q3:+.3f}]" if seq else ""
        load_iqr = f"[{load.p50_q1:+.3f}, {load.p50_q3:+.3f}]" if load else ""
        print(
            f"{r.target:<14} {statistics.median(r.seq.p50):8.3f} {seq.p50 if seq else 0:+8.3f} "
            f"{seq_iqr:>17} {seq.p99 if seq else 0:+8.3f} {statistics.median(r.load.p50):8.3f} "
            f"{load.p50 if load else 0:+8.3f} {load_iqr:>17} {load.p99 if load else 0:+8.3f} "
            f"{statistics.median(r.rps):8.0f} {r.cpu_us:7.1f}"
        )
    by_name = {r.target: figures(r) for r in results[1:]}
    kv = by_name["kvherd"]
    for baseline in ("sglang-router", "vllm-router", "nginx", "traced"):
        if baseline in by_name:
            base = by_name[baseline]
            print(
                f"kvherd/{baseline}: "
                + ", ".join(f"{name} {ratio(kv[name], base[name])}" for name in kv)
            )
    checks = {
        "kvherd adds <= 1 ms at p50": kv["added p50 sequential"] <= 1.0,
        "kvherd sustains >= 1000 req/s": kv["req/s"] >= 1000,
    }
    if "nginx" in by_name:
        for name in ("added p50 sequential", "added p50 under load"):
            checks[f"kvherd {name} <= 3x nginx's"] = kv[name] <= 3 * max(by_name["nginx"][name], 0)
    if "sglang-router" in by_name:
        for name in LATENCIES:
            checks[f"kvherd {name} <= sglang-router's"] = kv[name] <= by_name["sglang-router"][name]
    for name, ok in checks.items():
        print(f"  [{'ok' if ok else 'MISS'}] {name}")
    return checks


@dataclass
class Fleet:
    """What every target fronts: the backends' ports, a scratch folder, the run's arguments."""

    backends: list[int]
    tmp: str
    args: argparse.Namespace

    @property
    def urls(self) -> list[str]:
        return [f"http://127.0.0.1:{port}" for port in self.backends]


@dataclass
class Launch:
    """One process to start: its command line, environment, and the port it serves."""

    command: list[str]
    port: int
    env: dict[str, str] | None = None


def fast_backend(port: int) -> Launch:
    return Launch(
        [sys.executable, str(ROOT / "bench" / "fast_backend.py"), "--port", str(port)], port
    )


def kvherd_command(fleet: Fleet, port: int, extra: list[str]) -> Launch:
    cmd = [sys.executable, "-m", "kvherd", "serve", "--port", str(port)]
    cmd += ["--admin-port", str(free_port()), "--policy", fleet.args.policy]
    # The fast backends are not kvherd agents and have no tokenizer of their own: route by byte
    # tokens (kvherd serve refuses to guess in front of such a fleet).
    cmd += ["--log-level", "warning", "--tokenizer", "byte"]
    for url in fleet.urls:
        cmd += ["--instance", url]
    env = {**os.environ, "KVHERD_ADMIN_TOKEN": "bench"}
    return Launch([*cmd, *fleet.args.kvherd_arg, *extra], port, env)


# A target's launcher: the processes to start, the target's last (helpers before it), or why the
# target is skipped.
Launcher = Callable[[Fleet], list[Launch] | str]


def launch_kvherd(fleet: Fleet) -> list[Launch] | str:
    return [kvherd_command(fleet, free_port(), [])]


def launch_traced(fleet: Fleet) -> list[Launch] | str:
    if not fleet.args.traced:
        return "not asked (--traced)"
    sink = fast_backend(free_port())  # the span exporter's collector
    otlp = ["--otlp-endpoint", f"http://127.0.0.1:{sink.port}"]
    return [sink, kvherd_command(fleet, free_port(), otlp)]


def launch_nginx(fleet: Fleet) -> list[Launch] | str:
    if fleet.args.no_nginx:
        return "--no-nginx"
    port = free_port()
    conf = nginx_config(fleet.tmp, port, fleet.backends)
    return [Launch([ensure_nginx(), "-c", conf, "-p", fleet.tmp], port)]


def router_launcher(module: str, log_level: str, flag: str) -> Launcher:
    """A Rust router started by its Python package (`module`) from the venv python `flag` names."""

    def launch(fleet: Fleet) -> list[Launch] | str:
        python = getattr(fleet.args, flag)
        if not python:
            return f"no python given (--{flag.replace('_', '-')} or its env default)"
        port = free_port()
        cmd = [python, "-m", module, "--host", "127.0.0.1", "--port", str(port)]
        cmd += ["--worker-urls", *fleet.urls, "--policy", "cache_aware"]
        cmd += ["--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())]
        return [Launch([*cmd, "--log-level", log_level], port)]

    return launch


# Every target the bench can front the backends with, in the order of the table.
TARGETS: tuple[tuple[str, Launcher], ...] = (
    ("kvherd", launch_kvherd),
    ("traced", launch_traced),
    ("sglang-router", router_launcher("sglang_router.launch_router", "warn", "sglang_router")),
    ("vllm-router", router_launcher("vllm_router.launch_router", "warning", "vllm_router")),
    ("nginx", launch_nginx),
)


def wait_ready(target: Target, proc: subprocess.Popen[bytes], timeout: float = 60.0) -> None:
    """Until the target answers a request with 200 (a router may refuse while it probes)."""
    deadline = time.monotonic() + timeout
    while True:
        with (
            contextlib.suppress(OSError),
            socket.create_connection(("127.0.0.1", target.port)) as s,
        ):
            s.settimeout(5.0)
            s.sendall(target.payload)
            if s.recv(12).startswith(b"HTTP/1.1 200"):
                return
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args!r} exited with {proc.returncode}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{target.name} not answering 200 after {timeout}s")
        time.sleep(0.2)


def start(launch: Launch, procs: list[subprocess.Popen[bytes]]) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen(launch.command, env=launch.env, cwd=ROOT, stdout=subprocess.DEVNULL)
    procs.append(proc)
    wait_port(launch.port, proc)
    return proc


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
        "--sglang-router",
        default=os.environ.get("KVHERD_SGLANG_ROUTER"),
        help="python of a venv with sglang-router (default: env KVHERD_SGLANG_ROUTER)",
    )
    parser.add_argument(
        "--vllm-router",
        default=os.environ.get("KVHERD_VLLM_ROUTER"),
        help="python of a venv with vllm-router (default: env KVHERD_VLLM_ROUTER)",
    )
    parser.add_argument(
        "--kvherd-arg", action="append", default=[], help="extra kvherd serve flag; repeatable"
    )
    args = parser.parse_args()
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass

    body = json.dumps({"model": "tiny", "prompt": PROMPT, "max_tokens": 1}).encode()
    with children() as procs, tempfile.TemporaryDirectory(prefix="kvherd-bench-") as tmp:
        fleet = Fleet([free_port(), free_port()], tmp, args)
        backends = [start(fast_backend(port), procs) for port in fleet.backends]
        direct = fleet.backends[0]
        targets = [Target("direct", direct, backends[0].pid, request_bytes(direct, body))]
        for name, launcher in TARGETS:
            launches = launcher(fleet)
            if isinstance(launches, str):
                print(f"{name}: skipped, {launches}", flush=True)
                continue
            for launch in launches:
                proc = start(launch, procs)
            targets.append(Target(name, launch.port, proc.pid, request_bytes(launch.port, body)))
            wait_ready(targets[-1], proc)
        results = asyncio.run(run_rounds(targets, args))

    checks = report(results, args)
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"results": [asdict(r) for r in results], "checks": checks}, handle, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
