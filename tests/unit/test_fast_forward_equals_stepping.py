"""The decode fast-forward (simulator/fast_forward.py) equals stepping the engine core.

Two twin schedulers run the same random workload: one steps every engine step with `schedule` +
`update_from_output` (the engine core's one execution path), the other fast-forwards every run
of pure-decode steps `decode_run_length` guarantees. After every step or run the twins must hold
the same tokens, block tables, cached blocks (hash and block id), pool counts and step ids, and
each fast-forwarded step must emit the KV events and show the pool its stepped twin does. A
change to `schedule` or `update_from_output` that the fast-forward does not follow fails here.
With KV tiers on (CPU and disk slots under the pool), evictions move blocks down and a waiting
head whose prefix continues there is admitted as a load (finished at once, by both twins alike).
"""

from __future__ import annotations

import contextlib

import xxhash
from hypothesis import event, given, settings
from hypothesis import strategies as st

from instance_agent.engine.core.batch_scheduler import BatchScheduler, SchedulerConfig
from instance_agent.engine.core.block_manager import BlockManager
from instance_agent.engine.core.request import InvalidRequestError, Request, SamplingParams
from instance_agent.engine.core.tiers import TierConfig, TierStore
from kvherd.kv_events import MEDIUM_CPU, MEDIUM_STORAGE, KVEvent
from simulator.fast_forward import advance_decode, decode_run_length

BLOCK = 4


def next_token(tokens: list[int]) -> int:
    """A pure function of the sequence, like greedy decoding of a fixed model."""
    return xxhash.xxh32_intdigest(bytes(t % 256 for t in tokens[-8:])) % 200 + 1


def next_tokens(request: Request, count: int) -> list[int]:
    """`count` tokens `next_token` gives one step after another."""
    seq = list(request.token_ids)
    for _ in range(count):
        seq.append(next_token(seq))
    return seq[len(request.token_ids) :]


def step(sched: BatchScheduler) -> tuple[int, list[KVEvent]]:
    """One engine step; its step id and the KV events it emitted."""
    out = sched.schedule()
    for load in out.loads:  # the copies land before the next step (the driver's choice)
        sched.finish_load(load.request_id, True)
    sched.block_manager.take_offloads()
    sampled = {
        s.request.request_id: next_token(list(s.request.token_ids))
        for s in out.scheduled
        if s.samples
    }
    sched.update_from_output(out, sampled)
    return out.step_id, sched.block_manager.take_events()


def make_request(
    rid: str,
    prompt: list[int],
    max_tokens: int,
    block_size: int = BLOCK,
    priority: int = 0,
    stop_token: int | None = None,
) -> Request:
    params = SamplingParams(
        max_tokens=max_tokens,
        temperature=0.0,
        ignore_eos=True,
        stop_token_ids=[] if stop_token is None else [stop_token],
    )
    return Request(rid, prompt, params, block_size=block_size, priority=priority)


def core_state(sched: BatchScheduler) -> tuple[object, ...]:
    """Everything a step can change: requests, queues, tables, the cache, the pool, counters."""
    bm = sched.block_manager
    cached = sorted(bm.cached_block_hashes())
    return (
        [
            (
                r.request_id,
                r.status,
                list(r.token_ids),
                list(r.output_token_ids),
                r.num_computed_tokens,
                r.num_cached_tokens,
                list(r.block_hashes),
            )
            for r in sched.requests.values()
        ],
        [r.request_id for r in sched.running],
        [r.request_id for r in sched.waiting],
        {owner: list(bm.block_ids(owner)) for owner in bm.owners()},
        [(h, bm.lookup_cached_prefix([h])) for h in cached],
        bm.pool_counts(),
        sched.num_steps,
        sched.num_waiting_tokens,
        sched.running_prefill_tokens,
        (sched.prefix_cache_queries, sched.prefix_cache_hits, sched.num_preemptions),
        None if bm.tiers is None else bm.tiers.block_hashes(),
    )


def twin_schedulers(
    num_blocks: int,
    block_size: int,
    watermark: float,
    config: SchedulerConfig,
    caching: bool = True,
    tiers: tuple[int, int] = (0, 0),
) -> tuple[BatchScheduler, BatchScheduler]:
    configs = [
        TierConfig(medium, count)
        for medium, count in zip((MEDIUM_CPU, MEDIUM_STORAGE), tiers, strict=True)
        if count
    ]
    fast, slow = (
        BatchScheduler(
            SchedulerConfig(
                config.max_num_seqs,
                config.max_num_batched_tokens,
                config.max_model_len,
                config.enable_chunked_prefill,
            ),
            BlockManager(
                num_blocks,
                block_size,
                caching,
                watermark,
                TierStore(configs, block_size) if configs and caching else None,
            ),
        )
        for _ in range(2)
    )
    return fast, slow


workloads = st.lists(
    # (prefix group: shared prefixes 0-1 or none, prompt tail, max tokens, arrival gap in steps,
    #  priority, stop token or none, abort after this many more steps or never)
    st.tuples(
        st.integers(0, 2),
        st.integers(1, 14),
        st.integers(1, 40),
        st.integers(0, 6),
        st.integers(0, 1),
        st.one_of(st.none(), st.none(), st.none(), st.integers(1, 200)),  # (a stop ends no run)
        st.one_of(st.none(), st.integers(0, 30)),
    ),
    min_size=1,
    max_size=8,
)


@settings(max_examples=150, deadline=None)
@given(
    data=st.data(),
    specs=workloads,
    num_blocks=st.integers(12, 48),
    block_size=st.sampled_from([2, 4, 8]),
    watermark=st.sampled_from([0.0, 0.1, 0.25]),
    max_num_seqs=st.integers(1, 6),
    budget=st.integers(6, 24),
    chunked=st.booleans(),
    caching=st.booleans(),
    tiers=st.sampled_from([(0, 0), (0, 0), (6, 0), (20, 0), (4, 8)]),
)
def test_fast_forward_equals_stepping(
    data: st.DataObject,
    specs: list[tuple[int, int, int, int, int, int | None, int | None]],
    num_blocks: int,
    block_size: int,
    watermark: float,
    max_num_seqs: int,
    budget: int,
    chunked: bool,
    caching: bool,
    tiers: tuple[int, int],
) -> None:
    """Random workloads (shared prefixes, tight pools that preempt, priorities, stop tokens,
    aborts, prefix caching, chunked prefill and KV tiers on or off): fast-forwarding every
    guaranteed run leaves the core exactly as stepping does."""
    max_model_len = 96
    config = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=budget if chunked else max(budget, max_model_len),
        max_model_len=max_model_len,
        enable_chunked_prefill=chunked,
    )
    fast, slow = twin_schedulers(num_blocks, block_size, watermark, config, caching, tiers)
    twins = (fast, slow)
    prefixes = [[7] * 8, [9] * 12]
    # (steps until it arrives, id, prompt, max tokens, priority, stop token, abort delay)
    pending = [
        (gap, f"r{i}", [*(prefixes[group] if group < 2 else []), *range(1, tail + 1)], *rest)
        for i, (group, tail, max_tokens, gap, *rest) in enumerate(specs)
        for rest in [[max_tokens, *rest]]
    ]
    aborts: dict[str, int] = {}
    fast_forwarded = 0
    for _ in range(600):
        while pending and pending[0][0] <= 0:
            _, rid, prompt, max_tokens, priority, stop, abort_after = pending.pop(0)
            for sched in twins:
                with contextlib.suppress(InvalidRequestError):
                    sched.add_request(
                        make_request(rid, prompt, max_tokens, block_size, priority, stop)
                    )
            if abort_after is not None:
                aborts[rid] = abort_after
        if pending:
            pending[0] = (pending[0][0] - 1, *pending[0][1:])
        for rid, left in list(aborts.items()):
            if left <= 0:
                del aborts[rid]
                assert (fast.abort_request(rid) is None) == (slow.abort_request(rid) is None)
        if not fast.has_unfinished() and not pending:
            break
        k = decode_run_length(fast, data.draw(st.integers(1, 12)))
        if k >= 1:
            pools: list[tuple[int, int]] = []
            fast_events: list[list[KVEvent]] = []
            first_step = fast.num_steps
            applied = advance_decode(fast, k, next_tokens, pools=pools, step_events=fast_events)
            fast.block_manager.take_offloads()
            assert 1 <= applied <= k and len(pools) == len(fast_events) == applied
            assert fast.num_steps == first_step + applied
            fast_forwarded += applied
            bm_slow = slow.block_manager
            for j in range(applied):
                out = slow.schedule()
                assert not out.loads  # a head admitted as a load ends the run
                assert out.step_id == first_step + j
                assert pools[j] == bm_slow.pool_counts()
                assert not out.preempted
                assert all(not s.is_prefill for s in out.scheduled)
                assert len(out.scheduled) == fast.num_running
                sampled = {
                    s.request.request_id: next_token(list(s.request.token_ids))
                    for s in out.scheduled
                }
                assert not slow.update_from_output(out, sampled)
                assert fast_events[j] == bm_slow.take_events()
            for rid in aborts:
                aborts[rid] -= applied
        else:
            fast_step, slow_step = step(fast), step(slow)
            assert fast_step == slow_step
            for rid in aborts:
                aborts[rid] -= 1
        assert core_state(fast) == core_state(slow)
        fast.block_manager.check_integrity()
    assert not fast.has_unfinished()
    event(f"fast-forwarded: {fast_forwarded > 0}")  # (hypothesis reports the share it saw)


def test_advance_decode_stops_where_the_waiting_head_gains_a_prefix_hit() -> None:
    """A running request completes a block the refused waiting head shares: the run ends there,
    so the next `schedule` sees the new hit, exactly as step by step."""
    config = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64)
    fast, slow = twin_schedulers(12, BLOCK, 0.25, config)
    twins = (fast, slow)
    for sched in twins:
        sched.add_request(make_request("a", [3, 1, 4, 1, 5, 9], 20))
        sched.add_request(make_request("f", list(range(100, 112)), 20))
        step(sched)  # both prefills, in one step
        step(sched)  # first decode: pure decode from here on
    a = fast.requests["a"]
    head_prompt = [*a.token_ids, *next_tokens(a, 17)]
    for sched in twins:
        sched.add_request(make_request("h", head_prompt, 1))
    assert decode_run_length(fast, 16) > 3  # the head is refused, the pool lasts
    applied = advance_decode(fast, 16, next_tokens)
    # a's second block (tokens 4..7) completes in the run's first step: computed 7 -> 8.
    assert applied == 1
    _, slow_events = step(slow)
    assert core_state(fast) == core_state(slow)
    assert fast.block_manager.take_events() == slow_events
    assert [s.request.request_id for s in fast.schedule().scheduled] == [
        s.request.request_id for s in slow.schedule().scheduled
    ]


def test_no_run_while_a_request_is_in_prefill_or_can_stop_on_a_token() -> None:
    """A running request that has not sampled since its admission, or one a sampled token could
    stop, makes the next step no pure decode step: no run."""
    config = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=4, max_model_len=64)
    sched = BatchScheduler(config, BlockManager(32, BLOCK, watermark=0.0))
    sched.add_request(make_request("long", list(range(1, 11)), 8))
    step(sched)  # a 4-token chunk of a 10-token prompt: still in prefill
    assert sched.running_prefill_tokens and decode_run_length(sched, 8) == 0
    step(sched)
    step(sched)  # the last chunk samples the first token
    assert (
        not sched.running_prefill_tokens and decode_run_length(sched, 8) == 6
    )  # the 8th token ends it
    for stop_token, run in ((None, 5), (250, 0)):
        twin = BatchScheduler(config, BlockManager(32, BLOCK, watermark=0.0))
        twin.add_request(make_request("s", [1, 2, 3], 8, stop_token=stop_token))
        step(twin)
        step(twin)
        assert not twin.running_prefill_tokens and decode_run_length(twin, 8) == run


def test_a_run_stops_before_evicting_a_block_the_refused_head_would_hit() -> None:
    """Evicting a cached block can admit the refused waiting head: here its hits b0 b1 b2 are all
    evictable (3 revived blocks + 1 new > 3 free), b1 is the least recently used (r2 computed its
    own copy of it, so r1 freed b1 first and r2 freed b2 later), and evicting b1 cuts the hits
    to b0 (1 revived + 1 new block for a chunk the budget caps <= 2 free). The run ends before
    the crossing that evicts b1, and the next step admits the head in both twins."""
    config = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=5, max_model_len=64)
    fast, slow = twin_schedulers(10, BLOCK, 0.0, config)
    shared = [11] * 4 + [12] * 4
    for sched in (fast, slow):
        sched.add_request(make_request("r1", [*shared, 1], 1))
        sched.add_request(make_request("r2", [*shared, *[13] * 4, 2], 3))
        while sched.has_unfinished():
            step(sched)
        sched.add_request(make_request("d", list(range(100, 126)), 10))  # takes the 7 uncached
        sched.add_request(make_request("h", [*shared, *[13] * 4, 3, 4], 1))
        while sched.running_prefill_tokens or not sched.running:
            step(sched)
    d = fast.requests["d"]
    assert fast.block_manager.num_free_blocks == 3 and d.num_computed_tokens == 26
    # d's third decode step crosses into an 8th block, which only an eviction can supply.
    k = decode_run_length(fast, 16)
    assert k == 2
    assert advance_decode(fast, k, next_tokens) == k
    for _ in range(k):
        step(slow)
    assert core_state(fast) == core_state(slow)
    for sched in (fast, slow):
        out = sched.schedule()
        assert [s.request.request_id for s in out.scheduled] == ["d", "h"]


def test_a_preempted_request_recomputed_to_its_last_token_makes_no_run() -> None:
    """A preempted request re-admitted (no prefix cache) whose recompute chunk ends one token
    short looks like a decode (it has output, one token left) but is still in prefill: its next
    step samples as a prefill's last chunk, so it starts no run, and the core matches stepping."""
    config = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=3, max_model_len=64)
    fast, slow = twin_schedulers(6, BLOCK, 0.0, config, caching=False)
    for sched in (fast, slow):
        sched.add_request(make_request("a", [1, 2, 3, 4], 12))
        sched.add_request(make_request("b", list(range(20, 28)), 12))
    seen = False
    while fast.has_unfinished():
        one_short = bool(fast.running) and all(
            r.output_token_ids and r.num_computed_tokens == r.num_tokens - 1 for r in fast.running
        )
        if one_short and fast.running_prefill_tokens:
            seen = True
            assert decode_run_length(fast, 8) == 0
        k = decode_run_length(fast, 8)
        if k:
            advance_decode(fast, k, next_tokens)
            for _ in range(k):
                step(slow)
        else:
            assert step(fast) == step(slow)
        assert core_state(fast) == core_state(slow)
    assert seen and fast.num_preemptions > 0
