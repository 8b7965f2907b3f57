"""Test helper: a real `kvherd agent` subprocess on a free loopback port.

Usage::

    with agent_process("--max-num-seqs", "8", kv_events=True) as agent:
        httpx.get(f"{agent.url}/health")
        agent.kv_events_endpoint  # "tcp://127.0.0.1:PORT" (only with kv_events=True)

Extra arguments are passed through to ``kvherd agent`` (``--model tiny`` unless given). The helper
polls ``/health`` until it answers 200 (or the process dies, which fails with its log), yields an
`AgentProcess`, and on exit sends SIGTERM (the agent drains) and kills it if it does not exit in time.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import httpx


def _ephemeral_floor() -> int:
    with (
        contextlib.suppress(OSError, ValueError),
        open("/proc/sys/net/ipv4/ip_local_port_range") as f,
    ):
        return int(f.read().split()[0])
    return 32768


# Ports are drawn below the kernel's ephemeral range: a port bind(0) chose is free only until the
# child binds it (seconds of imports later), and any outgoing connection on the machine (another
# test's client, a ZMQ peer) may take it meanwhile, since those draw from that range. Below it,
# only another explicit bind competes; `_HANDED` keeps this process from giving a port twice.
_PORTS = range(15000, max(_ephemeral_floor(), 20000))
_HANDED: set[int] = set()


def free_port() -> int:
    """A loopback TCP port nobody holds now and this process has not handed out before."""
    for _ in range(1000):
        port = random.choice(_PORTS)
        if port in _HANDED:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
        _HANDED.add(port)
        return port
    raise RuntimeError(f"no free loopback port in {_PORTS}")


@dataclass
class AgentProcess:
    url: str
    port: int
    process: subprocess.Popen[bytes]
    log_path: str
    kv_events_endpoint: str | None = None
    replay_endpoint: str | None = None

    def log(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def instance_spec(self, url: str | None = None) -> str:
        """Its ``kvherd serve --instance`` value (`url` in place of its own: a relay in front)."""
        spec = url or self.url
        if self.kv_events_endpoint:
            spec += f",kv_events={self.kv_events_endpoint},replay={self.replay_endpoint}"
        return spec

    def terminate(self, timeout: float = 30.0) -> int:
        """SIGTERM (drain) and wait; returns the exit code."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
            raise


@contextlib.contextmanager
def agent_process(
    *args: str,
    kv_events: bool = False,
    startup_timeout: float = 120.0,
    env: dict[str, str] | None = None,
) -> Iterator[AgentProcess]:
    port = free_port()
    cmd = [sys.executable, "-m", "kvherd", "agent", "--host", "127.0.0.1", "--port", str(port)]
    if "--model" not in args:
        cmd += ["--model", "tiny"]
    kv_endpoint = replay_endpoint = None
    if kv_events:
        kv_endpoint = f"tcp://127.0.0.1:{free_port()}"
        replay_endpoint = f"tcp://127.0.0.1:{free_port()}"
        cmd += ["--kv-events-endpoint", kv_endpoint, "--kv-events-replay-endpoint", replay_endpoint]
    cmd += list(args)
    fd, log_path = tempfile.mkstemp(prefix="kvherd-agent-", suffix=".log")
    with os.fdopen(fd, "wb") as log_file:  # the child keeps its own copy of the descriptor
        process = subprocess.Popen(
            cmd,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})},
        )
    agent = AgentProcess(
        url=f"http://127.0.0.1:{port}",
        port=port,
        process=process,
        log_path=log_path,
        kv_events_endpoint=kv_endpoint,
        replay_endpoint=replay_endpoint,
    )
    try:
        _wait_healthy(agent, startup_timeout)
        yield agent
    finally:
        if process.poll() is None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                agent.terminate(timeout=30.0)
        os.unlink(log_path)


@contextlib.contextmanager
def agent_processes(
    count: int, *args: str, kv_events: bool = True, env: dict[str, str] | None = None
) -> Iterator[list[AgentProcess]]:
    """`count` agents started in parallel (startup is dominated by imports)."""
    with contextlib.ExitStack() as stack, ThreadPoolExecutor(count) as pool:
        futures = [
            pool.submit(stack.enter_context, agent_process(*args, kv_events=kv_events, env=env))
            for _ in range(count)
        ]
        yield [f.result() for f in futures]


def _wait_healthy(agent: AgentProcess, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    with httpx.Client(timeout=2.0) as client:
        while time.monotonic() < deadline:
            if agent.process.poll() is not None:
                raise RuntimeError(
                    f"agent exited with {agent.process.returncode} during startup:\n{agent.log()}"
                )
            with contextlib.suppress(httpx.HTTPError):
                if client.get(f"{agent.url}/health").status_code == 200:
                    return
            time.sleep(0.05)  # polling interval while the process starts
    raise TimeoutError(f"agent not healthy after {timeout}s:\n{agent.log()}")
