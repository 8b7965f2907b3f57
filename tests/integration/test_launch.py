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
import sys
from collections.abc import Callable

import pytest
from kvherd_up import Up, running_up
from step_load import StepLoad, until

pytestmark = pytest.mark.timeout(300)

TOKEN = "launch-admin-token"
PROMPTS = [f"A launched engine, prompt {i}." for i in range(4)]


def assert_replaced(up: Up, prompts: list[str], kill: Callable[[], None], timeout: float) -> None:
    """engine-0 answers, `kill()` ends it, and engine-1, the autoscaler's replacement, answers."""
    before = StepLoad(up.base, 1, prompts, 8)
    until(lambda: len(before.answers) >= 4, 60, "answers from engine-0", up.log)
    before.join()
    assert {(a[1], a[3]) for a in before.answers} == {(200, "engine-0")}, before.answers[:3]
    kill()
    until(lambda: up.serving() == ["engine-1"], timeout, "engine-1 replacing engine-0", up.log)
    after = StepLoad(up.base, 1, prompts, 8)
    until(lambda: len(after.answers) >= 4, 60, "answers from engine-1", up.log)
    after.join()
    assert {(a[1], a[3]) for a in after.answers} == {(200, "engine-1")}, after.answers[:3]


def test_a_launched_engine_that_dies_is_removed_and_replaced() -> None:
    env = {k: v for k, v in os.environ.items() if k != "KVHERD_ADMIN_TOKEN"}
    command = shlex.join([sys.executable, "-m", "kvherd", "agent", "--model", "tiny",
                          "--host", "127.0.0.1", "--port", "{port}", "--instance-id", "{id}"])  # fmt: skip
    args = ["-n", "1", "--autoscale", "--min", "1", "--max", "2", "--launch", command,
            "--autoscale-slots", "8", "--stop-timeout", "20"]  # fmt: skip
    with running_up(args, env, TOKEN) as up:
        banner = re.search(r"engine-0 \S+ \(pid (\d+)\)", up.wait_ready(120))
        assert banner and up.serving() == ["engine-0"], up.log()
        pid = int(banner.group(1))  # it leads its own process group
        assert_replaced(up, PROMPTS, lambda: os.killpg(pid, signal.SIGKILL), 120)  # its group
        assert any("launched engine-0 exited" in line for line in up.output), up.log()
