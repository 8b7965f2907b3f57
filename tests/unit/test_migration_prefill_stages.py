"""A migration session opened before the prefill (a P/D handoff reserving at admission): its
transitions, and the agents' asyncio driver moving a chunked prefill's blocks while it computes."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import TypeVar

import pytest

from instance_agent.engine.core.request import SamplingParams
from migration.core.protocol import AbortReason, MigratableEngine
from migration.core.session import (
    Abort,
    Commit,
    Copy,
    Done,
    Release,
    RequestSnapshot,
    Reserve,
    Snapshot,
    SourceSession,
    Wait,
)
from migration.core.stages import StageConfig

T = TypeVar("T")
BS = 4
HELD = StageConfig(max_live_stages=0)  # a prefill-only instance's handoff stages
PROMPT_TOKENS = 41  # 11 blocks, 10 full
BLOCKS = list(range(100, 111))
HASHES = list(range(10))


def _prefilling(num_kv: int, phase: str = "prefilling") -> RequestSnapshot:
    return RequestSnapshot(phase, BLOCKS, num_kv, HASHES)


def _opened(cached: int = 0) -> SourceSession:
    """A session past its stage 0, reserved while the request still waits for its prefill."""
    session = SourceSession("r", BS, HELD, prefill_tokens=PROMPT_TOKENS)
    assert isinstance(session.start(), Snapshot)
    reserve = session.on_snapshot(RequestSnapshot("waiting", [], 0, HASHES))
    assert isinstance(reserve, Reserve)
    stage = reserve.stage
    # Nothing computed yet: the stage copies nothing, reserves the whole prompt and offers
    # every full block's hash.
    assert stage.index == 0 and stage.num_blocks == 0 and not stage.final
    assert stage.expected_blocks == 11 and stage.block_hashes == tuple(HASHES)
    copy = session.on_reserved(True, num_cached_blocks=cached, num_reserved=0)
    assert isinstance(copy, Copy) and copy.stage.num_blocks == 0
    assert isinstance(session.on_landed(), Snapshot)
    return session


def test_reserved_at_admission_live_stages_per_chunk_then_only_the_last_chunk() -> None:
    session = _opened(cached=2)  # the decode instance caches the first two blocks
    live = session.on_snapshot(_prefilling(16))  # first chunk: 4 full blocks
    assert isinstance(live, Reserve) and not live.stage.final
    assert live.stage.src_block_ids == (102, 103)  # the shared ones are never sent
    assert isinstance(session.on_reserved(True, 0, 2), Copy)
    assert isinstance(session.on_landed(), Snapshot)
    assert isinstance(session.on_snapshot(_prefilling(16)), Wait)  # no new full block yet
    live = session.on_snapshot(_prefilling(32))
    assert isinstance(live, Reserve) and live.stage.src_block_ids == (104, 105, 106, 107)
    session.on_reserved(True, 0, 4)
    session.on_landed()
    # Held at its first token: the stop-and-copy sends only the last chunk's blocks.
    final = session.on_snapshot(_prefilling(PROMPT_TOKENS, "suspended"))
    assert isinstance(final, Reserve) and final.stage.final
    assert final.stage.src_block_ids == (108, 109, 110)
    assert isinstance(session.on_reserved(True, 0, 3), Copy)
    assert isinstance(session.on_landed(), Commit)
    assert isinstance(session.on_commit_answer(True), Release)
    assert isinstance(session.on_released(), Done)
    planner = session.planner
    assert planner.blocks_sent == 9 and planner.num_shared_blocks == 2
    assert [s.num_blocks for s in planner.stages] == [0, 2, 4, 3]


def test_a_prompt_in_one_chunk_moves_at_the_first_token() -> None:
    session = _opened()
    assert isinstance(session.on_snapshot(_prefilling(0)), Wait)
    final = session.on_snapshot(_prefilling(PROMPT_TOKENS, "suspended"))
    assert isinstance(final, Reserve) and final.stage.final
    assert final.stage.src_block_ids == tuple(BLOCKS)


def test_refused_before_the_prefill_leaves_the_destination_alone() -> None:
    session = SourceSession("r", BS, HELD, prefill_tokens=PROMPT_TOKENS)
    session.on_snapshot(RequestSnapshot("waiting", [], 0, HASHES))
    abort = session.on_reserved(False, reason="no room")
    assert abort == Abort(
        AbortReason.DST_REFUSED, "no room", resume=False, notify_destination=False
    )


def test_decode_instance_lost_mid_prefill_frees_it_and_the_request_goes_on() -> None:
    session = _opened()
    session.on_snapshot(_prefilling(16))
    abort = session.fail(AbortReason.DST_FAILED, "connection refused")
    # Still prefilling: nothing to resume; the destination may hold the reservation.
    assert abort.notify_destination and not abort.resume


def test_finished_or_gone_mid_prefill_aborts() -> None:
    session = _opened()
    abort = session.on_snapshot(RequestSnapshot(None))
    assert isinstance(abort, Abort) and abort.reason is AbortReason.REQUEST_FINISHED
    assert abort.notify_destination


def test_preempted_mid_prefill_aborts_once_its_sent_blocks_are_gone() -> None:
    session = _opened()
    session.on_snapshot(_prefilling(16))
    session.on_reserved(True, 0, 4)
    session.on_landed()
    abort = session.on_snapshot(RequestSnapshot("waiting", [], 0, HASHES))
    assert isinstance(abort, Abort) and abort.reason is AbortReason.REQUEST_PREEMPTED


def test_a_mixed_instance_goes_on_with_live_stages_while_it_decodes() -> None:
    session = SourceSession("r", BS, StageConfig(last_stage_max_blocks=1), prefill_tokens=40)
    session.on_snapshot(RequestSnapshot("waiting", [], 0, HASHES))
    session.on_reserved(True, 0, 0)
    session.on_landed()
    blocks = [*BLOCKS, 111, 112]
    live = session.on_snapshot(RequestSnapshot("decoding", blocks, 48, HASHES))
    assert isinstance(live, Reserve) and live.stage.num_blocks == 12  # not held: it decodes
    # Once it decodes, a request prefilling again was preempted (as for any migration).
    session.on_reserved(True, 0, 12)
    session.on_landed()
    abort = session.on_snapshot(RequestSnapshot("prefilling", blocks, 20, HASHES))
    assert isinstance(abort, Abort) and abort.reason is AbortReason.REQUEST_PREEMPTED


# -- the asyncio driver with real engines and a real KV transport --------------------------------
torch = pytest.importorskip("torch")
from engine_thread import EngineThread  # noqa: E402

from instance_agent.engine.llm_engine import EngineConfig, LLMEngine, RequestOutput  # noqa: E402
from instance_agent.migration_routes import EngineMigrationAdapter  # noqa: E402
from migration.core.protocol import (  # noqa: E402
    AbortRequest,
    AckResponse,
    CommitRequest,
    MigrationStatus,
    RequestState,
    ReserveRequest,
    ReserveResponse,
)
from migration.core.reservations import ReservationTable  # noqa: E402
from migration.destination import MigrationDestination  # noqa: E402
from migration.source import PrefillOpening, migrate_out  # noqa: E402
from migration.transport import TransportHub  # noqa: E402

PROMPT = [(i * 37 + 11) % 250 for i in range(90)]
CHUNK = 16  # tokens per prefill step: 90 tokens take 6 steps


def _engine(num_blocks: int) -> LLMEngine:
    return LLMEngine(
        EngineConfig(
            model="tiny",
            block_size=BS,
            num_gpu_blocks=num_blocks,
            max_model_len=512,
            max_num_batched_tokens=CHUNK,
        )
    )


@pytest.mark.timeout(180)
@pytest.mark.parametrize("dst_blocks", [400, 8], ids=["commits", "refused-before-prefill"])
async def test_chunked_prefill_moves_while_it_computes(dst_blocks: int) -> None:
    src_engine, dst_engine = _engine(400), _engine(dst_blocks)
    src = EngineThread(src_engine, EngineMigrationAdapter(src_engine), name="src")
    dst = EngineThread(dst_engine, EngineMigrationAdapter(dst_engine), name="dst")
    src_hub = TransportHub(timeout_s=5.0, rendezvous_timeout_s=5.0)
    dst_hub = TransportHub(timeout_s=5.0, rendezvous_timeout_s=5.0)
    adapter = dst.adapter
    destination = MigrationDestination(
        dst.call,
        dst_hub,
        ReservationTable(max_incoming=1, timeout_s=10.0),
        adapter.block_size,
        adapter.kv_bytes_per_block(),
    )
    # After each prefill chunk the engine waits (up to 10 s) until a call of the migration is
    # queued, which it then runs before its next chunk: the session sees every chunk's blocks,
    # however loaded the machine.
    calls = threading.Condition()
    made, ran = [0], [0]
    over = threading.Event()  # the migration ended: no more pacing

    step = src_engine.step

    def paced_step() -> list[RequestOutput]:
        outputs = step()
        request = src_engine.scheduler.requests.get("r")
        if request is not None and request.migration_phase == "prefilling":
            with calls:
                calls.wait_for(lambda: made[0] > ran[0] or over.is_set(), 10.0)
        return outputs

    async def call(fn: Callable[[MigratableEngine], T]) -> T:
        def counted(engine: MigratableEngine) -> T:
            with calls:
                ran[0] += 1
            return fn(engine)

        queued = asyncio.ensure_future(src.call(counted))
        await asyncio.sleep(0)  # the command is in the engine's queue now
        with calls:
            made[0] += 1
            calls.notify_all()
        return await queued

    src_engine.step = paced_step  # type: ignore[method-assign]
    link = _Recording(destination)
    released: list[RequestState] = []
    params = SamplingParams(max_tokens=24, temperature=0.0)
    try:

        def admit(engine: LLMEngine) -> list[int]:
            # As the agent admits a handoff: held at its first token, its hashes read at once.
            request = engine.add_request("r", PROMPT, params)
            engine.scheduler.hold_at_first_token("r")
            return list(request.block_hashes)

        hashes = await src.run(admit)
        opening = PrefillOpening(len(PROMPT), hashes, BS, adapter.kv_bytes_per_block())
        outcome = await migrate_out(
            call,
            src_hub,
            link,
            "r",
            f"src#{src_hub.incarnation}",
            HELD,
            released.append,
            opening,
        )
        with calls:
            over.set()
            calls.notify_all()
        if dst_blocks < 20:
            # Refused at admission: no block is held there, and the request is prefilled here.
            assert outcome.status is MigrationStatus.ABORTED
            assert outcome.reason is AbortReason.DST_REFUSED and outcome.stages == 0
            assert dst_engine.block_manager.owners() == []
            return
        assert outcome.status is MigrationStatus.COMMITTED, outcome
        # Stage 0 at admission, live stages as chunks filled blocks, then the stop-and-copy of
        # the last chunk's blocks only (90 tokens: 20 full blocks after the fifth chunk, 23).
        assert outcome.stages >= 4, outcome
        assert outcome.blocks_sent == -(-len(PROMPT) // BS)
        assert link.reserves[0].expected_blocks == 23 and link.reserves[0].num_blocks == 0
        assert link.reserves[-1].num_blocks == 3, [r.num_blocks for r in link.reserves]
        (state,) = released
        assert state.num_computed_tokens == len(PROMPT) and len(state.output_token_ids) == 1
        await asyncio.wait_for(_finished(dst, "r"), 60)
        assert dst_engine.block_manager.owners() == [] and not destination.table.held_block_ids()
        # Bit-identical to the request run whole on one engine.
        ref_engine = _engine(400)
        ref = EngineThread(ref_engine, EngineMigrationAdapter(ref_engine), name="ref")
        try:
            await ref.run(lambda e: e.add_request("r", PROMPT, params))
            await asyncio.wait_for(_finished(ref, "r"), 60)
        finally:
            ref.stop()
        assert src.tokens["r"] + dst.tokens["r"] == ref.tokens["r"]
    finally:
        for thread, hub in ((src, src_hub), (dst, dst_hub)):
            thread.stop()
            hub.close()


class _Recording:
    """The destination as the source's link, recording every reservation asked of it."""

    def __init__(self, destination: MigrationDestination) -> None:
        self.destination = destination
        self.reserves: list[ReserveRequest] = []

    async def reserve(self, msg: ReserveRequest) -> ReserveResponse:
        self.reserves.append(msg)
        return await self.destination.reserve(msg)

    async def commit(self, msg: CommitRequest) -> AckResponse:
        return await self.destination.commit(msg)

    async def abort(self, msg: AbortRequest) -> AckResponse:
        return await self.destination.abort(msg)


async def _finished(thread: EngineThread, request_id: str) -> None:
    while request_id not in thread.finish_reasons:
        await asyncio.sleep(0.005)
