"""Instances that die or hang under running requests, behind ``kvherd serve``: no request is lost.

Two real agents behind the proxy (round robin, so each variant runs on both). Streams are started,
the instance serving some of them is SIGKILLed or SIGSTOPped mid-stream, and every client must still
get exactly the output of an undisturbed run (tokens, text, usage): streams continue on the other
instance from the tokens already sent, plain requests are retried. Outcomes are asserted, not
timings, except the one bound that is the feature (a hung instance costs seconds, not the client's
timeout), which is kept far above the configured deadlines.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import signal
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from agent_process import AgentProcess
from test_proxy import agents, running_proxy, wait_for

pytestmark = pytest.mark.timeout(300)

PROMPT = [(i * 29 + 5) % 250 for i in range(40)]
MESSAGES = [{"role": "user", "content": "Tell me a long story about a herd of llamas."}]
GREEDY = {"temperature": 0.0}
SEEDED = {"temperature": 0.9, "top_p": 0.95, "seed": 1234}
MAX_TOKENS = 700  # long enough to be mid-stream when the instance goes (~1 token/ms idle)
FLAGS = (
    "--policy",
    "round_robin",
    "--migration-policy",
    "none",
    "--health-interval",
    "0.5",
    "--load-interval",
    "0.1",
    # Half the fleet goes at once here: admission by expected wait may then rightly answer 429
    # with Retry-After (tests/chaos/test_overload.py); these tests are about what was admitted.
    "--max-queue-wait",
    "60",
)
_ids = itertools.count()


@pytest.fixture
def pair() -> Iterator[list[AgentProcess]]:
    """A fresh pair per test: the test takes one of them down."""
    with agents(2) as started:
        yield started
        for agent in started:
            if agent.process.poll() is None:
                os.kill(agent.process.pid, signal.SIGCONT)


def body(sampling: dict[str, Any], chat: bool, stream: bool) -> dict[str, Any]:
    payload: dict[str, Any] = {"max_tokens": MAX_TOKENS, "ignore_eos": True, "stream": stream}
    payload.update(sampling)
    if chat:
        payload["messages"] = MESSAGES
    else:
        payload["prompt"] = PROMPT
    if stream:
        payload["stream_options"] = {"include_usage": True}
    return payload


class Run:
    """One request; the output as the client saw it."""

    def __init__(self, base: str, payload: dict[str, Any], chat: bool) -> None:
        self.payload, self.chat = payload, chat
        self.path = "/v1/chat/completions" if chat else "/v1/completions"
        self.request_id = f"ft-{next(_ids)}"
        self.instance: str | None = None
        self.text = ""
        self.frames = 0
        self.usage: dict[str, Any] | None = None
        self.ids: set[str] = set()
        self.errors: list[Any] = []
        self.done = False
        self.task = asyncio.ensure_future(self._run(base))

    async def _run(self, base: str) -> None:
        headers = {"X-Request-Id": self.request_id}
        async with httpx.AsyncClient(timeout=120) as client:
            if not self.payload["stream"]:
                response = await client.post(base + self.path, json=self.payload, headers=headers)
                assert response.status_code == 200, response.text
                data = response.json()
                choice = data["choices"][0]
                self.text = choice["message"]["content"] if self.chat else choice["text"]
                self.usage = data["usage"]
                self.done = True
                return
            async with client.stream(
                "POST", base + self.path, json=self.payload, headers=headers
            ) as response:
                assert response.status_code == 200
                self.instance = response.headers.get("x-kvherd-instance")
                async for line in response.aiter_lines():
                    assert not line.startswith(":"), "a ledger line reached the client"
                    if not line.startswith("data: "):
                        continue
                    if line == "data: [DONE]":
                        self.done = True
                        continue
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        self.errors.append(chunk)
                        continue
                    self.ids.add(chunk["id"])
                    if chunk.get("usage"):
                        self.usage = chunk["usage"]
                    for choice in chunk["choices"]:
                        assert "token_ids" not in choice  # not asked for: stripped
                        self.frames += 1
                        if self.chat:
                            self.text += choice["delta"].get("content") or ""
                        else:
                            self.text += choice["text"]

    async def result(self) -> Run:
        await asyncio.wait_for(self.task, 180)
        return self


async def reference(agent: AgentProcess, payload: dict[str, Any], chat: bool) -> Run:
    """The undisturbed output, straight from an agent."""
    return await Run(agent.url, payload, chat).result()


VARIANTS = [
    (sampling, chat) for sampling in (GREEDY, SEEDED) for chat in (False, True)
]  # fmt: skip


async def start_streams(base: str) -> list[Run]:
    # Every variant twice: with round robin over two instances each runs once on each.
    runs = []
    for sampling, chat in VARIANTS:
        for _ in range(2):
            runs.append(Run(base, body(sampling, chat, stream=True), chat))
            await asyncio.sleep(0)
    return runs


async def victim_of(runs: list[Run]) -> str:
    """The instance of the first stream, once every stream is mid-way."""

    def started() -> bool:
        return all(run.frames >= 20 for run in runs)

    await wait_for(started, timeout=60, interval=0.002)
    victim = runs[0].instance
    assert victim is not None
    return victim


async def check(runs: list[Run], survivor: AgentProcess) -> None:
    for run in runs:
        await run.result()
        expected = await reference(survivor, run.payload, run.chat)
        assert run.errors == [], run.errors
        assert run.done
        assert run.text == expected.text, f"{run.request_id}: output differs"
        assert run.usage is not None and expected.usage is not None
        # Cached tokens depend on what each instance held: everything else is the same.
        run.usage.pop("prompt_tokens_details")
        expected.usage.pop("prompt_tokens_details")
        assert run.usage == expected.usage, (run.usage, expected.usage)
        assert len(run.ids) <= 1  # one stream id from the first chunk to the last


def metric(text: str, name: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name):
            total += float(line.rsplit(" ", 1)[1])
    return total


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP], ids=["killed", "hung"])
async def test_streams_and_plain_requests_survive_their_instance(
    pair: list[AgentProcess], sig: signal.Signals
) -> None:
    async with running_proxy(pair, *FLAGS) as proxy:
        fleet = proxy.fleet
        runs = await start_streams(proxy.url)
        victim_id = await victim_of(runs)
        victim = next(a for a in pair if fleet.instances[victim_id].url == a.url)
        survivor = next(a for a in pair if a is not victim)
        on_victim = [run for run in runs if run.instance == victim_id]
        assert len(on_victim) == len(VARIANTS)
        loop = asyncio.get_running_loop()
        os.kill(victim.process.pid, sig)
        went = loop.time()
        # Plain requests sent now: some go to the lost instance before it is ejected.
        plain = [Run(proxy.url, body(GREEDY, chat, stream=False), chat) for chat in (False, True)]
        plain += [Run(proxy.url, body(SEEDED, False, stream=False), False) for _ in range(2)]
        await check(runs + plain, survivor)
        # The feature's bound: seconds (deadlines 2 s, probes 0.5 s), not a client timeout.
        assert loop.time() - went < 60
        await wait_for(lambda: not fleet.cluster.get(victim_id).healthy, timeout=30)
        async with httpx.AsyncClient() as client:
            text = (await client.get(f"{proxy.url}/metrics")).text
        assert metric(text, 'kvherd_continuations_total{outcome="continued"}') >= len(on_victim)
        assert metric(text, 'kvherd_continuations_total{outcome="gave_up"}') == 0


async def test_a_stream_with_no_instance_left_ends_with_an_error_frame(
    pair: list[AgentProcess],
) -> None:
    async with running_proxy(pair, *FLAGS, "--max-continuations", "1") as proxy:
        runs = [Run(proxy.url, body(GREEDY, False, stream=True), False) for _ in range(2)]
        await wait_for(lambda: all(run.frames >= 20 for run in runs), timeout=60, interval=0.002)
        for agent in pair:
            os.kill(agent.process.pid, signal.SIGKILL)
        for run in runs:
            await run.result()
            assert run.done
            assert len(run.errors) == 1
            assert run.errors[0]["error"]["type"] == "server_error"
