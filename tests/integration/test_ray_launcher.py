"""``kvherd up --autoscale --ray ADDRESS``: agents as Ray actors; a lost actor is replaced.

A real local Ray cluster (``ray start --head``, token authentication on, as Ray defaults to)
started by the test; ``kvherd up`` places its two agents on it as actors (the autoscaler's
minimum). One client sends greedy requests through the proxy throughout. The test kills one
actor through Ray (``ray.kill``, from another process): its agent dies with it, the proxy ejects
and then removes it, and the autoscaler, below its minimum, starts a third actor that registers
and serves. Every request answers 200, one greedy text per prompt. The same with ``--launch``:
engines from a command template run in Ray actors and a killed one is replaced.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator

import pytest
from agent_process import free_port
from kvherd_up import running_up
from step_load import StepLoad, assert_served, until
from test_autoscale import PROMPTS
from test_launch import assert_replaced

pytest.importorskip("ray")
pytestmark = pytest.mark.timeout(420)

TOKEN = "ray-admin-token"


@pytest.fixture
def ray_cluster() -> Iterator[tuple[str, dict[str, str]]]:
    """A one-node Ray cluster of its own: (its address, the environment that reaches it)."""
    env = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(16)}
    env.pop("KVHERD_ADMIN_TOKEN", None)
    temp_dir = tempfile.mkdtemp(prefix="kvherd-ray-")
    ray = [sys.executable, "-m", "ray.scripts.scripts"]
    started = subprocess.run(
        [*ray, "start", "--head", "--port", str(free_port()), "--num-cpus", "4",
         "--include-dashboard=false", "--disable-usage-stats", "--temp-dir", temp_dir,
         # Workers below the tests' own port range (agent_process._PORTS), so the head's port
         # never falls in Ray's default worker range (10002-19999).
         "--min-worker-port", "10002", "--max-worker-port", "14999"],
        env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert started.returncode == 0, started.stdout + started.stderr
    found = re.search(r"--address='([^']+)'", started.stdout + started.stderr)
    assert found, started.stdout + started.stderr
    try:
        yield found.group(1), env
    finally:
        _stop_cluster(temp_dir)


def _stop_cluster(temp_dir: str) -> None:
    """Stop this cluster's processes only (they name its temp dir): ``ray stop`` stops every Ray
    cluster on the machine."""
    pids = [p for p in _pids_naming(temp_dir) if p != os.getpid()]
    for sig, grace in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 5.0)):
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        deadline = time.monotonic() + grace
        while (
            pids := [p for p in pids if p in _pids_naming(temp_dir)]
        ) and time.monotonic() < deadline:
            time.sleep(0.1)  # Ray's processes exit on their own schedule


def _pids_naming(text: str) -> set[int]:
    found = set()
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                with open(f"/proc/{entry.name}/cmdline", "rb") as handle:
                    if text.encode() in handle.read():
                        found.add(int(entry.name))
            except OSError:
                continue  # it exited meanwhile
    return found


def _kill_actor(address: str, env: dict[str, str], name: str) -> None:
    script = (
        "import ray\n"
        f"ray.init(address={address!r}, namespace='kvherd', log_to_driver=False)\n"
        f"ray.kill(ray.get_actor({name!r}), no_restart=True)\n"
    )
    killed = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120
    )
    assert killed.returncode == 0, killed.stdout + killed.stderr


def test_agents_run_as_ray_actors_and_a_lost_one_is_replaced(
    ray_cluster: tuple[str, dict[str, str]],
) -> None:
    address, env = ray_cluster
    args = ["--autoscale", "--min", "2", "--max", "3", "--ray", address,
            "--agent-arg=--max-num-seqs=4", "--stop-timeout", "30", "--load-interval", "0.2",
            "--heartbeat-timeout", "5", "--max-queue-wait", "60", "--standing-queue-wait", "60"]  # fmt: skip
    with running_up(args, env, TOKEN) as up:
        banner = up.wait_ready(240)
        assert re.search(r"agent-0 http://127\.0\.0\.1:\d+ \(pid \d+ on ", banner), banner
        assert up.serving() == ["agent-0", "agent-1"]
        load = StepLoad(up.base, 1, PROMPTS, 96)
        time.sleep(2.0)
        _kill_actor(address, env, "kvherd-agent-0")
        until(
            lambda: up.serving() == ["agent-1", "agent-2"], 180, "agent-2 replacing agent-0", up.log
        )
        time.sleep(2.0)  # the replacement serves its share
        load.join()
        assert_served(load)
        assert up.metric("kvherd_scale_events_total", direction="out", reason="min") == 1


def test_launched_engines_run_as_ray_actors_and_a_lost_one_is_replaced(
    ray_cluster: tuple[str, dict[str, str]],
) -> None:
    """``--launch`` with ``--ray``: the command template is filled and started in a Ray actor
    (here a kvherd agent that never registers itself, standing in for a vLLM server: the proxy
    adds it once ``/health`` answers); the actor killed, the proxy removes its engine and the
    autoscaler's replacement serves."""
    address, env = ray_cluster
    command = shlex.join([sys.executable, "-m", "kvherd", "agent", "--model", "tiny",
                          "--host", "{host}", "--port", "{port}", "--instance-id", "{id}"])  # fmt: skip
    args = ["-n", "1", "--autoscale", "--min", "1", "--max", "2", "--ray", address,
            "--launch", command, "--autoscale-slots", "8", "--stop-timeout", "20"]  # fmt: skip
    with running_up(args, env, TOKEN) as up:
        banner = up.wait_ready(240)
        assert re.search(r"engine-0 http://127\.0\.0\.1:\d+ \(pid \d+ on ", banner), banner
        assert up.serving() == ["engine-0"]
        assert_replaced(up, PROMPTS, lambda: _kill_actor(address, env, "kvherd-engine-0"), 180)
        assert any("launched engine-0 exited" in line for line in up.output), up.log()
