"""Test helper: a real ``kvherd serve`` subprocess (its own event loop, as in production).

Usage::

    with serve_process([agent.instance_spec()], "--policy", "round_robin") as served:
        httpx.post(served.url + "/v1/completions", ...)
        httpx.get(served.admin_url + "/admin/v1/instances", headers=served.admin_headers)

`instances` are ``--instance`` values; `flags` pass through; `ports` (client, admin) are chosen
beforehand when a peer must know them. It waits until ``/health`` answers
(200, or 503 with no instance), fails with the log if the process exits first, and on exit stops
it (SIGTERM, then SIGKILL after 30 s).
"""

from __future__ import annotations

import contextlib
import os
import resource
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
from agent_process import free_port

ADMIN_TOKEN = "chaos-admin-token"


@dataclass
class Served:
    url: str
    admin_url: str
    process: subprocess.Popen[bytes]
    log_path: str
    admin_headers: dict[str, str]

    def log(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()


@contextlib.contextmanager
def serve_process(
    instances: list[str],
    *flags: str,
    fd_limit: int | None = None,
    env: dict[str, str] | None = None,
    admin_token: str = ADMIN_TOKEN,
    ports: tuple[int, int] | None = None,
) -> Iterator[Served]:
    port, admin_port = ports or (free_port(), free_port())
    cmd = [sys.executable, "-m", "kvherd", "serve", "--port", str(port)]
    cmd += ["--admin-port", str(admin_port), "--admin-token", admin_token, "--log-level", "warning"]
    for spec in instances:
        cmd += ["--instance", spec]
    cmd += list(flags)
    fd, log_path = tempfile.mkstemp(prefix="kvherd-serve-", suffix=".log")
    with os.fdopen(fd, "wb") as log_file:
        process = subprocess.Popen(
            cmd,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})},
            preexec_fn=None if fd_limit is None else lambda: _limit_fds(fd_limit),
        )
    served = Served(
        f"http://127.0.0.1:{port}",
        f"http://127.0.0.1:{admin_port}",
        process,
        log_path,
        {"Authorization": f"Bearer {admin_token}"},
    )
    ready = {200} if instances else {200, 503}  # without instances it serves, undispatchable
    try:
        deadline = time.monotonic() + 120
        with httpx.Client(timeout=2.0) as client:
            while True:
                if process.poll() is not None:
                    raise RuntimeError(f"kvherd serve exited:\n{served.log()}")
                with contextlib.suppress(httpx.HTTPError):
                    if client.get(served.url + "/health").status_code in ready:
                        break
                if time.monotonic() > deadline:
                    raise TimeoutError(f"kvherd serve not ready:\n{served.log()}")
                time.sleep(0.05)  # polling interval while the process starts
        yield served
    finally:
        process.terminate()
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        os.unlink(log_path)


def _limit_fds(limit: int) -> None:
    resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limit))
