"""``kvherd up`` as a user runs it: starts agents + proxy, serves, and stops with no orphans."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import httpx
import pytest
from agent_process import free_port


def _ephemeral_floor() -> int:
    with open("/proc/sys/net/ipv4/ip_local_port_range") as handle:
        return int(handle.read().split()[0])


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie still answers kill(0); it is gone for our purposes once its parent reaped it.
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def _wait_ready(proc: subprocess.Popen[str], timeout: float) -> str:
    """Output up to the ready banner's last line."""
    assert proc.stdout is not None
    seen = []
    deadline = time.monotonic() + timeout
    for line in proc.stdout:
        seen.append(line)
        if line.startswith("Ctrl-C or SIGTERM stops everything"):
            return "".join(seen)
        if time.monotonic() > deadline:
            break
    raise AssertionError("kvherd up did not become ready:\n" + "".join(seen))


@pytest.mark.parametrize("stop_signal", [signal.SIGTERM, signal.SIGINT])
def test_up_starts_serves_and_stops_cleanly(stop_signal: signal.Signals) -> None:
    port, admin_port = free_port(), free_port()
    env = {k: v for k, v in os.environ.items() if k != "KVHERD_ADMIN_TOKEN"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvherd", "up", "-n", "2", "--port", str(port),
         "--admin-port", str(admin_port), "--log-level", "warning", "--stop-timeout", "20"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )  # fmt: skip
    try:
        banner = _wait_ready(proc, timeout=240)
        pids = [int(p) for p in re.findall(r"\(pid (\d+)\)", banner)]
        assert len(pids) == 2 and all(_alive(p) for p in pids)
        # Agents' ports lie below the ephemeral range, which outgoing connections draw from.
        agent_ports = [int(p) for p in re.findall(r"agent-\d+ http://127.0.0.1:(\d+)", banner)]
        assert len(agent_ports) == 2 and all(p < _ephemeral_floor() for p in agent_ports), banner
        token = re.search(r"admin token (\S+)", banner)
        assert token is not None  # generated, since none was given
        base = f"http://127.0.0.1:{port}"
        body = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 3}
        response = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=60)
        assert response.status_code == 200, response.text
        admin = f"http://127.0.0.1:{admin_port}/admin/v1/instances"
        assert httpx.get(admin, timeout=10).status_code == 401
        listed = httpx.get(
            admin, headers={"Authorization": f"Bearer {token.group(1)}"}, timeout=10
        ).json()["data"]
        assert sorted(i["instance_id"] for i in listed) == ["agent-0", "agent-1"]
        assert all(i["kv_events"] is not None for i in listed)

        proc.send_signal(stop_signal)
        assert proc.wait(timeout=60) == 0
        deadline = time.monotonic() + 10
        while any(_alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.05)  # the agents were reaped by kvherd up; /proc may lag a moment
        assert not any(_alive(p) for p in pids), "agent processes outlived kvherd up"
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"{base}/health", timeout=2)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
