"""``kvherd up --autoscale``: a load step up grows the fleet, the step down shrinks it, nothing fails.

Real agents, started and stopped by the autoscaler as child processes; one client load of greedy
requests through the proxy. Under the step the fleet grows from 1 to 3 agents (4 batch slots each,
sized for 2 in flight each; the admission wait is raised so that requests queue while agents
start instead of being refused); once the load falls back to one stream, agents are removed one at a
time (drained, SIGTERM: each migrates what it runs) down to 1. Every request answers 200 with the
same greedy text for the same prompt, across the agents it landed on, before and after each change.
"""

from __future__ import annotations

import os
import time

import pytest
from kvherd_up import running_up
from step_load import StepLoad, assert_served, until

pytestmark = pytest.mark.timeout(420)

TOKEN = "autoscale-admin-token"
PROMPTS = [f"Tell me about autoscaling, part {i}." for i in range(4)]


def test_a_load_step_scales_the_fleet_out_and_back_in_without_a_failed_request() -> None:
    env = {k: v for k, v in os.environ.items() if k != "KVHERD_ADMIN_TOKEN"}
    args = ["--autoscale", "--min", "1", "--max", "3", "--agent-arg=--max-num-seqs=4",
            "--target-utilization", "0.5", "--scale-in-delay", "3", "--scale-cooldown", "2",
            "--stop-timeout", "30", "--load-interval", "0.2",
            # Requests wait while agents start rather than being refused: an autoscaled fleet.
            "--max-queue-wait", "60", "--standing-queue-wait", "60"]  # fmt: skip
    with running_up(args, env, TOKEN) as up:
        banner = up.wait_ready(240)
        assert "autoscale   1..3 agents, 4 batch slots each" in banner, banner
        assert up.serving() == ["agent-0"]

        step = StepLoad(up.base, 8, PROMPTS, 96)
        until(lambda: len(up.serving()) == 3, 180, "3 agents serving under the step", up.log)
        time.sleep(2.0)  # the step keeps running on the grown fleet
        step.join()
        trickle = StepLoad(up.base, 1, PROMPTS, 96)  # one stream: one agent's worth of load
        until(lambda: len(up.serving()) == 1, 120, "back to 1 agent after the step", up.log)
        time.sleep(1.0)
        trickle.join()

        assert up.metric("kvherd_scale_events_total", direction="out") >= 1, up.log()
        assert up.metric("kvherd_scale_events_total", direction="in", reason="load") >= 2
        assert_served(step, trickle)
        landed = {instance for *_, instance in step.answers}
        assert len(landed) >= 2, landed  # the grown agents served part of the step
