"""One migration session under both clocks: its transitions, the simulator's event loop driving it,
and the agents' asyncio driver (`migrate_out`) with real engines and a real KV transport."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import pytest

from instance_agent.engine.core.request import Request, SamplingParams
from migration.core.protocol import AbortReason, RequestState
from migration.core.session import (
    Abort,
    AheadBlocks,
    Commit,
    Copy,
    DestinationSession,
    Done,
    Release,
    RequestSnapshot,
    Reserve,
    Snapshot,
    SourceSession,
    Suspend,
)
from migration.core.stages import StageConfig, blocks_for
from policies import load_dispatch_policy
from policies.views import ClusterView, MigrationOrder
from simulator.cluster import ClusterConfig, SimCluster
from simulator.instance import InstanceConfig
from simulator.latency import load_latency_model
from simulator.traces import Trace, TraceRequest

BS = 4


def _decoding(num_kv: int, first_block: int = 100) -> RequestSnapshot:
    blocks = list(range(first_block, first_block + blocks_for(num_kv + 1, BS)))
    return RequestSnapshot("decoding", blocks, num_kv, list(range(num_kv // BS)))


# -- transitions (no clock) ----------------------------------------------------------------------
def test_live_stages_then_suspend_resnapshot_stop_and_copy_commit_release() -> None:
    session = SourceSession("r", BS, StageConfig(last_stage_max_blocks=2))
    assert isinstance(session.start(), Snapshot)
    live = session.on_snapshot(_decoding(41))  # 11 blocks, 10 full
    assert isinstance(live, Reserve) and not live.stage.final and live.stage.num_blocks == 10
    assert len(live.stage.block_hashes) == 10  # stage 0 offers its hashes (cache-aware)
    copy = session.on_reserved(True, num_cached_blocks=3, num_reserved=7)
    assert isinstance(copy, Copy) and copy.stage.num_blocks == 7  # shared blocks are not sent
    assert isinstance(session.on_landed(), Snapshot)
    assert isinstance(session.on_snapshot(_decoding(42)), Suspend)  # 1 block left
    # The request may have decoded between that snapshot and the suspension: read it again.
    assert isinstance(session.on_suspended(), Snapshot)
    suspended = RequestSnapshot("suspended", _decoding(45).block_ids, 45, ())
    final = session.on_snapshot(suspended)
    assert isinstance(final, Reserve) and final.stage.final and final.stage.num_blocks == 2
    assert isinstance(session.on_reserved(True, 0, 2), Copy)
    assert isinstance(session.on_landed(), Commit)
    assert isinstance(session.on_commit_answer(True), Release)
    assert isinstance(session.on_released(), Done) and session.finished
    assert session.planner.blocks_sent == 9 and session.planner.num_shared_blocks == 3


def test_refusal_at_stage_zero_leaves_the_destination_alone_later_ones_tell_it() -> None:
    first = SourceSession("r", BS)
    first.on_snapshot(_decoding(41))
    abort = first.on_reserved(False, reason="no room")
    assert abort == Abort(
        AbortReason.DST_REFUSED, "no room", resume=False, notify_destination=False
    )
    later = SourceSession("r", BS, StageConfig(last_stage_max_blocks=1))
    later.on_snapshot(_decoding(41))
    later.on_reserved(True, 0, 10)
    later.on_landed()
    later.on_snapshot(_decoding(49))  # two more full blocks: another live stage
    abort = later.on_reserved(False, reason="no room")
    assert isinstance(abort, Abort) and abort.notify_destination and not abort.resume


@pytest.mark.parametrize(
    ("phase", "reason"),
    [
        (None, AbortReason.REQUEST_FINISHED),
        ("waiting", AbortReason.REQUEST_PREEMPTED),
        ("prefilling", AbortReason.REQUEST_PREEMPTED),
    ],
)
def test_a_request_that_changed_between_stages_aborts(
    phase: str | None, reason: AbortReason
) -> None:
    session = SourceSession("r", BS, StageConfig(last_stage_max_blocks=1))
    session.on_snapshot(_decoding(41))
    session.on_reserved(True, 0, 10)
    session.on_landed()
    abort = session.on_snapshot(RequestSnapshot(phase, [], 0, []))
    assert isinstance(abort, Abort) and abort.reason is reason and abort.notify_destination


def test_not_decoding_before_any_stage_is_not_running_and_suspended_aborts_resume() -> None:
    abort = SourceSession("r", BS).on_snapshot(RequestSnapshot("prefilling", [1], 3, []))
    assert isinstance(abort, Abort) and abort.reason is AbortReason.REQUEST_NOT_RUNNING
    session = SourceSession("r", BS)
    assert isinstance(session.on_snapshot(_decoding(9)), Suspend)
    session.on_suspended()
    session.on_snapshot(RequestSnapshot("suspended", _decoding(9).block_ids, 9, ()))
    abort = session.on_reserved(True, 0, 99)  # an answer that does not match the question
    assert isinstance(abort, Abort) and abort.reason is AbortReason.DST_FAILED and abort.resume


def test_destination_session_answers_and_checks_the_commit() -> None:
    dst = DestinationSession("r", BS)
    assert dst.hashes_to_share(0, 2, [7, 8, 9]) == [7, 8]
    assert dst.hashes_to_share(1, 2, [7, 8, 9]) == []
    refused = dst.answer(5, [1], None)
    assert not refused.accepted and "4 blocks" in refused.reason
    assert dst.answer(3, [1], [2, 3]).reserved_block_ids == (2, 3)
    assert dst.commit_refusal("r", 9, 3) is None
    assert dst.commit_refusal("r", 9, 2) is not None
    assert dst.commit_refusal("other", 9, 3) is not None


def test_request_state_round_trips() -> None:
    request = Request("r", list(range(50)), SamplingParams(max_tokens=9, seed=3), BS)
    for token in (5, 6, 7):
        request.append_output_token(token)
    request.num_computed_tokens = request.num_tokens - 1
    request.num_preemptions = 2
    state = request.to_state()
    assert RequestState.from_json(state).num_tokens == request.num_tokens  # the wire form
    again = Request.from_state(state, BS)
    assert again.to_state() == state
    assert again.block_hashes == request.block_hashes
    assert list(again.token_ids) == list(request.token_ids)


# -- the virtual clock: the simulator's event loop drives the session ----------------------------
class _MoveOnce:
    """Migrate every request running on inst-0 to inst-1, once each."""

    name = "move_once"

    def __init__(self) -> None:
        self.ordered: set[str] = set()

    def plan(self, cluster: ClusterView) -> list[MigrationOrder]:
        orders = []
        for inst in cluster.instances:
            if inst.instance_id != "inst-0":
                continue
            for req in inst.running:
                if req.request_id not in self.ordered:
                    self.ordered.add(req.request_id)
                    orders.append(MigrationOrder(req.request_id, "inst-0", "inst-1", "test"))
        return orders


def _sim(requests: list[TraceRequest], stages: StageConfig) -> SimCluster:
    config = ClusterConfig(
        num_instances=2,
        instance=InstanceConfig(num_blocks=2000, block_size=BS, max_num_batched_tokens=512),
        migration_interval_s=0.05,
        migration_stages=stages,
    )
    dispatch = load_dispatch_policy("round_robin")
    cluster = SimCluster(
        config, load_latency_model("roofline:llama-2-7b:a100-80gb"), dispatch, _MoveOnce()
    )
    cluster.run(Trace("t", requests, block_size=BS))
    return cluster


def test_simulator_commits_through_the_session_and_the_request_finishes_on_the_destination() -> (
    None
):
    trace = [TraceRequest(0, 0.0, 90, 400, tuple(range(23)))]
    cluster = _sim(trace, StageConfig(last_stage_max_blocks=2))
    stats = cluster.migration_stats
    assert stats.started == 1 and stats.committed == 1 and not stats.aborted
    assert stats.downtime_s[0] >= 0
    cols = cluster.metrics.columns()
    assert cols["output_tokens"].tolist() == [400]  # every token, none lost or repeated
    for inst in cluster.instances.values():
        inst.block_manager.check_integrity()
        assert inst.block_manager.owners() == []


def test_simulator_shares_the_destinations_cached_prefix() -> None:
    # Request 1 runs on inst-1 first (round robin), caching the prompt both share there.
    prefix = tuple(range(23))
    trace = [
        TraceRequest(0, 0.0, 90, 400, prefix),
        TraceRequest(1, 0.0, 90, 1, prefix),
    ]
    cluster = _sim(trace, StageConfig())
    assert cluster.migration_stats.committed == 1
    assert cluster.migration_stats.blocks_shared >= 90 // BS


# -- the asyncio clock: the agents' driver with real engines -------------------------------------
torch = pytest.importorskip("torch")
from engine_thread import EngineThread  # noqa: E402

from instance_agent.engine.llm_engine import EngineConfig, LLMEngine  # noqa: E402
from instance_agent.migration_routes import EngineMigrationAdapter  # noqa: E402
from migration.core.protocol import MigrationStatus  # noqa: E402
from migration.core.reservations import ReservationTable  # noqa: E402
from migration.destination import MigrationDestination  # noqa: E402
from migration.source import migrate_out  # noqa: E402
from migration.transport import TransportHub  # noqa: E402

PROMPT = [(i * 37 + 11) % 250 for i in range(90)]


def _agent(
    name: str, num_blocks: int
) -> tuple[LLMEngine, EngineThread, TransportHub, MigrationDestination]:
    engine = LLMEngine(
        EngineConfig(model="tiny", block_size=BS, num_gpu_blocks=num_blocks, max_model_len=512)
    )
    adapter = EngineMigrationAdapter(engine)
    thread = EngineThread(engine, adapter, name=name)
    hub = TransportHub(timeout_s=5.0, rendezvous_timeout_s=5.0)
    destination = MigrationDestination(
        thread.call,
        hub,
        ReservationTable(max_incoming=1, timeout_s=10.0),
        adapter.block_size,
        adapter.kv_bytes_per_block(),
    )
    return engine, thread, hub, destination


async def _wait(predicate: Callable[[], bool], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline
        await asyncio.sleep(0.002)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("dst_blocks", [400, 8], ids=["commits", "no-room"])
async def test_agents_drive_the_same_session(dst_blocks: int) -> None:
    src_engine, src_thread, src_hub, _ = _agent("src", 400)
    dst_engine, dst_thread, dst_hub, destination = _agent("dst", dst_blocks)
    src_thread.after_step.append(lambda _engine: time.sleep(0.01))
    released: list[RequestState] = []
    try:
        params = SamplingParams(max_tokens=40, temperature=0.0)
        await src_thread.run(lambda e: e.add_request("r", PROMPT, params))
        await _wait(lambda: len(src_thread.tokens.get("r", [])) >= 2)
        outcome = await migrate_out(
            src_thread.call,
            src_hub,
            destination,
            "r",
            f"src#{src_hub.incarnation}",
            StageConfig(last_stage_max_blocks=2),
            released.append,
        )
        if dst_blocks < 20:
            assert outcome.status is MigrationStatus.ABORTED
            assert outcome.reason is AbortReason.DST_REFUSED and outcome.stages == 0
            assert dst_engine.block_manager.owners() == []
        else:
            assert outcome.status is MigrationStatus.COMMITTED, outcome
            (state,) = released
            held = blocks_for(state.num_computed_tokens, BS)
            assert outcome.blocks_sent + outcome.blocks_skipped == held
            # The state crossed in `Request.to_state()` form and was adopted from it.
            adopted = await dst_thread.run(lambda e: e.scheduler.requests["r"].to_state())
            assert adopted["prompt_token_ids"] == state.prompt_token_ids
            assert adopted["output_token_ids"][: len(state.output_token_ids)] == (
                state.output_token_ids
            )
            assert adopted["sampling_seed"] == state.sampling_seed
            assert "r" not in src_engine.scheduler.requests
    finally:
        for thread, hub in ((src_thread, src_hub), (dst_thread, dst_hub)):
            thread.stop()
            hub.close()


def test_blocks_reserved_ahead_are_taken_in_order_then_fresh_ones() -> None:
    """A P/D handoff opened before its prefill: stage 0 (2 of its 10 blocks cached here, 1 to
    copy now) reserves all 8 uncached blocks; later stages take them in order, then fresh ones;
    a commit with some left unfilled is refused."""
    ahead = AheadBlocks()
    assert ahead.to_reserve(0, num_blocks=3, expected_blocks=10, num_shared=2) == 8
    assert ahead.take(0, 3, 2, [10, 11, 12, 13, 14, 15, 16, 17]) == [10]
    assert ahead.commit_refusal() == "7 blocks reserved ahead were never filled"
    assert ahead.to_reserve(1, num_blocks=4, expected_blocks=0, num_shared=0) is None
    assert ahead.take(1, 4, 0, []) == [11, 12, 13, 14]
    assert ahead.to_reserve(2, num_blocks=5, expected_blocks=0, num_shared=0) == 2
    assert ahead.take(2, 5, 0, [20, 21]) == [15, 16, 17, 20, 21]
    assert ahead.commit_refusal() is None
    plain = AheadBlocks()  # an ordinary migration: nothing reserved ahead, every stage fresh
    assert plain.to_reserve(0, num_blocks=4, expected_blocks=0, num_shared=1) == 3
    assert plain.take(0, 4, 1, [5, 6, 7]) == [5, 6, 7] and plain.commit_refusal() is None
    assert plain.to_reserve(1, num_blocks=2, expected_blocks=0, num_shared=0) == 2
