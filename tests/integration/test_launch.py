"""``kvherd up --launch`` with a kvherd agent as the command: any server that answers ``/health``
joins the fleet; one that dies is removed and the autoscaler launches a replacement.

The template starts ``kvherd agent`` without ``--scheduler`` (it never registers itself: the proxy
adds it once healthy, as it does a vLLM server). The test SIGKILLs the first engine's process group
under a trickle of requests: the proxy removes it, the controller (``--min 1``) launches
``engine-1``, which serves; every request after the replacement answers 200.
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
import threading

import httpx
import pytest
from agent_process import free_port
from step_load import StepLoad, until

pytestmark = pytest.mark.timeout(300)

TOKEN = "launch-admin-token"
PROMPTS = [f"A launched engine, prompt {i}." for i in range(4)]


def test_a_launched_engine_that_dies_is_removed_and_replaced() -> None:
    port, admin_port = free_port(), free_port()
    env = {k: v for k, v in os.environ.items() if k != "KVHERD_ADMIN_TOKEN"}
    command = shlex.join([sys.executable, "-m", "kvherd", "agent", "--model", "tiny",
                          "--host", "127.0.0.1", "--port", "{port}", "--instance-id", "{id}"])  # fmt: skip
    cmd = [sys.executable, "-m", "kvherd", "up", "-n", "1", "--autoscale", "--min", "1", "--max", "2",
           "--launch", command, "--port", str(port), "--admin-port", str(admin_port),
           "--admin-token", TOKEN, "--autoscale-slots", "8", "--log-level", "info",
           "--expose-instance", "--stop-timeout", "20"]  # fmt: skip
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
    )
    output: list[str] = []
    assert proc.stdout is not None
    stdout = proc.stdout
    threading.Thread(target=lambda: output.extend(stdout), daemon=True).start()
    base = f"http://127.0.0.1:{port}"
    admin = f"http://127.0.0.1:{admin_port}/admin/v1/instances"
    auth = {"Authorization": f"Bearer {TOKEN}"}

    def serving() -> list[str]:
        listed = httpx.get(admin, headers=auth, timeout=10).json()["data"]
        return sorted(i["instance_id"] for i in listed if i["health"] == "healthy")

    def log() -> str:
        return "".join(output[-60:])

    try:
        until(lambda: any("stops everything" in line for line in output), 120, "ready", log)
        assert serving() == ["engine-0"], log()
        banner = re.search(r"engine-0 \S+ \(pid (\d+)\)", "".join(output))
        assert banner, log()
        pid = int(banner.group(1))  # it leads its own process group
        before = StepLoad(base, 1, PROMPTS, 8)
        until(lambda: len(before.answers) >= 4, 60, "answers from engine-0", log)
        before.join()
        assert {a[1] for a in before.answers} == {200}, before.answers[:3]
        os.killpg(pid, signal.SIGKILL)  # the engine and anything it started
        until(lambda: serving() == ["engine-1"], 120, "engine-1 replacing engine-0", log)
        after = StepLoad(base, 1, PROMPTS, 8)
        until(lambda: len(after.answers) >= 4, 60, "answers from engine-1", log)
        after.join()
        assert {(a[1], a[3]) for a in after.answers} == {(200, "engine-1")}, after.answers[:3]
        assert any("launched engine-0 exited" in line for line in output), log()
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
