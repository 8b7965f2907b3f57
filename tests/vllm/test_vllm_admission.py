"""Admission serves what vLLM can start: real vLLM CPU servers (``--max-num-seqs 16``) behind a real
``kvherd serve`` with the shipped admission defaults (issue 22).

- A burst of as many concurrent requests as the session's pair has batch slots (2 x 16), half
  streamed, sent twice (cold, then on a fleet with a measured rate), is served without a 429:
  every request completes with all its tokens. The burst is shown to be one (the last request is
  sent before the first is answered). So is a burst of the 24 slots left free while 8 run long
  generations (3,000 tokens) that have not completed for 1.5 s; the long streams are then
  closed, and the pair is handed on with nothing running.
- The survivor serves after a SIGKILL: a closed loop of 16 clients (one server's batch slots, half
  the fleet's) runs against the session's ``a`` and a server of this module's own, ``k``, and is
  not refused; ``k`` is then SIGKILLed (its API server, EngineCore and worker), and of the
  requests sent after the kill at least 99% complete (200, every token), none gets a 5xx and none
  hangs (each is bounded client-side); those in flight at the kill end too (retried, continued or
  refused), none hanging.

Why ``k`` and not one of the session's pair: the other tests of the stage share ``a`` and ``b``
for the whole session, and a killed ``b`` would fail every test after this one (pytest orders
modules by name, and ordering a test last by hand is fragile). The survivor is ``a``, which this
test leaves as it found it; ``k`` costs one cold start (50-160 s), not two.
"""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from capacity_load import (
    assert_survivor_served,
    burst,
    burst_behind_long,
    burst_problems,
    closed_loop_with_kill,
    describe,
)
from vllm_fleet import (
    SERVED_MODEL,
    KvherdFactory,
    VllmServer,
    VllmSpec,
    instance_arg,
    kvherd_serve,
    poll_until,
    vllm_servers,
)

MAX_NUM_SEQS = 16  # what tests/support/vllm_fleet.py starts every server with
BURST_TOKENS = 256  # seconds of decoding at a batch of 16 on a shared core: the burst overlaps
KILL_TOKENS = 16
LONG_TOKENS = 3000  # far longer than the burst (closed after it); prompt + 3000 < 4096
SETTLE_S = 1.5  # the long generations run this long with no completion before the burst
MIN_AFTER_KILL = 100  # requests after the kill: 99% of them is a count, not a rounding


@pytest.fixture(scope="module")
def killable(
    vllm_python: str, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[VllmServer]:
    """A server of this module's own, which the kill test kills (see the module docstring)."""
    log_dir = tmp_path_factory.mktemp("vllm_admission_logs")
    with vllm_servers(vllm_python, tiny_model, [VllmSpec("k")], log_dir) as (server,):
        # A fresh server's first requests are slow (seconds): not what the test measures.
        for _ in range(2):
            response = httpx.post(
                server.url + "/v1/completions",
                json={"model": SERVED_MODEL, "prompt": "warm up", "max_tokens": 8},
                timeout=120.0,
                trust_env=False,
            )
            assert response.status_code == 200, response.text
        yield server


def test_burst_up_to_the_fleets_batch_slots_is_served(
    kvherd_fleet: KvherdFactory, vllm_pair: tuple[VllmServer, VllmServer]
) -> None:
    slots = 2 * MAX_NUM_SEQS
    with kvherd_fleet() as proxy:
        reports, problems = [], []
        for round_ in ("cold", "warm"):
            outcomes = asyncio.run(
                burst(proxy.url, slots, BURST_TOKENS, tag=f"admission-{round_}", model=SERVED_MODEL)
            )
            reports.append(f"{round_} burst of {slots}:\n{describe(outcomes)}")
            problems += [f"{round_} burst: {p}" for p in burst_problems(outcomes)]
        # A quarter of the slots busy with long generations, no completion for a while: the
        # rest of the slots are free, and the burst that fills them is not refused either.
        long_n = slots // 4
        held, outcomes = asyncio.run(
            burst_behind_long(
                proxy.url, long_n, slots - long_n, BURST_TOKENS, LONG_TOKENS, SETTLE_S,
                tag="admission-behind", model=SERVED_MODEL,
            )
        )  # fmt: skip
        reports.append(
            f"{long_n} long generations:\n{describe(held)}\nburst of {slots - long_n} behind "
            f"them:\n{describe(outcomes)}"
        )
        if not all(o.status == 200 and o.started for o in held):
            problems.append("a long generation was not started")
        problems += [f"burst behind long generations: {p}" for p in burst_problems(outcomes)]
        print("\n".join(reports))
        # The session's pair is left as found: the closed streams were aborted in vLLM.
        assert poll_until(lambda: all(running(s) == 0 for s in vllm_pair)), "still running"
        assert not problems, "\n".join(problems) + "\n" + "\n".join(reports)


def running(server: VllmServer) -> float:
    """vLLM's ``vllm:num_requests_running``."""
    text = httpx.get(server.url + "/metrics", timeout=30.0, trust_env=False).text
    line = next(x for x in text.splitlines() if x.startswith("vllm:num_requests_running{"))
    return float(line.rsplit(" ", 1)[1])


def test_survivor_serves_after_the_other_vllm_is_killed(
    vllm_pair: tuple[VllmServer, VllmServer], killable: VllmServer, tiny_model: Path
) -> None:
    survivor, victim = vllm_pair[0], killable
    args = ["--instance", instance_arg(survivor), "--instance", instance_arg(victim)]
    with kvherd_serve(*args, "--tokenizer", str(tiny_model), "--expose-instance") as proxy:
        run = asyncio.run(
            closed_loop_with_kill(
                proxy.url,
                clients=MAX_NUM_SEQS,
                per_client=-(-MIN_AFTER_KILL // MAX_NUM_SEQS),
                max_tokens=KILL_TOKENS,
                # The whole group: vLLM's API server, its EngineCore and its worker.
                kill=lambda: os.killpg(victim.process.pid, signal.SIGKILL),
                tag="admission-kill",
                model=SERVED_MODEL,
            )
        )
        assert_survivor_served(run, MIN_AFTER_KILL)
