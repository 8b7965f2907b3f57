"""A client's stream follows its request to another agent: exactly once, and nothing leaks."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import pytest
import uvicorn
from agent_process import free_port

from instance_agent import relay
from instance_agent.engine.core.request import SamplingParams
from instance_agent.engine.llm_engine import EngineConfig, LLMEngine, RequestOutput
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
    metrics = AgentMetrics("tiny", {})
    loop = EngineLoop(engine, detached_ttl_s=detached_ttl_s, metrics=metrics)
    port = free_port()
    agent = Agent(loop, metrics, f"dst:{port}", "tiny", "tiny")
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


async def _move(src: EngineLoop, dst: EngineLoop, request_id: str) -> dict[str, Any]:
    """Migrate a running request with the engines' own hooks (what the migration layer does);
    returns its state as it left."""

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
    return state


def _follow(
    client: httpx.AsyncClient, url: str, request_id: str, state: dict[str, Any]
) -> AsyncIterator[tuple[int, RequestOutput]]:
    """What the migration layer hands off to: the destination's stream from the released state."""
    return relay.follow(
        client,
        url,
        request_id,
        start=len(state["output_token_ids"]),
        num_prompt_tokens=len(state["prompt_token_ids"]),
        num_cached_tokens=max(state["num_cached_tokens"], 0),
    )


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
            state = await _move(source, destination, "m1")
            source.hand_off("m1", _follow(client, url, "m1", state))
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


async def test_relay_follows_the_request_when_it_migrates_again() -> None:
    """Source -> B, then B -> C: B ends the relay's stream with a migration notice and the relay
    resumes at C, so B leaves the path and the client still gets every token exactly once."""
    expected = _engine().generate([PROMPT], _params())[0]
    source = EngineLoop(_engine())
    source.start()
    try:
        async with (
            _served() as (b_url, b),
            _served() as (c_url, c),
            httpx.AsyncClient(timeout=30) as client,
        ):
            stream = await source.add("m5", PROMPT, _params())
            tokens: list[int] = []
            text = ""

            async def take(count: int) -> None:
                nonlocal text
                async for output in stream:
                    tokens.extend(output.new_token_ids)
                    text += output.text_delta
                    if len(tokens) >= count:
                        return

            await take(5)
            state = await _move(source, b, "m5")
            source.hand_off("m5", _follow(client, b_url, "m5", state))
            await take(10)  # relayed from B: B's stream is attached
            await _move(b, c, "m5")
            b.redirect("m5", c_url)  # what B's migration layer does for a reattaching client
            await take(len(expected.output_token_ids))
            assert tokens == expected.output_token_ids
            assert text == expected.text
            assert stream.finished
            await _poll(lambda: _idle(b))
            await _poll(lambda: _idle(c))
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
            state = await _move(source, destination, "m2")
            source.hand_off("m2", _follow(client, url, "m2", state))
            await anext(stream)  # a token relayed from the destination
            assert await destination.call(lambda e: "m2" in e.scheduler.requests)
            stream.close()  # the client went away
            await _poll(lambda: _idle(destination))
        await _poll(lambda: _idle(source))
    finally:
        source.stop()


async def test_resuming_and_hanging_up_aborts_an_orphaned_copy() -> None:
    """What the source does when the client left while its request moved (no TTL wait)."""
    source = EngineLoop(_engine())
    source.start()
    try:
        async with _served(detached_ttl_s=300) as (url, destination):
            stream = await source.add("m6", PROMPT, SamplingParams(max_tokens=1500, seed=1))
            await anext(stream)
            state = await _move(source, destination, "m6")
            stream.close()
            assert await destination.call(lambda e: "m6" in e.scheduler.requests)
            resume = relay.resume_object("m6", len(state["output_token_ids"]), len(PROMPT))
            async with (
                httpx.AsyncClient(timeout=30) as client,
                client.stream("POST", f"{url}/kvherd/v1/requests/m6/resume", json=resume) as r,
            ):
                assert r.status_code == 200
            await _poll(lambda: _idle(destination))
            assert destination.metrics is not None
            rendered = destination.metrics.render().decode()
            # Aborted, not run to its end.
            assert 'finished_reason="abort"' in rendered
            assert 'finished_reason="length"' not in rendered
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
                resume = relay.resume_object("m3", 1, len(PROMPT))
                missing = await client.post(
                    f"{url}/kvherd/v1/requests/m3/resume?wait=0.05", json=resume
                )
                assert missing.status_code == 404
                assert missing.json()["error"]["code"] == "request_not_found"
                with pytest.raises(relay.RelayError, match="404"):
                    state = {"output_token_ids": [], "prompt_token_ids": [], "num_cached_tokens": 0}
                    async for _ in _follow(client, url, "nope", state):
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
            state = {"output_token_ids": [0], "prompt_token_ids": PROMPT, "num_cached_tokens": 0}
            source.hand_off("m4", _follow(client, dead, "m4", state))
            with pytest.raises(RequestAborted, match="lost in transit"):
                async for _ in stream:
                    pass
        await _poll(lambda: _idle(source))
    finally:
        source.stop()
