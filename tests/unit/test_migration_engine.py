"""Live migration between two real engines in one process: bit-identical output, every abort path,
cache-aware transfer, concurrency. KV bytes move over a real gloo pair group on loopback."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from engine_thread import EngineThread

from instance_agent.engine.core.request import SamplingParams
from instance_agent.engine.llm_engine import EngineConfig, LLMEngine
from instance_agent.migration_routes import EngineMigrationAdapter
from migration.core.protocol import (
    AbortReason,
    AbortRequest,
    AckResponse,
    CommitRequest,
    DestinationError,
    MigrationOutcome,
    MigrationStatus,
    ReserveRequest,
    ReserveResponse,
)
from migration.core.reservations import ReservationTable
from migration.core.stages import StageConfig
from migration.destination import MigrationDestination
from migration.source import migrate_out
from migration.transport import TransportHub

pytestmark = pytest.mark.timeout(180)

BLOCK_SIZE = 4
PROMPT = [(i * 37 + 11) % 250 for i in range(90)]


def make_engine(num_blocks: int = 400) -> LLMEngine:
    return LLMEngine(
        EngineConfig(
            model="tiny", block_size=BLOCK_SIZE, num_gpu_blocks=num_blocks, max_model_len=512
        )
    )


class Clock:
    """The destination's clock, advanced by hand to expire a silent source's reservation."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@dataclass
class Instance:
    engine: LLMEngine
    thread: EngineThread
    hub: TransportHub
    destination: MigrationDestination
    clock: Clock

    def check_integrity(self) -> None:
        self.engine.block_manager.check_integrity()

    def owners(self) -> list[str]:
        return self.engine.block_manager.owners()


def make_instance(
    name: str,
    num_blocks: int = 400,
    max_incoming: int = 1,
    transfer_timeout_s: float = 5.0,
    chunk_bytes: int = 8 << 10,  # 4 tiny-model blocks: stages go out in several pieces
) -> Instance:
    engine = make_engine(num_blocks)
    adapter = EngineMigrationAdapter(engine)
    thread = EngineThread(engine, adapter, name=name)
    hub = TransportHub(
        timeout_s=transfer_timeout_s,
        rendezvous_timeout_s=transfer_timeout_s,
        chunk_bytes=chunk_bytes,
    )
    clock = Clock()
    destination = MigrationDestination(
        thread.call,
        hub,
        ReservationTable(max_incoming=max_incoming, timeout_s=10.0),
        adapter.block_size,
        adapter.kv_bytes_per_block(),
        clock=clock,
    )
    return Instance(engine, thread, hub, destination, clock)


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread():
    """Two engines share two cores here: one intra-op thread each avoids OpenMP contention."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
async def pair() -> AsyncIterator[tuple[Instance, Instance]]:
    src, dst = make_instance("src"), make_instance("dst", max_incoming=2)
    # 10 ms a step, like a real model (the tiny one takes 1 ms): requests are still decoding
    # while they migrate, and the copy overlaps decoding.
    src.thread.after_step.append(lambda _engine: time.sleep(0.01))
    yield src, dst
    for inst in (src, dst):
        inst.thread.stop()
        inst.hub.close()


@pytest.fixture(scope="module")
def reference() -> Callable[[SamplingParams], list[int]]:
    """Tokens the request produces on one engine, never migrated."""
    engine = make_engine()
    cache: dict[tuple[Any, ...], list[int]] = {}

    def run(params: SamplingParams) -> list[int]:
        key = (params.max_tokens, params.temperature, params.seed)
        if key not in cache:
            (out,) = engine.generate([PROMPT], SamplingParams(**_fields(params)))
            cache[key] = out.output_token_ids
        return cache[key]

    return run


def _fields(params: SamplingParams) -> dict[str, Any]:
    return {f: getattr(params, f) for f in SamplingParams.__slots__}


async def wait_for(predicate: Callable[[], bool], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.002)


async def start(src: Instance, rid: str, params: SamplingParams) -> None:
    await src.thread.run(lambda e: e.add_request(rid, PROMPT, SamplingParams(**_fields(params))))


async def migrate(src: Instance, link: Any, rid: str, config: StageConfig | None = None):
    return await migrate_out(
        src.thread.call, src.hub, link, rid, f"src#{src.hub.incarnation}", config
    )


def output_of(src: Instance, dst: Instance, rid: str) -> list[int]:
    return src.thread.tokens.get(rid, []) + dst.thread.tokens.get(rid, [])


def assert_clean(*instances: Instance) -> None:
    for inst in instances:
        inst.check_integrity()
        assert inst.owners() == [], f"blocks still held by {inst.owners()}"
        assert len(inst.destination.table) == 0


GREEDY = SamplingParams(max_tokens=40, temperature=0.0)
SEEDED = SamplingParams(max_tokens=40, temperature=0.9, top_p=0.95, seed=1234)


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
@pytest.mark.parametrize("after_tokens", [1, 20, 39], ids=["first", "midway", "last"])
async def test_output_is_bit_identical_after_migration(
    pair: tuple[Instance, Instance],
    reference: Callable[[SamplingParams], list[int]],
    params: SamplingParams,
    after_tokens: int,
) -> None:
    src, dst = pair
    expected = reference(params)
    await start(src, "r", params)
    await wait_for(lambda: len(src.thread.tokens.get("r", [])) >= after_tokens)
    outcome = await migrate(src, dst.destination, "r", StageConfig(last_stage_max_blocks=2))
    await wait_for(lambda: "r" in dst.thread.finish_reasons or "r" in src.thread.finish_reasons)
    if outcome.status is MigrationStatus.COMMITTED:
        assert "r" not in src.engine.scheduler.requests  # released on the source
        assert outcome.blocks_sent * BLOCK_SIZE >= len(PROMPT)
        assert outcome.downtime_s > 0 and outcome.stages >= 1
    else:
        # The request finished before the stop-and-copy (on a loaded machine a migration can
        # outlast the remaining tokens): nothing to move, and nothing may be lost.
        assert outcome.reason is AbortReason.REQUEST_FINISHED, outcome
        assert src.thread.finish_reasons["r"] == "length"
    assert output_of(src, dst, "r") == expected
    assert_clean(src, dst)


async def test_long_request_migrates_in_several_live_stages(
    pair: tuple[Instance, Instance], reference: Callable[[SamplingParams], list[int]]
) -> None:
    src, dst = pair
    params = SamplingParams(max_tokens=120, temperature=0.0)
    expected = reference(params)
    await start(src, "r", params)
    await wait_for(lambda: len(src.thread.tokens.get("r", [])) >= 2)
    # The first two stages answer only once the request has filled two more blocks, however
    # loaded the machine is: each live stage leaves more than one block behind.
    slow = DecodingLink(
        dst.destination, lambda: len(src.thread.tokens.get("r", [])), 2 * BLOCK_SIZE + 1, stages=2
    )
    outcome = await migrate(src, slow, "r", StageConfig(last_stage_max_blocks=1))
    assert outcome.status is MigrationStatus.COMMITTED, outcome
    assert outcome.stages >= 3  # at least two live stages, then stop-and-copy
    # The request decoded during the live stages (its KV grew past what stage 0 copied).
    assert outcome.blocks_sent > (len(PROMPT) + 2) // BLOCK_SIZE
    await wait_for(lambda: "r" in dst.thread.finish_reasons)
    assert output_of(src, dst, "r") == expected
    assert_clean(src, dst)


class SlowLink:
    """A destination reached through a slow network: every control message waits `delay_s`."""

    def __init__(self, destination: MigrationDestination, delay_s: float) -> None:
        self.destination = destination
        self.delay_s = delay_s

    async def reserve(self, msg: ReserveRequest) -> ReserveResponse:
        await asyncio.sleep(self.delay_s)
        return await self.destination.reserve(msg)

    async def commit(self, msg: CommitRequest) -> AckResponse:
        return await self.destination.commit(msg)

    async def abort(self, msg: AbortRequest) -> AckResponse:
        return await self.destination.abort(msg)


class DecodingLink(SlowLink):
    """A destination whose first `stages` reserve answers wait until the request decoded `tokens`
    more tokens: a slow network, measured in the request's own progress rather than in seconds."""

    def __init__(
        self,
        destination: MigrationDestination,
        decoded: Callable[[], int],
        tokens: int,
        stages: int,
    ) -> None:
        super().__init__(destination, delay_s=0.0)
        self.decoded = decoded
        self.tokens = tokens
        self.stages = stages

    async def reserve(self, msg: ReserveRequest) -> ReserveResponse:
        if msg.stage < self.stages:
            target = self.decoded() + self.tokens
            await wait_for(lambda: self.decoded() >= target)
        return await self.destination.reserve(msg)


class FailingLink:
    """The real destination, except that it dies (unreachable) at one control message."""

    def __init__(self, destination: MigrationDestination, fail_at: str, stage: int = 0) -> None:
        self.destination = destination
        self.fail_at = fail_at
        self.stage = stage
        self.dead = False

    def _check(self, what: str, stage: int = -1) -> None:
        if self.dead or (what == self.fail_at and stage in (self.stage, -1)):
            self.dead = True
            raise DestinationError(f"destination unreachable at {what}")

    async def reserve(self, msg: ReserveRequest) -> ReserveResponse:
        self._check("reserve", msg.stage)
        return await self.destination.reserve(msg)

    async def commit(self, msg: CommitRequest) -> AckResponse:
        self._check("commit")
        return await self.destination.commit(msg)

    async def abort(self, msg: AbortRequest) -> AckResponse:
        self._check("abort")
        return await self.destination.abort(msg)


@pytest.mark.parametrize(
    ("fail_at", "stage"), [("reserve", 0), ("reserve", 1), ("commit", 0)], ids=str
)
async def test_destination_dying_mid_migration_leaves_the_request_on_the_source(
    pair: tuple[Instance, Instance],
    reference: Callable[[SamplingParams], list[int]],
    fail_at: str,
    stage: int,
) -> None:
    src, dst = pair
    params = SamplingParams(max_tokens=60, temperature=0.0)
    await start(src, "r", params)
    await wait_for(lambda: len(src.thread.tokens.get("r", [])) >= 3)
    link = FailingLink(dst.destination, fail_at, stage)
    outcome = await migrate(src, SlowLink(link, 0.02), "r", StageConfig(last_stage_max_blocks=1))  # type: ignore[arg-type]
    assert outcome.status is MigrationStatus.ABORTED and outcome.reason is AbortReason.DST_FAILED
    await wait_for(lambda: "r" in src.thread.finish_reasons)
    assert src.thread.tokens["r"] == reference(params)
    # The destination never heard from the source again: its reservation expires.
    dst.clock.now += 60
    await dst.destination.expire()
    assert_clean(src, dst)


async def test_destination_without_room_refuses_and_holds_nothing(
    reference: Callable[[SamplingParams], list[int]],
) -> None:
    src, dst = make_instance("src"), make_instance("dst", num_blocks=8)
    src.thread.after_step.append(lambda _engine: time.sleep(0.01))
    try:
        params = SamplingParams(max_tokens=30, temperature=0.0)
        await start(src, "r", params)
        await wait_for(lambda: len(src.thread.tokens.get("r", [])) >= 2)
        outcome = await migrate(src, dst.destination, "r")
        assert outcome.status is MigrationStatus.ABORTED
        assert outcome.reason is AbortReason.DST_REFUSED and "watermark" in (outcome.detail or "")
        await wait_for(lambda: "r" in src.thread.finish_reasons)
        assert src.thread.tokens["r"] == reference(params)
        assert_clean(src, dst)
    finally:
        for inst in (src, dst):
            inst.thread.stop()
            inst.hub.close()


async def test_source_dying_frees_the_destination_after_its_timeout() -> None:
    dst = make_instance("dst", transfer_timeout_s=1.0)
    try:
        await _reserve_and_vanish(dst)
    finally:
        dst.thread.stop()
        dst.hub.close()


async def _reserve_and_vanish(dst: Instance) -> None:
    hashes = [1, 2, 3]
    answer = await dst.destination.reserve(
        ReserveRequest("m", "r", "gone-src", 0, 3, hashes, BLOCK_SIZE, _bytes_per_block(dst))
    )
    assert answer.accepted and len(answer.dst_block_ids) == 3
    assert dst.owners() == ["m"]
    dst.clock.now += 5
    assert await dst.destination.expire() == []  # not silent long enough
    dst.clock.now += 6
    # The receive for stage 0 is still waiting for a source that never joins; it fails first.
    await wait_for(lambda: not dst.destination._busy(dst.destination.table.get("m")))  # type: ignore[arg-type]
    assert await dst.destination.expire() == ["m"]
    assert_clean(dst)
    assert dst.destination.aborted == {"src_timeout": 1}


def _bytes_per_block(inst: Instance) -> int:
    return EngineMigrationAdapter(inst.engine).kv_bytes_per_block()


async def test_request_finishing_mid_migration_frees_the_reservation(
    pair: tuple[Instance, Instance], reference: Callable[[SamplingParams], list[int]]
) -> None:
    src, dst = pair
    params = SamplingParams(max_tokens=50, temperature=0.0)
    await start(src, "r", params)
    await wait_for(lambda: len(src.thread.tokens.get("r", [])) >= 2)

    class AbortingLink(SlowLink):
        async def reserve(self, msg: ReserveRequest) -> ReserveResponse:
            if msg.stage == 1:  # the client goes away between two stages
                await src.thread.run(lambda e: e.abort("r"))
            return await super().reserve(msg)

    outcome = await migrate(
        src, AbortingLink(dst.destination, 0.02), "r", StageConfig(last_stage_max_blocks=1)
    )
    assert outcome.status is MigrationStatus.ABORTED
    assert outcome.reason is AbortReason.REQUEST_FINISHED
    assert_clean(src, dst)
    assert "r" not in dst.engine.scheduler.requests


async def test_migrating_a_request_that_is_not_decoding_is_refused(
    pair: tuple[Instance, Instance],
) -> None:
    src, dst = pair
    outcome = await migrate(src, dst.destination, "nope")
    assert outcome.reason is AbortReason.REQUEST_FINISHED
    assert_clean(src, dst)


async def test_cached_prefix_is_shared_not_sent(
    pair: tuple[Instance, Instance], reference: Callable[[SamplingParams], list[int]]
) -> None:
    src, dst = pair
    params = SamplingParams(max_tokens=30, temperature=0.0)
    # The destination served the same prompt before: its prefix blocks are cached there.
    await dst.thread.run(lambda e: e.add_request("warm", PROMPT, SamplingParams(max_tokens=1)))
    await wait_for(lambda: "warm" in dst.thread.finish_reasons)
    await start(src, "r", params)
    await start(src, "plain", params)
    await wait_for(lambda: len(src.thread.tokens.get("r", [])) >= 5)
    # Without cache-aware transfer every block is sent, cached there or not.
    plain = await migrate(src, dst.destination, "plain", StageConfig(cache_aware=False))
    assert plain.status is MigrationStatus.COMMITTED and plain.blocks_skipped == 0
    assert plain.blocks_sent * BLOCK_SIZE > len(PROMPT)
    outcome = await migrate(src, dst.destination, "r")
    assert outcome.status is MigrationStatus.COMMITTED, outcome
    # The prompt's blocks at least; "plain" (same prompt, same greedy output) left its decoded
    # blocks cached there too.
    assert outcome.blocks_skipped >= len(PROMPT) // BLOCK_SIZE
    assert outcome.bytes_skipped == outcome.blocks_skipped * _bytes_per_block(dst)
    await wait_for(lambda: all(r in dst.thread.finish_reasons for r in ("r", "plain")))
    assert output_of(src, dst, "r") == reference(params)
    assert output_of(src, dst, "plain") == reference(params)
    assert_clean(src, dst)


async def test_two_concurrent_migrations_share_one_pair_group(
    pair: tuple[Instance, Instance], reference: Callable[[SamplingParams], list[int]]
) -> None:
    src, dst = pair
    params = SamplingParams(max_tokens=40, temperature=0.9, seed=7)
    for rid in ("a", "b"):
        await start(src, rid, params)
    await wait_for(lambda: all(len(src.thread.tokens.get(r, [])) >= 3 for r in "ab"))
    outcomes: list[MigrationOutcome] = await asyncio.gather(
        *(migrate(src, SlowLink(dst.destination, 0.01), rid) for rid in "ab")
    )
    assert [o.status for o in outcomes] == [MigrationStatus.COMMITTED] * 2, outcomes
    await wait_for(lambda: all(r in dst.thread.finish_reasons for r in "ab"))
    for rid in "ab":
        assert output_of(src, dst, rid) == reference(params)
    assert_clean(src, dst)


async def test_incompatible_destination_is_refused(pair: tuple[Instance, Instance]) -> None:
    _, dst = pair
    answer = await dst.destination.reserve(ReserveRequest("m", "r", "s", 0, 1, [], 16, 1))
    assert not answer.accepted and "block size" in (answer.reason or "")
    answer = await dst.destination.reserve(ReserveRequest("m", "r", "s", 0, 1, [], BLOCK_SIZE, 1))
    assert not answer.accepted and "bytes per block" in (answer.reason or "")
    assert (await dst.destination.commit(CommitRequest("m", _dummy_state()))).ok is False
    assert_clean(dst)


def _dummy_state() -> Any:
    from migration.core.protocol import RequestState

    return RequestState("r", [1, 2], [3], {"max_tokens": 4}, 1, 2)
