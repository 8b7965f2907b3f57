"""LoRA adapters through real agents (the agent app plus the migration router on loopback).

`/v1/models` lists the adapters as vLLM does (``parent``, ``root``); a request naming one runs with
it and its responses name it; an unknown name is the 404. A streamed adapter request migrated
to an agent serving the same adapter continues with exactly the tokens it would have produced;
to an agent without it the migration is refused before any KV is copied and the request finishes
at the source, unchanged. With runtime loading, vLLM's load/unload routes answer as vLLM does, an
adapter loaded at run time gives the tokens of one loaded at start, and a full set of slots evicts
the least recently used adapter that no request runs with.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import uvicorn
from agent_process import free_port
from lora_adapters import write_adapter

from instance_agent.engine.config import PRESETS
from instance_agent.engine.llm_engine import EngineConfig, LLMEngine
from instance_agent.engine_loop import EngineLoop
from instance_agent.lora_routes import create_lora_router
from instance_agent.metrics import AgentMetrics
from instance_agent.migration_routes import (
    MigrationService,
    MigrationSettings,
    create_migration_router,
)
from instance_agent.server import Agent, create_app
from scheduler.core.load_report import parse_agent_state

pytestmark = pytest.mark.timeout(120)

PROMPT = [(i * 7 + 3) % 250 for i in range(50)]


@dataclass
class LiveAgent:
    url: str
    engine: LLMEngine


@contextlib.asynccontextmanager
async def serve_agent(
    adapters: dict[str, str], max_loras: int | None = None, runtime_lora: bool = False
) -> AsyncIterator[LiveAgent]:
    engine = LLMEngine(
        EngineConfig(
            model="tiny",
            block_size=4,
            num_gpu_blocks=300,
            lora_modules=adapters,
            max_loras=max_loras,
        )
    )
    metrics = AgentMetrics("tiny", {"block_size": "4"})
    engine_loop = EngineLoop(engine, metrics=metrics)
    port = free_port()
    agent = Agent(
        engine_loop, metrics, f"127.0.0.1:{port}", "tiny", "tiny", runtime_lora=runtime_lora
    )
    app = create_app(agent, routers=[create_lora_router(agent)] if runtime_lora else ())
    settings = MigrationSettings(transfer_timeout_s=5.0)
    app.include_router(
        create_migration_router(MigrationService(engine_loop, agent.instance_id, settings=settings))
    )
    server = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on")
    )
    task = asyncio.create_task(server.serve())
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline
        await asyncio.sleep(0.005)
    try:
        yield LiveAgent(f"http://127.0.0.1:{port}", engine)
    finally:
        server.should_exit = True
        await task


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root: Path = tmp_path_factory.mktemp("agent_adapters")
    return {
        name: str(write_adapter(root / name, PRESETS["tiny"], seed=i))
        for i, name in enumerate("ABC")
    }


def _body(model: str, max_tokens: int, stream: bool) -> dict[str, object]:
    return {
        "model": model,
        "prompt": PROMPT,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": stream,
        "return_token_ids": True,
    }


async def test_models_404_and_adapter_requests(adapters: dict[str, str]) -> None:
    async with (
        serve_agent({k: adapters[k] for k in "AB"}) as agent,
        httpx.AsyncClient(timeout=60) as client,
    ):
        listed = (await client.get(f"{agent.url}/v1/models")).json()["data"]
        assert [(m["id"], m["parent"], m["root"]) for m in listed] == [
            ("tiny", None, "tiny"),
            ("A", "tiny", adapters["A"]),
            ("B", "tiny", adapters["B"]),
        ]
        # The load report says which adapters it holds, for the proxy's LoRA affinity.
        report = parse_agent_state((await client.get(f"{agent.url}/kvherd/v1/state")).json())
        assert report.active_adapters == ("A", "B") and report.lora_slots == 2
        missing = await client.post(f"{agent.url}/v1/completions", json=_body("C", 4, False))
        assert missing.status_code == 404
        assert missing.json()["error"] == {  # vLLM's own answer, byte for byte
            "message": "The model `C` does not exist. Valid aliases: tiny.",
            "type": "NotFoundError",
            "param": "model",
            "code": 404,
        }
        outputs = {}
        for model in ("tiny", "A", "B"):
            answer = await client.post(f"{agent.url}/v1/completions", json=_body(model, 8, False))
            assert answer.status_code == 200 and answer.json()["model"] == model
            outputs[model] = tuple(answer.json()["choices"][0]["token_ids"])
        assert len(set(outputs.values())) == 3  # each adapter is applied


async def _stream(client: httpx.AsyncClient, url: str, rid: str, seen: list[int]) -> str:
    finish = ""
    async with client.stream(
        "POST", f"{url}/v1/completions", json=_body("A", 200, True), headers={"X-Request-Id": rid}
    ) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("choices"):
                seen.extend(chunk["choices"][0].get("token_ids") or [])
                finish = chunk["choices"][0].get("finish_reason") or finish
    return finish


async def _wait(predicate: object, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():  # type: ignore[operator]
        assert time.monotonic() < deadline
        await asyncio.sleep(0.005)


async def test_adapter_request_migrates_only_to_an_agent_serving_the_adapter(
    adapters: dict[str, str],
) -> None:
    async with (
        serve_agent(adapters) as src,
        serve_agent({"A": adapters["A"]}) as same,
        serve_agent({"B": adapters["B"]}) as other,
        httpx.AsyncClient(timeout=60) as client,
    ):
        expected: list[int] = []
        assert await _stream(client, src.url, "solo", expected) == "length"
        for dst, rid in ((other, "refused"), (same, "moved")):
            seen: list[int] = []
            streaming = asyncio.create_task(_stream(client, src.url, rid, seen))
            await _wait(lambda seen=seen: len(seen) >= 3)
            outcome = (
                await client.post(
                    f"{src.url}/kvherd/v1/migrate", json={"request_id": rid, "dst": dst.url}
                )
            ).json()
            if dst is other:  # refused at its first reservation: not one block was copied
                assert outcome["status"] == "aborted", outcome
                assert outcome["reason"] == "dst_refused", outcome
                assert "LoRA adapter 'A'" in outcome["detail"]
                assert outcome["blocks_sent"] == outcome["bytes_sent"] == 0, outcome
            else:
                assert outcome["status"] == "committed", outcome
            assert await streaming == "length"
            assert seen == expected, rid
        for agent in (src, same, other):
            await _wait(lambda agent=agent: agent.engine.block_manager.owners() == [])


async def _completion(client: httpx.AsyncClient, url: str, model: str) -> tuple[int, ...]:
    answer = await client.post(f"{url}/v1/completions", json=_body(model, 8, False))
    assert answer.status_code == 200, answer.text
    return tuple(answer.json()["choices"][0]["token_ids"])


async def _models(client: httpx.AsyncClient, url: str) -> list[str]:
    return [m["id"] for m in (await client.get(f"{url}/v1/models")).json()["data"]]


async def test_runtime_loading_answers_as_vllm_and_evicts_the_least_recently_used(
    adapters: dict[str, str], tmp_path: Path
) -> None:
    async with (
        serve_agent({"A": adapters["A"], "B": adapters["B"]}) as ref,
        serve_agent({"A": adapters["A"]}, max_loras=2, runtime_lora=True) as agent,
        httpx.AsyncClient(timeout=60) as client,
    ):
        load, unload = f"{agent.url}/v1/load_lora_adapter", f"{agent.url}/v1/unload_lora_adapter"
        assert (await client.post(f"{ref.url}/v1/load_lora_adapter", json={})).status_code == 404
        answer = await client.post(load, json={"lora_name": "B", "lora_path": adapters["B"]})
        assert answer.status_code == 200
        assert answer.text == "Success: LoRA adapter 'B' added successfully."
        assert await _models(client, agent.url) == ["tiny", "A", "B"]
        # Loaded at run time or at start: the very same tokens.
        assert await _completion(client, agent.url, "B") == await _completion(client, ref.url, "B")
        again = await client.post(load, json={"lora_name": "B", "lora_path": adapters["B"]})
        assert (
            again.status_code == 400 and "already been loaded" in again.json()["error"]["message"]
        )
        missing = await client.post(load, json={"lora_name": "D", "lora_path": str(tmp_path)})
        assert missing.status_code == 404
        assert missing.json()["error"]["type"] == "NotFoundError"
        own = await client.post(load, json={"lora_name": "tiny", "lora_path": adapters["C"]})
        assert own.status_code == 400
        bad = await client.post(load, json={"lora_name": 3, "lora_path": adapters["C"]})
        assert bad.status_code == 400 and bad.json()["error"]["type"] == "invalid_request_error"
        # Both slots are full and A was used last: loading C evicts B.
        await _completion(client, agent.url, "A")
        answer = await client.post(load, json={"lora_name": "C", "lora_path": adapters["C"]})
        assert answer.status_code == 200, answer.text
        assert await _models(client, agent.url) == ["tiny", "A", "C"]
        gone = await client.post(f"{agent.url}/v1/completions", json=_body("B", 4, False))
        assert gone.status_code == 404
        # A name keeps its weights: B again from another path would hit KV B's weights computed.
        moved = await client.post(load, json={"lora_name": "B", "lora_path": adapters["C"]})
        assert moved.status_code == 400 and "cannot be loaded from" in moved.text
        # An adapter a running request uses is neither unloaded nor evicted.
        seen: list[int] = []
        streaming = asyncio.create_task(_stream(client, agent.url, "busy", seen))
        await _wait(lambda: len(seen) >= 2)
        busy = await client.post(unload, json={"lora_name": "A"})
        assert busy.status_code == 400 and "requests running" in busy.text
        assert (await client.post(unload, json={"lora_name": "C"})).status_code == 200
        full = await client.post(load, json={"lora_name": "B", "lora_path": adapters["B"]})
        assert full.status_code == 200, full.text  # the free slot, A untouched
        blocked = await client.post(load, json={"lora_name": "X", "lora_path": adapters["C"]})
        assert blocked.status_code == 200  # evicts B (idle), not A (running)
        assert await _models(client, agent.url) == ["tiny", "A", "X"]
        assert await streaming == "length"
        unknown = await client.post(unload, json={"lora_name": "nope"})
        assert unknown.status_code == 404
        state = (await client.get(f"{agent.url}/kvherd/v1/state")).json()
        assert state["runtime_lora"] is True and state["lora_slots"] == 2
        await _wait(lambda: agent.engine.block_manager.owners() == [])
