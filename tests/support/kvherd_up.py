"""``kvherd up`` as a test's child process: free ports, an admin token, its output kept.

`running_up(args, env, token)` starts ``python -m kvherd up ARGS`` with ``--port``, ``--admin-port``
(free), ``--admin-token``, ``--log-level info`` and ``--expose-instance``, reads its output in a
thread and yields an `Up`: `base` (the client URL), `output` (its lines), `log()` (the last 80),
`wait_ready(timeout)` (the banner, once printed), `listed()` (the admin listing by instance id),
`serving()` (the healthy, not draining ones, sorted), `metric(name, **labels)` (the sum of the
proxy's samples of `name` with those labels). On exit it is sent SIGTERM (SIGKILL after
60 s) and reaped.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx
from agent_process import free_port
from step_load import until

from scheduler.core.prom_text import samples

READY_LINE = "Ctrl-C or SIGTERM stops everything"


@dataclass
class Up:
    proc: subprocess.Popen[str]
    port: int
    admin_port: int
    token: str
    output: list[str] = field(default_factory=list)

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log(self) -> str:
        return "".join(self.output[-80:])

    def wait_ready(self, timeout: float) -> str:
        until(lambda: any(READY_LINE in line for line in self.output), timeout, "ready", self.log)
        return "".join(self.output)

    def listed(self) -> dict[str, dict[str, Any]]:
        admin = f"http://127.0.0.1:{self.admin_port}/admin/v1/instances"
        auth = {"Authorization": f"Bearer {self.token}"}
        return {
            i["instance_id"]: i for i in httpx.get(admin, headers=auth, timeout=10).json()["data"]
        }

    def serving(self) -> list[str]:
        return sorted(
            k for k, i in self.listed().items() if i["health"] == "healthy" and not i["draining"]
        )

    def metric(self, name: str, **labels: str) -> float:
        text = httpx.get(f"{self.base}/metrics", timeout=10).text
        return sum(v for _, got, v in samples(text, {name}) if labels.items() <= got.items())


@contextlib.contextmanager
def running_up(args: Sequence[str], env: dict[str, str], token: str) -> Iterator[Up]:
    port, admin_port = free_port(), free_port()
    cmd = [sys.executable, "-m", "kvherd", "up", *args, "--port", str(port),
           "--admin-port", str(admin_port), "--admin-token", token, "--log-level", "info",
           "--expose-instance"]  # fmt: skip
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
    )
    up = Up(proc, port, admin_port, token)
    assert proc.stdout is not None
    stdout = proc.stdout
    threading.Thread(target=lambda: up.output.extend(stdout), daemon=True).start()
    try:
        yield up
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
