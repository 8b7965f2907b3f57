"""Bounded work per request behind ``kvherd serve``: limits aligned with the fleet, heavy work off
the event loop.

Two real agents (``--max-model-len 512``) behind an in-process proxy (it shares this test's event
loop, so a stall of the proxy's loop is a stall of the ticker below):
- the body limit is the agents' (`kvherd.wire.MAX_BODY_BYTES`): a larger body gets the proxy's 400,
  never a 502 from an agent refusing it;
- a prompt longer than the fleet's ``max_model_len`` (learned from the agents' ``/v1/models``) gets
  vLLM's 400 (``context_length_exceeded``) from the proxy, before any instance sees it;
- four concurrent prompts of nearly 4 MiB are tokenized off the loop: the loop keeps ticking
  (the longest stall is printed, and bounded generously).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from agent_process import AgentProcess
from test_proxy import agents, running_proxy

from kvherd.wire import MAX_BODY_BYTES

pytestmark = pytest.mark.timeout(300)

MAX_MODEL_LEN = 512


@pytest.fixture(scope="module")
def short_agents() -> Iterator[list[AgentProcess]]:
    with agents(2, "--max-model-len", str(MAX_MODEL_LEN)) as started:
        yield started


def served(metrics: str) -> float:
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in metrics.splitlines()
        if line.startswith("vllm:request_success_total")
    )


async def test_limits_follow_the_fleet(short_agents: list[AgentProcess]) -> None:
    async with running_proxy(short_agents) as proxy, httpx.AsyncClient(timeout=60) as client:
        assert proxy.fleet.instances  # every agent said its max_model_len
        for inst in proxy.fleet.instances.values():
            assert inst.spec.max_model_len == MAX_MODEL_LEN
        before = [served((await client.get(a.url + "/metrics")).text) for a in short_agents]

        too_big = b'{"prompt": "' + b"a" * MAX_BODY_BYTES + b'"}'
        response = await client.post(
            proxy.url + "/v1/completions",
            content=too_big,
            headers={"content-type": "application/json"},
        )
        assert response.status_code == 400, response.text
        assert response.json()["error"]["code"] == "too_large"

        cases: list[tuple[dict[str, Any], str, str]] = [
            ({"prompt": [7] * MAX_MODEL_LEN}, "prompt", f"your prompt has {MAX_MODEL_LEN} tokens"),
            ({"prompt": [7] * 500, "max_tokens": 20}, "prompt", "you requested 520 tokens"),
            (
                {"messages": [{"role": "user", "content": "x" * 2000}], "max_tokens": 4},
                "messages",
                "in the messages",
            ),
        ]
        for body, param, says in cases:
            path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
            response = await client.post(proxy.url + path, json=body)
            assert response.status_code == 400, response.text
            error = response.json()["error"]
            assert error["code"] == "context_length_exceeded"
            assert error["param"] == param
            assert f"maximum context length is {MAX_MODEL_LEN} tokens" in error["message"]
            assert says in error["message"]
        ok = await client.post(
            proxy.url + "/v1/completions", json={"prompt": [7] * 500, "max_tokens": 12}
        )
        assert ok.status_code == 200, ok.text
        after = [served((await client.get(a.url + "/metrics")).text) for a in short_agents]
        assert sum(after) - sum(before) == 1  # only the one that fits reached an agent


async def test_huge_prompts_are_tokenized_off_the_loop(short_agents: list[AgentProcess]) -> None:
    text = "hello llamas " * ((MAX_BODY_BYTES - 1024) // 13)
    async with running_proxy(short_agents) as proxy, httpx.AsyncClient(timeout=120) as client:
        stalls: list[float] = []
        done = asyncio.Event()

        async def ticker() -> None:
            while not done.is_set():
                start = time.monotonic()
                await asyncio.sleep(0.005)
                stalls.append(time.monotonic() - start - 0.005)

        ticking = asyncio.create_task(ticker())
        responses = await asyncio.gather(
            *(
                client.post(proxy.url + "/v1/completions", json={"prompt": text, "max_tokens": 4})
                for _ in range(4)
            )
        )
        done.set()
        await ticking
    for response in responses:
        assert response.status_code == 400, response.text
        assert response.json()["error"]["code"] == "context_length_exceeded"
    print(f"\nlongest loop stall with four {len(text) >> 20} MiB prompts: {max(stalls):.3f} s")
    assert max(stalls) < 1.0
