"""The agent's migration endpoints over real HTTP: two agents (the agent app plus the migration
router, served by uvicorn on loopback) migrate a request a client is streaming from."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
import uvicorn
from agent_process import free_port

from instance_agent.engine.llm_engine import EngineConfig, LLMEngine
from instance_agent.engine_loop import EngineLoop
from instance_agent.metrics import AgentMetrics
from instance_agent.migration_routes import (
    MigrationService,
    MigrationSettings,
    create_migration_router,
)
from instance_agent.server import Agent, create_app
from migration.core.protocol import MigrationOutcome, MigrationStatus
from migration.executor import MigrationExecutor
from policies.views import MigrationOrder

pytestmark = pytest.mark.timeout(120)

PROMPT = [(i * 13 + 5) % 250 for i in range(70)]


@dataclass
class LiveAgent:
    url: str
    engine: LLMEngine
    service: MigrationService


@contextlib.asynccontextmanager
async def serve_agent(
    num_blocks: int = 300,
    released: list[tuple[str, str, int]] | None = None,
    served_model: str = "tiny",
) -> AsyncIterator[LiveAgent]:
    engine = LLMEngine(
        EngineConfig(model="tiny", block_size=4, num_gpu_blocks=num_blocks, max_model_len=512)
    )
    metrics = AgentMetrics("tiny", {"block_size": "4"})
    engine_loop = EngineLoop(engine, metrics=metrics)
    port = free_port()
    agent = Agent(engine_loop, metrics, f"127.0.0.1:{port}", "tiny", "tiny")
    app = create_app(agent)
    service = MigrationService(
        engine_loop,
        agent.instance_id,
        settings=MigrationSettings(transfer_timeout_s=5.0),
        on_released=None if released is None else lambda *args: released.append(args),
        served_model=served_model,
    )
    app.include_router(create_migration_router(service))
    server = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on")
    )
    task = asyncio.create_task(server.serve())
    await poll(lambda: server.started)
    try:
        yield LiveAgent(f"http://127.0.0.1:{port}", engine, service)
    finally:
        server.should_exit = True
        await task


async def poll(predicate: Callable[[], bool], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.005)


@pytest.fixture
def released() -> list[tuple[str, str, int]]:
    """(request id, destination, next token index) of every request that left the source."""
    return []


@pytest.fixture
async def agents(
    released: list[tuple[str, str, int]],
) -> AsyncIterator[tuple[LiveAgent, LiveAgent]]:
    async with serve_agent(released=released) as a, serve_agent() as b:
        yield a, b


async def stream_tokens(client: httpx.AsyncClient, url: str, rid: str, seen: list[int]) -> str:
    """Stream a completion, appending each chunk's token ids to `seen`; returns the finish reason."""
    body = {
        "model": "tiny",
        "prompt": PROMPT,
        "max_tokens": 300,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "return_token_ids": True,
    }
    finish = ""
    async with client.stream(
        "POST", f"{url}/v1/completions", json=body, headers={"X-Request-Id": rid}
    ) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "kvherd" in chunk:
                assert chunk["kvherd"]["index"] == len(seen)  # exactly once, in order
                seen.extend(chunk["kvherd"]["token_ids"])
            if chunk["choices"]:
                finish = chunk["choices"][0].get("finish_reason") or finish
    return finish


def no_blocks_held(agent: LiveAgent) -> bool:
    return agent.engine.block_manager.owners() == []


async def test_refused_migration_leaves_the_stream_untouched() -> None:
    async with (
        serve_agent() as a,
        serve_agent(num_blocks=8) as small,
        serve_agent(served_model="other") as other,  # same geometry, another model's name
    ):
        async with httpx.AsyncClient(timeout=60) as client:
            for rid, dst, why in (("r1", small, "blocks"), ("r1b", other, "model 'tiny'")):
                seen: list[int] = []
                streaming = asyncio.create_task(stream_tokens(client, a.url, rid, seen))
                await poll(lambda seen=seen: len(seen) >= 3)
                response = await client.post(
                    f"{a.url}/kvherd/v1/migrate", json={"request_id": rid, "dst": dst.url}
                )
                assert response.status_code == 200
                outcome = response.json()
                assert outcome["status"] == "aborted" and outcome["reason"] == "dst_refused"
                assert why in outcome["detail"], outcome
                assert await streaming == "length"
                assert len(seen) == 300
            assert outcome["bytes_sent"] == 0  # the model is checked before any copy
        for agent in (a, small, other):
            await poll(lambda agent=agent: no_blocks_held(agent))
            agent.engine.block_manager.check_integrity()


async def test_unreachable_destination_is_reported_and_harmless(
    agents: tuple[LiveAgent, LiveAgent],
) -> None:
    a, _ = agents
    async with httpx.AsyncClient(timeout=60) as client:
        seen: list[int] = []
        streaming = asyncio.create_task(stream_tokens(client, a.url, "r2", seen))
        await poll(lambda: len(seen) >= 3)
        dead = f"http://127.0.0.1:{free_port()}"
        outcome = (
            await client.post(f"{a.url}/kvherd/v1/migrate", json={"request_id": "r2", "dst": dead})
        ).json()
        assert outcome["status"] == "aborted" and outcome["reason"] == "dst_failed"
        assert await streaming == "length" and len(seen) == 300
    await poll(lambda: no_blocks_held(a))


async def test_migration_over_http_moves_the_request_and_its_blocks(
    agents: tuple[LiveAgent, LiveAgent], released: list[tuple[str, str, int]]
) -> None:
    a, b = agents
    async with httpx.AsyncClient(timeout=60) as client:
        seen: list[int] = []
        streaming = asyncio.create_task(stream_tokens(client, a.url, "r3", seen))
        await poll(lambda: len(seen) >= 3)
        outcome = (
            await client.post(f"{a.url}/kvherd/v1/migrate", json={"request_id": "r3", "dst": b.url})
        ).json()
        assert outcome["status"] == "committed", outcome
        assert outcome["blocks_sent"] >= len(PROMPT) // 4 and outcome["bytes_sent"] > 0
        assert 0 < outcome["downtime_s"] < outcome["duration_s"]
        assert "r3" not in a.engine.scheduler.requests
        adopted = b.engine.scheduler.requests["r3"]
        # The engine loop's hook learns where the stream continues, and from which token.
        ((rid, dst, next_index),) = released
        assert (rid, dst) == ("r3", b.url) and 3 <= next_index <= adopted.num_output_tokens
        assert a.service.outcomes == {"committed": 1}
        assert b.service.destination.committed == 1
        exposition = (await client.get(f"{a.url}/metrics")).text
        assert 'kvherd:migrations_out_total{outcome="committed"} 1.0' in exposition
        assert "kvherd:migration_downtime_seconds_count 1.0" in exposition
        # The source relays the rest of the client's stream from the destination.
        assert await streaming == "length" and len(seen) == 300
    await poll(lambda: no_blocks_held(a) and no_blocks_held(b))
    a.engine.block_manager.check_integrity()
    b.engine.block_manager.check_integrity()


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/kvherd/v1/migrate", {"request_id": "x"}, "dst"),
        ("/kvherd/v1/migrate", {"request_id": "x", "dst": "nowhere"}, "dst"),
        ("/kvherd/v1/migrate", [1, 2], None),
        ("/kvherd/v1/migration/reserve", {"migration_id": "m"}, "request_id"),
        ("/kvherd/v1/migration/commit", {"migration_id": "m", "state": {}}, "request_id"),
        ("/kvherd/v1/migration/abort", {"migration_id": 3, "reason": "x"}, "migration_id"),
    ],
)
async def test_bad_bodies_get_openai_errors(
    agents: tuple[LiveAgent, LiveAgent], path: str, body: Any, param: str | None
) -> None:
    a, _ = agents
    async with httpx.AsyncClient(timeout=30) as client:
        response = await client.post(f"{a.url}{path}", json=body)
        assert response.status_code == 400
        error = response.json()["error"]
        assert error["param"] == param and error["type"] == "invalid_request_error"
        garbage = await client.post(f"{a.url}{path}", content=b"{not json")
        assert garbage.status_code == 400 and "JSON" in garbage.json()["error"]["message"]


async def test_unknown_migration_commit_and_abort_are_answered(
    agents: tuple[LiveAgent, LiveAgent],
) -> None:
    _, b = agents
    state = {
        "request_id": "r",
        "prompt_token_ids": [1, 2],
        "output_token_ids": [3],
        "sampling_params": {"max_tokens": 4},
        "sampling_seed": 1,
        "num_computed_tokens": 2,
    }
    async with httpx.AsyncClient(timeout=30) as client:
        commit = await client.post(
            f"{b.url}/kvherd/v1/migration/commit", json={"migration_id": "m", "state": state}
        )
        assert commit.status_code == 200 and commit.json()["ok"] is False
        abort = await client.post(
            f"{b.url}/kvherd/v1/migration/abort", json={"migration_id": "m", "reason": "x"}
        )
        assert abort.json() == {"ok": True, "reason": None}


async def test_scheduler_executor_runs_orders_against_the_source_agent(
    agents: tuple[LiveAgent, LiveAgent],
) -> None:
    a, b = agents
    urls = {"a": a.url, "b": b.url}
    done: list[tuple[Any, MigrationOutcome | None]] = []
    async with httpx.AsyncClient(timeout=60) as client:
        executor = MigrationExecutor(client, urls.get, lambda o, out: done.append((o, out)))
        seen: list[int] = []
        streaming = asyncio.create_task(stream_tokens(client, a.url, "r4", seen))
        await poll(lambda: len(seen) >= 3)
        executor.execute(MigrationOrder("r4", "a", "b"))
        executor.execute(MigrationOrder("r4", "a", "gone"))  # unknown destination
        await executor.close()
        streaming.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await streaming
    outcomes = {order.dst: outcome for order, outcome in done}
    assert outcomes["gone"] is None
    committed = outcomes["b"]
    assert committed is not None and committed.status is MigrationStatus.COMMITTED
    assert "r4" in b.engine.scheduler.requests
    await b.service.engine_loop.call(lambda e: e.abort("r4"))
    await poll(lambda: no_blocks_held(a) and no_blocks_held(b))
