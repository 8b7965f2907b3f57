"""The engine thread in-process: one thread touches the engine, streams, aborts, idle sleep."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from instance_agent.engine.core.request import InvalidRequestError, SamplingParams
from instance_agent.engine.llm_engine import EngineConfig, LLMEngine
from instance_agent.engine_loop import EngineLoop, RequestAborted
from instance_agent.state import StepLatencyWindow


@pytest.fixture(scope="module")
def engine() -> LLMEngine:
    return LLMEngine(EngineConfig(model="tiny", seed=0, num_gpu_blocks=64, device="cpu"))


def _params(max_tokens: int, seed: int = 1) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, seed=seed, ignore_eos=True)


async def test_streams_match_engine_and_run_on_one_thread(engine: LLMEngine) -> None:
    expected = engine.generate([[5, 6, 7]], _params(6))[0].output_token_ids
    loop = EngineLoop(engine, step_latency=StepLatencyWindow())
    loop.start()
    try:
        assert await loop.call(lambda e: threading.current_thread().name) == "engine-loop"
        stream = await loop.add("a", [5, 6, 7], _params(6))
        ids: list[int] = []
        async for output in stream:
            ids += output.new_token_ids
        assert ids == expected and output.finished and output.finish_reason == "length"
        assert loop.num_open_requests == 0
        assert loop.step_latency.total_steps >= 6
    finally:
        loop.stop()


async def test_refusal_and_early_close_leave_nothing_behind(engine: LLMEngine) -> None:
    loop = EngineLoop(engine)
    loop.start()
    try:
        total = await loop.call(lambda e: e.block_manager.num_blocks)
        with pytest.raises(InvalidRequestError):
            await loop.add("bad", [1, 2], _params(10**9))
        stream = await loop.add("long", list(range(40)), _params(500))
        first = await anext(stream)
        assert first.new_token_ids
        assert await loop.call(lambda e: e.block_manager.num_free_blocks) < total
        stream.close()  # the client went away
        await asyncio.wait_for(loop.wait_idle(), 10)

        async def freed() -> bool:
            state = await loop.call(lambda e: (e.has_unfinished(), e.block_manager.num_free_blocks))
            return state == (False, total)

        deadline = time.monotonic() + 10
        while not await freed():
            assert time.monotonic() < deadline, "blocks of the closed stream were not freed"
    finally:
        loop.stop()


async def test_agent_abort_ends_the_stream(engine: LLMEngine) -> None:
    loop = EngineLoop(engine)
    loop.start()
    try:
        stream = await loop.add("victim", [9, 9, 9], _params(500))
        await anext(stream)
        loop.abort("victim")
        with pytest.raises(RequestAborted):
            async for _ in stream:
                pass
    finally:
        loop.stop()


async def test_idle_engine_thread_sleeps(engine: LLMEngine) -> None:
    loop = EngineLoop(engine)
    loop.start()
    try:
        stream = await loop.add("x", [1, 2, 3], _params(3))
        async for _ in stream:
            pass
        # An idle agent must not spin: over a quarter second the process uses almost no CPU.
        cpu, wall = time.process_time(), time.monotonic()
        await asyncio.sleep(0.25)
        assert time.process_time() - cpu < 0.05 * (time.monotonic() - wall) + 0.01
    finally:
        loop.stop()


async def test_batches_coalesce_outputs_that_queued_up(engine: LLMEngine) -> None:
    expected = engine.generate([[4, 4, 4]], _params(40, seed=3))[0].output_token_ids
    loop = EngineLoop(engine)
    loop.start()
    try:
        stream = await loop.add("pile", [4, 4, 4], _params(40, seed=3))

        def generated(e: LLMEngine) -> int:
            request = e.scheduler.requests.get("pile")
            return 40 if request is None else request.num_output_tokens

        while await loop.call(generated) < 5:  # outputs pile up while nobody reads
            pass
        # Deliveries are FIFO on the event loop, so those outputs are queued by now.
        batches = [batch async for batch in stream.batches()]
        assert len(batches[0]) >= 5
        assert [t for batch in batches for out in batch for t in out.new_token_ids] == expected
        assert batches[-1][-1].finished
    finally:
        loop.stop()
