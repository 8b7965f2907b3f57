"""The multi-stage planner and the destination's reservation table, driven by random schedules."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from migration.core.protocol import AbortReason
from migration.core.reservations import ReservationError, ReservationTable
from migration.core.stages import MigrationAborted, Phase, StageConfig, StagePlanner, blocks_for


class DecodingRequest:
    """A request growing on the source: one block allocated ahead of the KV, as a paged engine does."""

    def __init__(self, block_size: int, prompt_len: int) -> None:
        self.block_size = block_size
        self.num_kv_tokens = prompt_len
        self.block_ids: list[int] = []
        self._next_block = 1000
        self._allocate()

    def _allocate(self) -> None:
        while len(self.block_ids) < blocks_for(self.num_kv_tokens + 1, self.block_size):
            self.block_ids.append(self._next_block)
            self._next_block += 7  # physical ids are not contiguous

    def decode(self, num_steps: int) -> None:
        self.num_kv_tokens += num_steps
        self._allocate()

    @property
    def hashes(self) -> list[int]:
        return [b * 31 for b in self.block_ids[: self.num_kv_tokens // self.block_size]]


def run_migration(
    req: DecodingRequest,
    planner: StagePlanner,
    growth: list[int],
    num_cached: int,
) -> list[int]:
    """Drive the planner to commit; returns the source block ids in the order they reached the
    destination (shared ones included)."""
    on_dst: list[int] = []
    steps = iter(growth)
    while True:
        if planner.phase is Phase.LIVE and planner.needs_suspend(req.block_ids, req.num_kv_tokens):
            planner.suspended()
        stage = planner.next_stage(req.block_ids, req.num_kv_tokens, req.hashes)
        if not stage.final:
            # A live stage never touches the still-filling block.
            assert (stage.first_block + stage.num_blocks) * req.block_size <= req.num_kv_tokens
        cached = min(num_cached, len(stage.block_hashes)) if stage.index == 0 else 0
        shared = list(stage.src_block_ids[:cached])
        stage = planner.reserved(stage, cached, stage.num_blocks - cached)
        on_dst += shared + list(stage.src_block_ids)
        planner.landed(stage)
        if stage.final:
            planner.committed()
            return on_dst
        req.decode(next(steps, 1))


configs = st.builds(
    StageConfig,
    last_stage_max_blocks=st.integers(1, 6),
    max_live_stages=st.integers(0, 6),
)


@settings(max_examples=400, deadline=None)
@given(
    block_size=st.sampled_from([1, 2, 4, 16]),
    prompt_len=st.integers(1, 300),
    config=configs,
    growth=st.lists(st.integers(0, 40), max_size=10),
    num_cached=st.integers(0, 100),
)
def test_every_block_reaches_the_destination_once_in_order(
    block_size: int,
    prompt_len: int,
    config: StageConfig,
    growth: list[int],
    num_cached: int,
) -> None:
    req = DecodingRequest(block_size, prompt_len)
    planner = StagePlanner("r", block_size, config)
    on_dst = run_migration(req, planner, growth, num_cached)

    assert on_dst == req.block_ids[: blocks_for(req.num_kv_tokens, block_size)]
    assert planner.num_kv_tokens == req.num_kv_tokens
    assert planner.num_live_stages <= config.max_live_stages
    assert planner.blocks_sent + planner.num_shared_blocks == len(on_dst)
    # Every live stage makes progress (stage 0 possibly only through cache sharing).
    shared = planner.num_shared_blocks
    assert all(s.num_blocks + (shared if s.index == 0 else 0) >= 1 for s in planner.stages[:-1])
    final = planner.stages[-1]
    assert final.final
    if planner.num_live_stages < config.max_live_stages:
        # Stop-and-copy was chosen because few blocks remained: downtime is bounded by K blocks.
        assert final.num_blocks <= config.last_stage_max_blocks
    # Cache sharing only ever covers full blocks the destination has hashes for.
    assert planner.num_shared_blocks <= req.num_kv_tokens // block_size


@settings(max_examples=200, deadline=None)
@given(
    prompt_len=st.integers(64, 400),
    growth=st.lists(st.integers(1, 20), min_size=1, max_size=6),
    num_cached=st.integers(0, 30),
)
def test_cache_hits_are_never_sent(prompt_len: int, growth: list[int], num_cached: int) -> None:
    req = DecodingRequest(4, prompt_len)
    planner = StagePlanner("r", 4, StageConfig(last_stage_max_blocks=2, max_live_stages=4))
    run_migration(req, planner, growth, num_cached)
    sent = [b for s in planner.stages for b in s.src_block_ids]
    assert planner.num_shared_blocks == min(num_cached, prompt_len // 4)
    assert not set(sent) & set(req.block_ids[: planner.num_shared_blocks])


def test_a_short_request_goes_straight_to_stop_and_copy() -> None:
    req = DecodingRequest(16, 40)  # 3 blocks, the last one partial
    planner = StagePlanner("r", 16, StageConfig(last_stage_max_blocks=4))
    assert planner.needs_suspend(req.block_ids, req.num_kv_tokens)
    planner.suspended()
    stage = planner.next_stage(req.block_ids, req.num_kv_tokens, req.hashes)
    assert stage.final and stage.src_block_ids == tuple(req.block_ids[:3])
    assert stage.block_hashes == tuple(req.hashes[:2])  # the partial block has no hash


def test_long_request_copies_live_then_a_short_final_stage() -> None:
    req = DecodingRequest(16, 8192)
    planner = StagePlanner("r", 16, StageConfig(last_stage_max_blocks=4, max_live_stages=8))
    stage = planner.next_stage(req.block_ids, req.num_kv_tokens)
    assert not stage.final and stage.num_blocks == 512
    planner.landed(planner.reserved(stage, 0, 512))
    req.decode(40)  # decoding went on during the copy: 2 more full blocks, 1 partial
    assert planner.needs_suspend(req.block_ids, req.num_kv_tokens)
    planner.suspended()
    last = planner.next_stage(req.block_ids, req.num_kv_tokens)
    assert last.final and last.first_block == 512 and last.num_blocks == 3


def test_preemption_during_a_live_stage_aborts() -> None:
    req = DecodingRequest(4, 100)
    planner = StagePlanner("r", 4, StageConfig(last_stage_max_blocks=1))
    planner.landed(planner.reserved(planner.next_stage(req.block_ids, req.num_kv_tokens), 0, 25))
    # Preempted and recomputed: same length, fresh physical blocks.
    fresh = [b + 1 for b in req.block_ids]
    with pytest.raises(MigrationAborted) as err:
        planner.next_stage(fresh, req.num_kv_tokens + 8)
    assert err.value.reason is AbortReason.REQUEST_PREEMPTED
    assert planner.abort(err.value.reason) is False  # never suspended: nothing to resume


def test_shrinking_kv_is_a_preemption() -> None:
    req = DecodingRequest(4, 100)
    planner = StagePlanner("r", 4, StageConfig(last_stage_max_blocks=1))
    planner.landed(planner.reserved(planner.next_stage(req.block_ids, 100), 0, 25))
    with pytest.raises(MigrationAborted):
        planner.next_stage(req.block_ids, 96)


@pytest.mark.parametrize(("cached", "reserved"), [(0, 3), (0, 5), (3, 1), (-1, 5)])
def test_a_reservation_that_does_not_match_the_stage_aborts(cached: int, reserved: int) -> None:
    req = DecodingRequest(4, 16)  # 4 full blocks, 2 hashed when stage 0 is live
    planner = StagePlanner("r", 4, StageConfig(last_stage_max_blocks=1))
    stage = planner.next_stage(req.block_ids, req.num_kv_tokens, req.hashes[:2])
    with pytest.raises(MigrationAborted) as err:
        planner.reserved(stage, cached, reserved)
    assert err.value.reason is AbortReason.DST_FAILED


def test_abort_after_suspension_asks_for_resume() -> None:
    req = DecodingRequest(4, 10)
    planner = StagePlanner("r", 4, StageConfig())
    planner.suspended()
    planner.next_stage(req.block_ids, req.num_kv_tokens)
    assert planner.abort(AbortReason.TRANSFER_FAILED) is True
    assert planner.phase is Phase.ABORTED and planner.abort_reason is AbortReason.TRANSFER_FAILED
    with pytest.raises(RuntimeError):
        planner.abort(AbortReason.DST_FAILED)


def test_out_of_order_calls_are_programming_errors() -> None:
    req = DecodingRequest(4, 10)
    planner = StagePlanner("r", 4, StageConfig())
    stage = planner.next_stage(req.block_ids, req.num_kv_tokens)
    with pytest.raises(RuntimeError):
        planner.next_stage(req.block_ids, req.num_kv_tokens)
    with pytest.raises(RuntimeError):
        planner.committed()
    planner.landed(planner.reserved(stage, 0, stage.num_blocks))
    with pytest.raises(RuntimeError):
        planner.landed(stage)


def test_config_rejects_a_zero_last_stage() -> None:
    with pytest.raises(ValueError):
        StageConfig(last_stage_max_blocks=0)


# -- destination side -------------------------------------------------------------------------


class ReservationMachine(RuleBasedStateMachine):
    """Random opens, stages, landings, commits, aborts and expiries against a block pool:
    no block is ever held twice or lost."""

    NUM_BLOCKS = 64

    def __init__(self) -> None:
        super().__init__()
        self.table = ReservationTable(max_incoming=2, timeout_s=5.0)
        self.free = set(range(self.NUM_BLOCKS))
        self.cached = set(range(4))  # a prefix cache: shared blocks are referenced, not taken
        self.refs = dict.fromkeys(self.cached, 0)
        self.adopted: list[int] = []
        self.now = 0.0
        self.next_id = 0
        self.free -= self.cached

    def _release(self, block_ids: list[int]) -> None:
        for b in block_ids:
            if b in self.cached:
                self.refs[b] -= 1
            else:
                assert b not in self.free
                self.free.add(b)

    @rule(shared=st.integers(0, 4))
    def open(self, shared: int) -> None:
        mid = f"m{self.next_id}"
        self.next_id += 1
        try:
            self.table.open(mid, f"r{mid}", "src", self.now)
        except ReservationError:
            assert len(self.table) == self.table.max_incoming
            return
        for b in range(shared):
            self.refs[b] += 1
        self.table.begin_stage(mid, 0, list(range(shared)), [], self.now)
        self.table.landed(mid, self.now)

    @precondition(lambda self: len(self.table) > 0)
    @rule(data=st.data(), n=st.integers(0, 6))
    def stage(self, data: st.DataObject, n: int) -> None:
        r = data.draw(st.sampled_from(list(self.table)))
        if r.stage_in_flight:
            with pytest.raises(ReservationError, match="has not landed"):
                self.table.begin_stage(r.migration_id, r.next_stage, [], [], self.now)
            return
        if n > len(self.free):
            return
        blocks = sorted(self.free)[:n]
        self.free -= set(blocks)
        self.table.begin_stage(r.migration_id, r.next_stage, [], blocks, self.now)
        with pytest.raises(ReservationError):
            self.table.begin_stage(r.migration_id, r.next_stage + 1, [], [], self.now)
        if data.draw(st.booleans()):
            self.table.landed(r.migration_id, self.now)

    @precondition(lambda self: len(self.table) > 0)
    @rule(data=st.data(), commit=st.booleans())
    def finish(self, data: st.DataObject, commit: bool) -> None:
        r = data.draw(st.sampled_from(list(self.table)))
        popped = self.table.pop(r.migration_id)
        assert popped is r
        if commit:  # the adopted request now owns the blocks and the shared references
            self.adopted.extend(b for b in r.block_ids if b not in self.cached)
            for b in r.shared_block_ids:
                self.refs[b] -= 1
        else:
            self._release(r.block_ids)
        assert self.table.pop(r.migration_id) is None

    @rule(dt=st.floats(0.0, 4.0))
    def tick(self, dt: float) -> None:
        self.now += dt
        for r in self.table.expire(self.now):
            assert self.now - r.last_seen > self.table.timeout_s
            self._release(r.block_ids)

    @invariant()
    def blocks_are_conserved(self) -> None:
        held = [b for b in self.table.held_block_ids() if b not in self.cached]
        assert len(held) == len(set(held))
        assert not set(held) & self.free and not set(self.adopted) & self.free
        assert len(held) + len(self.free) + len(self.adopted) == self.NUM_BLOCKS - len(self.cached)
        shared_refs = sum(1 for b in self.table.held_block_ids() if b in self.cached)
        assert shared_refs == sum(self.refs.values())


TestReservationTable = ReservationMachine.TestCase
TestReservationTable.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


def test_one_incoming_migration_per_request_and_instance() -> None:
    table = ReservationTable(max_incoming=1, timeout_s=1.0)
    table.open("m1", "r1", "a", 0.0)
    with pytest.raises(ReservationError, match="busy"):
        table.open("m2", "r2", "b", 0.0)
    with pytest.raises(ReservationError, match="already migrating"):
        table.open("m3", "r1", "b", 0.0)
    with pytest.raises(ReservationError, match="already open"):
        table.open("m1", "r1", "a", 0.0)
    with pytest.raises(ReservationError, match="expected stage 0"):
        table.begin_stage("m1", 1, [], [], 0.0)
    table.begin_stage("m1", 0, [5], [6, 7], 0.5)
    with pytest.raises(ReservationError, match="only stage 0"):
        table.landed("m1", 0.5) and table.begin_stage("m1", 1, [9], [], 0.5)
    assert table.expire(1.4) == []
    (stale,) = table.expire(1.6)
    assert stale.block_ids == [5, 6, 7] and len(table) == 0
