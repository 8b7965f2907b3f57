"""Admission serves what vLLM can start, with vLLM started as users start it: two real vLLM CPU
servers of this module's own on vLLM's default scheduler settings (no ``--max-num-seqs``), behind
a real ``kvherd serve`` with the shipped admission defaults and no ``max_num_seqs`` option, so
kvherd does not know the batch slots and learns them from what vLLM reports (issue 33).

- A burst of what the two servers run at once (`BURST`: vLLM CPU's default of 128 each, where a
  session server has 16) is sent twice, cold and then on a fleet with a measured rate: 0 refused,
  every request completes with all its tokens; the burst is shown to be one (the last request is
  sent before the first is answered), and vLLM is seen running more than 16 at once. So is a
  burst beside 8 long generations (3,000 tokens) that have not completed for 1.5 s; the long
  streams are then closed and vLLM runs nothing more.
- Then the kill: a closed loop of `KILL_CLIENTS` clients runs against the pair; ``db`` is
  SIGKILLed (API server, EngineCore and worker), and the survivor, which has room for every
  client, serves all the requests sent after the kill: 0 refused, every one complete, no 5xx,
  none hanging; those in flight at the kill end too (retried or continued), none hanging.
The kill test runs last in this module (pytest keeps a module's order) and costs the pair.
"""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Iterator
from contextlib import AbstractContextManager
from pathlib import Path

import httpx
import pytest
from capacity_load import (
    KillRun,
    burst,
    burst_behind_long,
    burst_problems,
    closed_loop_with_kill,
    describe,
)
from vllm_fleet import (
    SERVED_MODEL,
    KvherdServe,
    VllmServer,
    VllmSpec,
    instance_arg,
    kvherd_serve,
    metric_sum,
    poll_until,
    vllm_servers,
)

SESSION_SLOTS = 16  # what the session's servers run with (VllmSpec's default): the burst is more
BURST = 256  # 2 x 128, vLLM CPU's default max_num_seqs for its API server
BURST_TOKENS = 128  # seconds of decoding at a batch of 128 on a shared core: the burst overlaps
KILL_CLIENTS = 32  # twice a session server's slots, all of them on the survivor after the kill
KILL_TOKENS = 16
MIN_AFTER_KILL = 96
LONG_N = 8
LONG_TOKENS = 3000  # far longer than the burst (closed after it); prompt + 3000 < 4096
SETTLE_S = 1.5  # the long generations run this long with no completion before the burst
RUNNING = "vllm:num_requests_running"


@pytest.fixture(scope="module")
def default_pair(
    vllm_python: str, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[VllmServer, VllmServer]]:
    log_dir = tmp_path_factory.mktemp("vllm_admission_logs")
    specs = [VllmSpec("da", max_num_seqs=None), VllmSpec("db", max_num_seqs=None)]
    with vllm_servers(vllm_python, tiny_model, specs, log_dir) as pair:
        for server in pair:  # a fresh server's first requests are slow (seconds)
            for _ in range(2):
                response = httpx.post(
                    server.url + "/v1/completions",
                    json={"model": SERVED_MODEL, "prompt": "warm up", "max_tokens": 8},
                    timeout=120.0,
                    trust_env=False,
                )
                assert response.status_code == 200, response.text
        yield pair


def serve_pair(
    pair: tuple[VllmServer, VllmServer], tiny_model: Path
) -> AbstractContextManager[KvherdServe]:
    args = [arg for server in pair for arg in ("--instance", instance_arg(server))]
    return kvherd_serve(*args, "--tokenizer", str(tiny_model), "--expose-instance")


def test_a_burst_on_vllm_defaults_is_served(
    default_pair: tuple[VllmServer, VllmServer], tiny_model: Path
) -> None:
    peaks = {server.spec.name: 0.0 for server in default_pair}

    async def watch_running() -> None:
        async with httpx.AsyncClient(timeout=10.0, trust_env=False) as client:
            while True:
                for server in default_pair:
                    text = (await client.get(server.url + "/metrics")).text
                    running = metric_sum(text, RUNNING)
                    peaks[server.spec.name] = max(peaks[server.spec.name], running)
                await asyncio.sleep(0.1)

    async def bursts() -> tuple[list[str], list[str]]:
        watcher = asyncio.ensure_future(watch_running())
        reports, problems = [], []
        try:
            for round_ in ("cold", "warm"):
                outcomes = await burst(
                    proxy.url, BURST, BURST_TOKENS, tag=f"defaults-{round_}", model=SERVED_MODEL
                )
                reports.append(f"{round_} burst of {BURST}:\n{describe(outcomes)}")
                problems += [f"{round_} burst: {p}" for p in burst_problems(outcomes)]
            held, outcomes = await burst_behind_long(
                proxy.url, LONG_N, BURST - LONG_N, BURST_TOKENS, LONG_TOKENS, SETTLE_S,
                tag="defaults-behind", model=SERVED_MODEL,
            )  # fmt: skip
        finally:
            watcher.cancel()
        reports.append(
            f"{LONG_N} long generations:\n{describe(held)}\nburst of {BURST - LONG_N} beside "
            f"them:\n{describe(outcomes)}"
        )
        if not all(o.status == 200 and o.started for o in held):
            problems.append("a long generation was not started")
        problems += [f"burst beside long generations: {p}" for p in burst_problems(outcomes)]
        return reports, problems

    with serve_pair(default_pair, tiny_model) as proxy:
        reports, problems = asyncio.run(bursts())
        report = "\n".join(reports) + f"\nvLLM's most running at once: {peaks}"
        print(report)
        # The closed streams were aborted in vLLM: the pair is handed to the kill test idle.
        idle = poll_until(lambda: all(s.metric(RUNNING) == 0 for s in default_pair))
        assert idle, "still running"
        assert not problems, "\n".join(problems) + "\n" + report
        assert max(peaks.values()) > SESSION_SLOTS, report


def test_the_survivor_on_vllm_defaults_serves_after_a_kill(
    default_pair: tuple[VllmServer, VllmServer], tiny_model: Path
) -> None:
    victim = default_pair[1]
    with serve_pair(default_pair, tiny_model) as proxy:
        run = asyncio.run(
            closed_loop_with_kill(
                proxy.url,
                clients=KILL_CLIENTS,
                per_client=-(-MIN_AFTER_KILL // KILL_CLIENTS),
                max_tokens=KILL_TOKENS,
                # The whole group: vLLM's API server, its EngineCore and its worker.
                kill=lambda: os.killpg(victim.process.pid, signal.SIGKILL),
                tag="defaults-kill",
                model=SERVED_MODEL,
            )
        )
    report = _kill_report(run)
    print(report)
    assert len(run.after) >= MIN_AFTER_KILL, report
    assert not [o for o in run.before + run.during + run.after if o.status == 429], report
    assert not [o for o in run.during + run.after if o.hung], report
    assert all(o.ok for o in run.after), report
    assert not [o for o in run.during if o.status is not None and o.status >= 500], report


def _kill_report(run: KillRun) -> str:
    return (
        f"before the kill:\n{describe(run.before)}\nin flight at the kill:\n"
        f"{describe(run.during)}\nafter the kill:\n{describe(run.after)}"
    )
