"""The torch-free engine core: block manager and batch scheduler, driven without a model.

A deterministic next-token function stands in for the forward pass; the block accounting, prefix
cache, preemption and KV events under test are the real ones.
"""

from __future__ import annotations

import contextlib
import random
from collections import OrderedDict
from collections.abc import Sequence

import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from instance_agent.engine.core.batch_scheduler import (
    BatchScheduler,
    SchedulerConfig,
    SchedulerOutput,
)
from instance_agent.engine.core.block_manager import BlockManager
from instance_agent.engine.core.request import InvalidRequestError, Request, SamplingParams
from kvherd.block_hash import block_hash_chain, next_block_hash
from kvherd.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent

BLOCK = 4


def next_token(tokens: Sequence[int]) -> int:
    """A pure function of the whole sequence, like greedy decoding of a fixed model."""
    return xxhash.xxh32_intdigest(bytes(t % 256 for t in tokens[-8:])) % 200 + 1


def make_request(rid: str, prompt: list[int], max_tokens: int, arrival: float = 0.0) -> Request:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return Request(rid, prompt, params, block_size=BLOCK, arrival_time=arrival)


def step(sched: BatchScheduler) -> tuple[SchedulerOutput, list[Request]]:
    out = sched.schedule()
    sampled = {
        s.request.request_id: next_token(s.request.token_ids) for s in out.scheduled if s.samples
    }
    return out, sched.update_from_output(out, sampled)


def run_to_completion(sched: BatchScheduler, max_steps: int = 10_000) -> dict[str, list[int]]:
    outputs: dict[str, list[int]] = {}
    for _ in range(max_steps):
        if not sched.has_unfinished():
            return outputs
        _, finished = step(sched)
        for req in finished:
            outputs[req.request_id] = req.output_token_ids
        sched.block_manager.check_integrity()
    raise AssertionError("scheduler did not finish")


def replay_cached(events: list[KVEvent], state: set[int]) -> set[int]:
    for event in events:
        if isinstance(event, BlockStored):
            state.update(event.block_hashes)
        elif isinstance(event, BlockRemoved):
            state.difference_update(event.block_hashes)
        elif isinstance(event, AllBlocksCleared):
            state.clear()
    return state


def cached_hashes(bm: BlockManager) -> set[int]:
    return set(bm.cached_block_hashes())


def test_prefix_hit_skips_computed_tokens_and_keeps_output() -> None:
    prompt = list(range(1, 23))  # 22 tokens: 5 full blocks
    bm = BlockManager(64, BLOCK)
    sched = BatchScheduler(SchedulerConfig(max_model_len=256), bm)
    sched.add_request(make_request("a", prompt, 6))
    first = run_to_completion(sched)["a"]
    sched.add_request(make_request("b", prompt, 6))
    out, _ = step(sched)
    assert out.scheduled[0].num_computed_before == 20  # 5 cached blocks skipped
    assert out.scheduled[0].num_new_tokens == 2
    second = run_to_completion(sched)
    assert second["b"] == first
    assert sched.prefix_cache_hits == 20
    assert bm.num_free_blocks == bm.num_blocks


def test_fully_cached_block_aligned_prompt_still_computes_last_block() -> None:
    prompt = list(range(1, 17))  # exactly 4 blocks
    bm = BlockManager(32, BLOCK)
    sched = BatchScheduler(SchedulerConfig(max_model_len=128), bm)
    sched.add_request(make_request("a", prompt, 2))
    run_to_completion(sched)
    sched.add_request(make_request("b", prompt, 2))
    out, _ = step(sched)
    assert out.scheduled[0].num_computed_before == 12
    assert out.scheduled[0].num_new_tokens == 4


def test_chunked_prefill_respects_token_budget() -> None:
    bm = BlockManager(64, BLOCK)
    sched = BatchScheduler(SchedulerConfig(max_num_batched_tokens=8, max_model_len=128), bm)
    sched.add_request(make_request("a", list(range(1, 21)), 3))
    sizes = []
    while sched.has_unfinished():
        out, _ = step(sched)
        sizes.append(out.num_batched_tokens)
        assert out.num_batched_tokens <= 8
    assert sizes[:3] == [8, 8, 4]


def test_preemption_by_recompute_gives_identical_outputs() -> None:
    prompts = {f"r{i}": [i + 1] * 3 + list(range(10 + i, 20 + i)) for i in range(6)}
    big = BatchScheduler(SchedulerConfig(max_model_len=128), BlockManager(256, BLOCK))
    small = BatchScheduler(
        SchedulerConfig(max_model_len=128), BlockManager(14, BLOCK, watermark=0.0)
    )
    for sched in (big, small):
        for i, (rid, prompt) in enumerate(prompts.items()):
            sched.add_request(make_request(rid, prompt, 24, arrival=float(i)))
    expected = run_to_completion(big)
    got = run_to_completion(small)
    assert small.num_preemptions > 0
    assert got == expected
    assert small.block_manager.num_free_blocks == 14


def test_newest_request_is_preempted_first() -> None:
    bm = BlockManager(6, BLOCK, watermark=0.0)
    sched = BatchScheduler(SchedulerConfig(max_model_len=64), bm)
    sched.add_request(make_request("old", [1] * 7, 12, arrival=0.0))
    sched.add_request(make_request("new", [2] * 7, 12, arrival=1.0))
    preempted: list[str] = []
    while sched.has_unfinished():
        out, _ = step(sched)
        preempted += [r.request_id for r in out.preempted]
    assert preempted and set(preempted) == {"new"}


def test_priority_orders_admission() -> None:
    bm = BlockManager(64, BLOCK)
    sched = BatchScheduler(SchedulerConfig(max_num_seqs=1, max_model_len=64), bm)
    low = make_request("low", [1, 2, 3], 1, arrival=0.0)
    high = make_request("high", [4, 5, 6], 1, arrival=1.0)
    high.priority = -1
    sched.add_request(low)
    sched.add_request(high)
    out, _ = step(sched)
    assert [s.request.request_id for s in out.scheduled] == ["high"]


def test_refuses_before_allocating() -> None:
    bm = BlockManager(8, BLOCK, watermark=0.0)
    sched = BatchScheduler(SchedulerConfig(max_model_len=64), bm)
    for prompt, max_tokens in (([1] * 64, 1), ([1] * 10, 40), ([], 1)):
        try:
            sched.add_request(make_request("x", prompt, max_tokens))
        except InvalidRequestError:
            pass
        else:
            raise AssertionError("expected a refusal")
    assert bm.num_free_blocks == 8 and not sched.has_unfinished()


def test_events_name_parent_and_tokens() -> None:
    bm = BlockManager(16, BLOCK)
    sched = BatchScheduler(SchedulerConfig(max_model_len=64), bm)
    req = make_request("a", list(range(1, 10)), 1)
    sched.add_request(req)
    run_to_completion(sched)
    events = bm.take_events()
    stored = [e for e in events if isinstance(e, BlockStored)]
    assert stored[0].block_hashes == req.block_hashes[:2]
    assert stored[0].parent_block_hash is None
    assert stored[0].token_ids == list(range(1, 9))
    assert stored[0].block_size == BLOCK


def test_engine_events_carry_tokens_as_vllm_sends_them() -> None:
    """The block manager hands BlockStored its uint32 tokens; every reader sees a list of ints:
    attribute, equality, repr and the msgpack wire form."""
    from kvherd.kv_events import KVEventBatch, decode_batch, encode_batch

    bm = BlockManager(16, BLOCK)
    sched = BatchScheduler(SchedulerConfig(max_model_len=64), bm)
    prompt = [70_000, *range(1, 9)]  # an id past 16 bits survives the uint32 slice
    req = make_request("a", prompt, 1)
    sched.add_request(req)
    run_to_completion(sched)
    (stored,) = [e for e in bm.take_events() if isinstance(e, BlockStored)]
    # The tokens are the event's own copy: the request's sequence changing before anyone reads
    # them does not change them.
    req.token_ids[0] = 5
    as_lists = BlockStored(req.block_hashes[:2], None, prompt[:8], BLOCK, medium="GPU")
    assert stored == as_lists and as_lists == stored
    assert repr(stored) == repr(as_lists)
    assert type(stored.token_ids) is list and stored.token_ids == prompt[:8]
    batch = KVEventBatch(1, 0.5, [stored])
    assert decode_batch(1, encode_batch(batch)).events == [as_lists]


def test_reserve_share_and_transfer_for_migration() -> None:
    bm = BlockManager(10, BLOCK, watermark=0.2)
    assert bm.reserve_blocks("mig", 9) is None  # would dip below the watermark
    assert bm.num_free_blocks == 10
    got = bm.reserve_blocks("mig", 3)
    assert got is not None and len(got) == 3
    bm.transfer_owner("mig", "req")
    assert bm.block_ids("req") == got and bm.block_ids("mig") == []
    bm.check_integrity()
    bm.free_owner("req")
    assert bm.num_free_blocks == 10
    bm.check_integrity()


ops = st.lists(
    st.one_of(
        st.tuples(st.just("add"), st.integers(1, 30), st.integers(1, 12), st.integers(0, 3)),
        st.tuples(st.just("step"), st.integers(1, 4)),
        st.tuples(st.just("abort"), st.integers(0, 40)),
    ),
    max_size=60,
)


@settings(max_examples=60, deadline=None)
@given(ops=ops, num_blocks=st.integers(8, 40), budget=st.integers(2, 32))
def test_random_operations_keep_integrity_and_events_replay(
    ops: list[tuple], num_blocks: int, budget: int
) -> None:
    bm = BlockManager(num_blocks, BLOCK, watermark=0.0)
    sched = BatchScheduler(
        SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=budget, max_model_len=48), bm
    )
    replayed: set[int] = set()
    added = 0
    for op in ops:
        if op[0] == "add":
            _, length, max_tokens, family = op
            prompt = [family + 1] * 5 + list(range(100, 100 + length))  # shared family prefixes
            with contextlib.suppress(InvalidRequestError):
                sched.add_request(make_request(f"r{added}", prompt, max_tokens, float(added)))
            added += 1
        elif op[0] == "step":
            for _ in range(op[1]):
                step(sched)
        else:
            sched.abort_request(f"r{op[1]}")
        bm.check_integrity()
        replayed = replay_cached(bm.take_events(), replayed)
        assert replayed == cached_hashes(bm)
        # Every full computed block was offered to the cache when its step ended (steps that
        # fill no block skip the call): caching again now finds nothing new.
        for request in sched.running:
            bm.cache_full_blocks(request)
        assert bm.take_events() == []
        assert sched.num_waiting_tokens == sum(
            r.num_tokens - r.num_computed_tokens for r in sched.waiting
        )
    for rid in list(sched.requests):
        sched.abort_request(rid)
    bm.check_integrity()
    assert bm.num_free_blocks == num_blocks and not bm.owners()
    assert replay_cached(bm.take_events(), replayed) == cached_hashes(bm)


def test_kv_event_batches_round_trip_and_read_vllm_map_form() -> None:
    import msgpack

    from kvherd.kv_events import KVEventBatch, decode_batch, encode_batch

    stored = BlockStored([1, 2], None, list(range(8)), 4)
    batch = KVEventBatch(7, 1.5, [stored, BlockRemoved([1]), AllBlocksCleared()], dp_rank=0)
    assert decode_batch(7, encode_batch(batch)) == batch
    # Newer vLLM releases encode each event as a tagged map with extra keys; hashes may be bytes.
    wire = [
        2.0,
        [
            {
                "type": "BlockStored",
                "block_hashes": [(5).to_bytes(8, "big")],
                "parent_block_hash": None,
                "token_ids": [1, 2, 3, 4],
                "block_size": 4,
                "lora_id": None,
                "medium": "GPU",
                "lora_name": None,
                "group_idx": 0,
            },
            {"type": "BlockRemoved", "block_hashes": [5], "medium": "GPU"},
        ],
        0,
    ]
    decoded = decode_batch(3, msgpack.packb(wire))
    assert decoded.events == [
        BlockStored([5], None, [1, 2, 3, 4], 4, None, "GPU"),
        BlockRemoved([5], "GPU"),
    ]


def test_evictions_in_a_row_are_one_removed_event_and_reset_clears_all() -> None:
    bm = BlockManager(4, BLOCK, watermark=0.0)
    sched = BatchScheduler(SchedulerConfig(max_model_len=64), bm)
    first = make_request("a", list(range(1, 10)), 1)  # 9 tokens: 2 full blocks cached, 3 held
    sched.add_request(first)
    run_to_completion(sched)
    bm.take_events()
    sched.add_request(make_request("b", list(range(50, 65)), 1))  # its prefill takes all 4 blocks
    step(sched)
    removed = [e for e in bm.take_events() if isinstance(e, BlockRemoved)]
    assert len(removed) == 1 and set(removed[0].block_hashes) == set(first.block_hashes[:2])
    run_to_completion(sched)
    assert bm.num_cached_blocks > 0 and bm.reset_prefix_cache()
    assert isinstance(bm.take_events()[-1], AllBlocksCleared)
    assert bm.num_cached_blocks == 0 and bm.num_free_blocks == 4
    bm.check_integrity()


# -- bulk block paths ----------------------------------------------------------------------------
def fill_with_cached(bm: BlockManager, num_requests: int, prompt_len: int) -> None:
    """Run requests to completion so their full blocks sit in the cache, evictable."""
    sched = BatchScheduler(SchedulerConfig(max_model_len=256), bm)
    for i in range(num_requests):
        sched.add_request(make_request(f"fill{i}", [200 + i, *range(1, prompt_len)], 1))
    run_to_completion(sched)


def test_one_block_evictions_equal_a_bulk_eviction_past_stale_entries() -> None:
    """Decode crossings evict one block at a time (`allocate_slots` of one block): the same
    victims, in the same order, with the same merged event, as one bulk reservation evicting
    them all, also when prefix hits left stale LRU entries to skip."""
    twins = [BlockManager(16, BLOCK, watermark=0.0) for _ in range(2)]
    for bm in twins:
        fill_with_cached(bm, 4, 13)  # 12 cached blocks, evictable; 4 uncached free
        reviver = make_request("hit", [201, *range(1, 13)], 1)  # fill1's prompt: 3 blocks
        hits, _ = bm.get_computed_blocks(reviver)
        assert len(hits) == 3 and bm.allocate_slots(reviver, 1, hits)  # 3 revived, 1 new block
        bm.free(reviver)  # back to the LRU tail, leaving 3 stale entries behind
        bm.take_events()
    one_by_one, bulk = twins
    for i in range(10):
        assert one_by_one.allocate_slots(make_request(f"d{i}", [i + 1], 1), 1)
    assert bulk.reserve_blocks("r", 10, respect_watermark=False) is not None
    removed = one_by_one.take_events()
    assert removed == bulk.take_events() and len(removed) == 1
    # 4 uncached blocks first, then 6 evictions (the revived blocks are now the newest).
    assert isinstance(removed[0], BlockRemoved) and len(removed[0].block_hashes) == 6
    assert [one_by_one.block_ids(f"d{i}")[0] for i in range(10)] == bulk.block_ids("r")
    one_by_one.check_integrity()
    bulk.check_integrity()


def test_prefix_hit_stops_at_a_hash_collision() -> None:
    """A cached block whose hash matches but whose tokens differ is never served."""
    bm = BlockManager(32, BLOCK)
    fill_with_cached(bm, 1, 17)  # prompt [200, 1..16]: four full blocks cached
    owner = make_request("owner", [200, *range(1, 17)], 1)
    probe = make_request("probe", [200, *range(1, 9), *[99] * 8, 5], 1)
    probe.block_hashes[:4] = owner.block_hashes[:4]  # forge a collision on blocks 2 and 3
    hits, num_hit = bm.get_computed_blocks(probe)
    assert hits == bm.lookup_cached_prefix(owner.block_hashes[:2]) and num_hit == 2 * BLOCK
    same, _ = bm.get_computed_blocks(make_request("twin", [200, *range(1, 17)], 1))
    assert same == bm.lookup_cached_prefix(owner.block_hashes[:4])


def test_caching_a_run_that_repeats_a_hash_keeps_the_first_copy() -> None:
    """A (forged) 64-bit collision inside one prefill: the first block stays cached under the
    hash, the repeat is skipped and splits the stored run, the maps stay consistent."""
    bm = BlockManager(16, BLOCK)
    request = make_request("r", list(range(1, 22)), 1)  # five full blocks
    request.block_hashes[3] = request.block_hashes[1]
    assert bm.allocate_slots(request, 21)
    request.num_computed_tokens = 21
    bm.cache_full_blocks(request)
    table = bm.block_ids("r")
    stored = [e for e in bm.take_events() if isinstance(e, BlockStored)]
    assert [e.block_hashes for e in stored] == [request.block_hashes[:3], request.block_hashes[4:5]]
    assert stored[1].parent_block_hash == request.block_hashes[3]
    assert bm.lookup_cached_prefix(request.block_hashes[1:2]) == [table[1]]
    assert bm.num_cached_blocks == 4
    bm.check_integrity()
    bm.free_owner("r")
    bm.check_integrity()
    assert bm.num_free_blocks == 16


def test_token_ids_are_uint32_and_bad_ids_are_refused_without_change() -> None:
    req = make_request("a", [1, 2, 3, 4, 5], 4)
    assert req.token_ids.itemsize == 4 and req.token_ids.tolist() == [1, 2, 3, 4, 5]
    prompt = req.prompt_token_ids
    assert type(prompt) is list and prompt == [1, 2, 3, 4, 5]
    prompt.append(9)  # a copy: the request is unchanged
    assert req.num_tokens == 5
    assert make_request("b", b"\x01\x02\x03", 4).token_ids.tolist() == [1, 2, 3]  # type: ignore[arg-type]
    for bad in ([1, -1], [2**32], [1, "x"]):
        try:
            make_request("b", bad, 4)  # type: ignore[arg-type]
        except InvalidRequestError as exc:
            assert exc.param == "prompt"
        else:
            raise AssertionError(f"prompt {bad!r} was accepted")
    for bad_token in (-3, 2**32):
        try:
            req.append_output_token(bad_token)
        except InvalidRequestError as exc:
            assert exc.param == "output_token_ids"
        else:
            raise AssertionError(f"token {bad_token} was accepted")
    assert req.num_tokens == 5 and req.output_token_ids == []
    req.append_output_token(7)
    assert req.token_ids.tolist() == [1, 2, 3, 4, 5, 7] and req.output_token_ids == [7]


def test_block_hashes_grown_one_block_at_a_time_equal_the_chain() -> None:
    for salt in (None, "tenant"):
        params = SamplingParams(max_tokens=64, ignore_eos=True)
        req = Request("a", [5, 6, 7], params, block_size=BLOCK, cache_salt=salt)
        for token in range(40):
            req.append_output_token(token % 7 + 1)
        assert req.block_hashes == block_hash_chain(req.token_ids, BLOCK, salt)
        assert next_block_hash(req.block_hashes[2], req.token_ids[12:16]) == req.block_hashes[3]
    sha = Request("s", list(range(9)), SamplingParams(), BLOCK, hash_algo="sha256")
    sha.append_output_token(3)
    sha.append_output_token(4)
    sha.append_output_token(5)
    assert sha.block_hashes == block_hash_chain(sha.token_ids, BLOCK, None, "sha256")


def test_prefix_hit_admission_caches_only_the_blocks_computed_after_it() -> None:
    bm = BlockManager(32, BLOCK, watermark=0.0)
    sched = BatchScheduler(SchedulerConfig(max_model_len=64), bm)
    shared = list(range(1, 13))  # three full blocks
    sched.add_request(make_request("a", [*shared, 50], 1))
    run_to_completion(sched)
    bm.take_events()
    # Hits cover the three shared blocks; the first step computes one token and fills nothing.
    b = make_request("b", [*shared, 60], 6)
    sched.add_request(b)
    out, _ = step(sched)
    assert b.num_cached_tokens == 12 and out.scheduled[0].num_new_tokens == 1
    assert bm.take_events() == []
    run_to_completion(sched)
    stored = [e for e in bm.take_events() if isinstance(e, BlockStored)]
    assert [e.block_hashes for e in stored] == [[b.block_hashes[3]]]
    assert stored[0].parent_block_hash == b.block_hashes[2]
    assert stored[0].token_ids == b.token_ids[12:16].tolist()


# -- LRU order ----------------------------------------------------------------------------------
@pytest.mark.parametrize("seed", range(4))
def test_eviction_order_and_free_counts_follow_an_lru_model(seed: int) -> None:
    """Prefix hits revive evictable blocks (their lazily pruned LRU entries go stale, many
    enough to compact the list) and frees append tail-first: every eviction takes exactly the
    block an OrderedDict LRU model names, and `num_free_before_evicting` counts as the model."""
    rng = random.Random(seed)
    bm = BlockManager(48, BLOCK, watermark=0.0)
    # Prompts from a few families sharing prefixes, so hits revive blocks again and again.
    prompts = [
        [family + 1] * (BLOCK * rng.randint(0, 3)) + list(range(50, 50 + rng.randint(2, 18)))
        for family in range(4)
        for _ in range(6)
    ]
    refs: dict[int, int] = {}
    cached: dict[int, int] = {}  # model: block hash -> block id
    lru: OrderedDict[int, None] = OrderedDict()  # model: evictable block ids, oldest first
    live: list[Request] = []
    for op in range(600):
        if live and (len(live) > 3 or rng.random() < 0.45):
            request = live.pop(rng.randrange(len(live)))
            table = bm.block_ids(request.request_id)
            for block_id in reversed(table):
                refs[block_id] -= 1
                if not refs[block_id] and block_id in cached.values():
                    lru[block_id] = None
            bm.free(request)
        else:
            request = make_request(f"q{op}", rng.choice(prompts), 4)
            hits, num_hit = bm.get_computed_blocks(request)
            if not bm.allocate_slots(request, request.num_tokens - num_hit, hits):
                continue
            for block_id in hits:  # revived: out of the LRU list
                lru.pop(block_id, None)
                refs[block_id] = refs.get(block_id, 0) + 1
            table = bm.block_ids(request.request_id)
            for block_id in table[len(hits) :]:
                refs[block_id] = 1
            request.num_computed_tokens = request.num_tokens
            bm.cache_full_blocks(request)
            live.append(request)
        for event in bm.take_events():
            if isinstance(event, BlockRemoved):
                for h in event.block_hashes:
                    oldest, _ = lru.popitem(last=False)
                    assert cached.pop(h) == oldest, "evicted a block the LRU model does not name"
            elif isinstance(event, BlockStored):
                first = request.block_hashes.index(event.block_hashes[0])
                for index, h in enumerate(event.block_hashes, first):
                    cached[h] = bm.block_ids(request.request_id)[index]
        bm.check_integrity()
        free_uncached = bm.num_free_blocks - len(lru)
        hashes = rng.sample(list(cached), min(3, len(cached)))
        targets = {cached[h] for h in hashes} & lru.keys()
        order = list(lru)
        expected = next((i for i, b in enumerate(order) if b in targets), len(order))
        assert bm.num_free_before_evicting(hashes, 48) == free_uncached + expected
    assert set(cached) == set(bm.cached_block_hashes())


def test_cached_prefixes_are_whole_chains_hottest_first_within_the_bound() -> None:
    """What a scale-in hands over: every cached prefix as a chain from its first block (hashes
    and tokens as a request would hash them), chains sharing heads, the most recent first, and
    no more distinct blocks than asked for."""
    bm = BlockManager(64, BLOCK)
    sched = BatchScheduler(SchedulerConfig(max_model_len=256), bm)
    shared = list(range(1, 9))  # two full blocks every prompt below starts with
    prompts = {
        "old": [*shared, 50, 51, 52, 53, 54],  # three full blocks (the last token is partial)
        "mid": [*shared, 60, 61, 62, 63, 64],
        "new": [70, 71, 72, 73, 74],  # one full block of its own
    }
    for rid, prompt in prompts.items():
        sched.add_request(make_request(rid, prompt, 1))
        run_to_completion(sched)
    found = bm.cached_prefixes(max_blocks=64)
    tokens = [memoryview(packed).cast("I").tolist() for _, packed in found]
    assert tokens == [[70, 71, 72, 73], [*shared, 60, 61, 62, 63], [*shared, 50, 51, 52, 53]]
    for (hashes, _), chain_tokens in zip(found, tokens, strict=True):
        assert hashes == block_hash_chain(chain_tokens, BLOCK)
    # A hit revives "old": its chain comes first now. The bound counts the shared heads once.
    sched.add_request(make_request("again", [*prompts["old"], 99, 98, 97], 1))
    run_to_completion(sched)
    assert [len(h) for h, _ in bm.cached_prefixes(max_blocks=64)] == [4, 1, 3]  # it grew a block
    assert [len(h) for h, _ in bm.cached_prefixes(max_blocks=5)] == [4, 1]
    assert [len(h) for h, _ in bm.cached_prefixes(max_blocks=6)] == [4, 1, 3]
    assert bm.cached_prefixes(max_blocks=3) == []
