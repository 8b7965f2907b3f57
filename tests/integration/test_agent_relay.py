"""A client's stream follows its request to another agent: exactly once, and nothing leaks."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable

import httpx
import pytest
import uvicorn
from agent_process import free_port

from instance_agent import relay
from instance_agent.engine.core.request import SamplingParams
from instance_agent.engine.llm_engine import EngineConfig, LLMEngine
from instance_agent.engine_loop import EngineLoop, RequestAborted
from instance_agent.metrics import AgentMetrics
from instance_agent.server import Agent, create_app

PROMPT = [(i * 7 + 3) % 250 for i in range(40)]


def _engine() -> LLMEngine:
    return LLMEngine(EngineConfig(model="tiny", seed=0, num_gpu_blocks=128, device="cpu"))


def _params() -> SamplingParams:
    return SamplingParams(max_tokens=60, temperature=0.9, seed=21, ignore_eos=True)


async def _poll(condition: Callable[[], object], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not await condition():  # type: ignore[misc]
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.01)


@contextlib.asynccontextmanager
async def _served(detached_ttl_s: float = 30.0) -> AsyncIterator[tuple[str, EngineLoop]]:
    """An agent app on loopback, in this event loop (the destination)."""
    engine = _engine()
    loop = EngineLoop(engine, detached_ttl_s=detached_ttl_s)
    port = free_port()
    agent = Agent(loop, AgentMetrics("tiny", {}), f"dst:{port}", "tiny", "tiny")
    server = uvicorn.Server(
        uvicorn.Config(create_app(agent), host="127.0.0.1", port=port, log_level="warning")
    )
    task = asyncio.create_task(server.serve())
    while not server.started:
        await asyncio.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}", loop
    finally:
        server.should_exit = True
        await task


async def _move(src: EngineLoop, dst: EngineLoop, request_id: str) -> None:
    """Migrate a running request with the engines' own hooks (what the migration layer does)."""

    def export(engine: LLMEngine) -> tuple[dict[str, object], list[int], object]:
        engine.suspend(request_id)
        blocks, _ = engine.request_blocks(request_id)
        return engine.export_request_state(request_id), blocks, engine.read_kv(blocks).clone()

    state, blocks, kv = await src.call(export)

    def adopt(engine: LLMEngine) -> None:
        owner = f"reservation-{request_id}"
        reserved = engine.reserve_blocks(owner, len(blocks))
        assert reserved is not None
        engine.write_kv(reserved, kv)  # type: ignore[arg-type]
        engine.adopt_request(state, reserved, owner)

    await dst.call(adopt)
    await src.call(lambda engine: engine.release_migrated(request_id))


async def _idle(loop: EngineLoop) -> bool:
    busy, free, total = await loop.call(
        lambda e: (e.has_unfinished(), e.block_manager.num_free_blocks, e.block_manager.num_blocks)
    )
    return not busy and free == total and loop.num_open_requests == 0


async def test_stream_continues_exactly_once_from_the_destination() -> None:
    expected = _engine().generate([PROMPT], _params())[0]
    source = EngineLoop(_engine())
    source.start()
    try:
        async with _served() as (url, destination), httpx.AsyncClient(timeout=30) as client:
            stream = await source.add("m1", PROMPT, _params())
            tokens: list[int] = []
            text = ""
            async for output in stream:
                tokens += output.new_token_ids
                text += output.text_delta
                if len(tokens) >= 5:
                    break
            await _move(source, destination, "m1")
            source.hand_off("m1", relay.follow(client, url, "m1"))
            async for output in stream:
                tokens += output.new_token_ids
                text += output.text_delta
            assert tokens == expected.output_token_ids  # nothing lost, nothing repeated
            assert text == expected.text
            assert output.finished and output.finish_reason == "length"
            await _poll(lambda: _idle(destination))
        await _poll(lambda: _idle(source))
    finally:
        source.stop()


async def test_client_leaving_mid_relay_frees_the_destination() -> None:
    source = EngineLoop(_engine())
    source.start()
    try:
        async with _served() as (url, destination), httpx.AsyncClient(timeout=30) as client:
            stream = await source.add("m2", PROMPT, SamplingParams(max_tokens=1500, seed=1))
            await anext(stream)
            await _move(source, destination, "m2")
            source.hand_off("m2", relay.follow(client, url, "m2"))
            await anext(stream)  # a token relayed from the destination
            assert await destination.call(lambda e: "m2" in e.scheduler.requests)
            stream.close()  # the client went away
            await _poll(lambda: _idle(destination))
        await _poll(lambda: _idle(source))
    finally:
        source.stop()


async def test_unfollowed_request_is_aborted_and_unknown_ids_get_404() -> None:
    source = EngineLoop(_engine())
    source.start()
    try:
        async with _served(detached_ttl_s=0.2) as (url, destination):
            stream = await source.add("m3", PROMPT, SamplingParams(max_tokens=1500, seed=1))
            await anext(stream)
            await _move(source, destination, "m3")
            stream.close()
            await _poll(lambda: _idle(destination))  # nobody attached within the TTL
            async with httpx.AsyncClient(timeout=30) as client:
                missing = await client.get(f"{url}/kvherd/v1/requests/m3/stream?wait=0.05")
                assert missing.status_code == 404
                assert missing.json()["error"]["code"] == "request_not_found"
                with pytest.raises(relay.RelayError, match="404"):
                    async for _ in relay.follow(client, url, "nope"):
                        pass
    finally:
        source.stop()


async def test_relay_failure_ends_the_client_stream_clearly() -> None:
    source = EngineLoop(_engine())
    source.start()
    try:
        stream = await source.add("m4", PROMPT, SamplingParams(max_tokens=1500, seed=1))
        await anext(stream)
        await source.call(lambda e: e.release_migrated("m4"))
        async with httpx.AsyncClient(timeout=5) as client:
            dead = f"http://127.0.0.1:{free_port()}"
            source.hand_off("m4", relay.follow(client, dead, "m4"))
            with pytest.raises(RequestAborted, match="lost in transit"):
                async for _ in stream:
                    pass
        await _poll(lambda: _idle(source))
    finally:
        source.stop()
