"""The precise prefix index (KV events) and the approximate one (routing decisions)."""

from __future__ import annotations

import random

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvherd.block_hash import block_hash_chain
from kvherd.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
    KVEventBatch,
)
from policies.views import RequestView
from scheduler.core.approx_index import ApproxIndex
from scheduler.core.cluster_state import ClusterState
from scheduler.core.prefix_index import (
    BlockOwners,
    InstanceSlots,
    PrefixIndex,
    match_chain,
)

BS = 4


def engine_chain(tokens: list[int]) -> list[int]:
    """An engine whose hash differs from kvherd's (another algorithm, another seed)."""
    return block_hash_chain(tokens, BS, cache_salt="engine-seed", algo="sha256")


def stored(tokens: list[int], start: int, end: int) -> BlockStored:
    hashes = engine_chain(tokens)
    return BlockStored(
        block_hashes=hashes[start:end],
        parent_block_hash=hashes[start - 1] if start else None,
        token_ids=tokens[start * BS : end * BS],
        block_size=BS,
    )


def batch(seq: int, *events: KVEvent) -> KVEventBatch:
    return KVEventBatch(seq=seq, ts=0.0, events=list(events))


PROMPT = list(range(100, 124))  # 6 blocks
OTHER = PROMPT[:8] + list(range(500, 516))  # shares 2 blocks with PROMPT


def test_rehash_gives_kvherd_hashes_and_matches_leading_blocks() -> None:
    index = PrefixIndex(BS)
    index.add_instance("a")
    index.add_instance("b")
    assert index.apply_batch("a", batch(0, stored(PROMPT, 0, 3), stored(PROMPT, 3, 6))).applied
    assert index.apply_batch("b", batch(0, stored(OTHER, 0, 6))).applied
    chain = block_hash_chain(PROMPT, BS)
    assert index.blocks("a") == set(chain)
    assert index.match(chain) == {"a": 6, "b": 2}
    assert index.match(block_hash_chain(OTHER, BS)) == {"a": 2, "b": 6}
    assert index.match(block_hash_chain(list(range(900, 916)), BS)) == {}
    # Removing block 4 on a cuts its match at 4 (a prefix match stops at the first hole).
    index.apply_batch("a", batch(1, BlockRemoved([engine_chain(PROMPT)[4]])))
    assert index.match(chain) == {"a": 4, "b": 2}
    index.apply_batch("a", batch(2, AllBlocksCleared()))
    assert index.match(chain) == {"b": 2} and index.num_blocks("a") == 0


def test_gap_asks_for_replay_and_duplicates_are_skipped() -> None:
    index = PrefixIndex(BS)
    index.add_instance("a")
    assert index.apply_batch("a", batch(5, stored(PROMPT, 0, 2))).applied  # any start after join
    result = index.apply_batch("a", batch(7, stored(PROMPT, 2, 4)))
    assert not result.applied and result.need_replay_from == 6
    assert index.apply_batch("a", batch(6, stored(PROMPT, 2, 3))).applied
    assert index.apply_batch("a", batch(7, stored(PROMPT, 3, 4))).applied
    assert index.apply_batch("a", batch(6, AllBlocksCleared())).duplicate
    assert index.match(block_hash_chain(PROMPT, BS)) == {"a": 4}
    assert index.stats.gaps == 1 and index.stats.duplicates == 1


def test_unplaceable_events_are_counted_not_raised() -> None:
    index = PrefixIndex(BS)
    index.add_instance("a")
    orphan = stored(PROMPT, 2, 4)  # parent block 1 never stored
    wrong_size = BlockStored(engine_chain(PROMPT)[:1], None, PROMPT[:8], 8)
    placeholder = BlockStored(engine_chain(PROMPT)[:1], None, [], 0, medium="CPU")
    index.apply_batch("a", batch(0, orphan, wrong_size, placeholder))
    assert index.num_blocks("a") == 0
    assert (index.stats.unknown_parent, index.stats.wrong_block_size) == (1, 1)
    assert index.stats.unknown_placeholder == 1  # a location update of a block never seen


def test_trusted_engine_hashes_keep_tenant_salts() -> None:
    salted = block_hash_chain(PROMPT, BS, cache_salt="tenant-a")
    event = BlockStored(salted, None, PROMPT, BS)
    index = PrefixIndex(BS)
    index.add_instance("kvherd-agent", trust_engine_hashes=True)
    index.add_instance("vllm")
    index.apply_batch("kvherd-agent", batch(0, event))
    index.apply_batch("vllm", batch(0, event))
    assert index.match(salted) == {"kvherd-agent": 6}
    assert index.match(block_hash_chain(PROMPT, BS)) == {"vllm": 6}


def test_memory_bounds_evict_oldest_first() -> None:
    index = PrefixIndex(BS, max_blocks_per_instance=4, max_blocks_total=6)
    index.add_instance("a")
    index.add_instance("b")
    index.apply_batch("a", batch(0, stored(PROMPT, 0, 6)))
    assert index.num_blocks("a") == 4 and index.stats.evicted == 2
    assert index.blocks("a") == set(block_hash_chain(PROMPT, BS)[2:])
    index.apply_batch("b", batch(0, stored(OTHER, 0, 3)))
    assert index.num_blocks() == 6
    # Over the global bound (4 + 3 > 6): the largest instance (a) lost its oldest entry.
    assert index.num_blocks("a") == 3 and index.num_blocks("b") == 3
    index.apply_batch("b", batch(1, stored(OTHER, 3, 4)))
    # Now b is the largest: its oldest block (OTHER's first) goes.
    assert index.num_blocks("a") == 3 and index.num_blocks("b") == 3
    assert block_hash_chain(OTHER, BS)[0] not in index.blocks("b")


def test_rejoin_clears_and_slots_are_recycled() -> None:
    index = PrefixIndex(BS)
    for name in ("a", "b"):
        index.add_instance(name)
        index.apply_batch(name, batch(0, stored(PROMPT, 0, 6)))
    index.remove_instance("a")
    index.add_instance("c")  # reuses a's bit
    chain = block_hash_chain(PROMPT, BS)
    assert index.match(chain) == {"b": 6}
    index.add_instance("b")  # re-join: the view is cleared, any sequence starts it again
    assert index.match(chain) == {} and index.next_seq("b") is None


# -- property: the index equals a brute-force model ------------------------------------------

PROMPTS = [
    list(range(0, 24)),
    list(range(0, 8)) + list(range(40, 56)),
    list(range(0, 4)) + list(range(60, 76)),
    list(range(80, 100)),
    list(range(80, 92)) + list(range(120, 132)),
]
INSTANCES = ["i0", "i1", "i2"]

op = st.one_of(
    st.tuples(st.just("store"), st.sampled_from(INSTANCES), st.integers(0, 4), st.integers(1, 6)),
    st.tuples(
        st.just("remove"), st.sampled_from(INSTANCES), st.integers(0, 10**6), st.integers(1, 3)
    ),
    st.tuples(st.just("clear"), st.sampled_from(INSTANCES), st.just(0), st.just(0)),
    st.tuples(st.just("drop"), st.sampled_from(INSTANCES), st.just(0), st.just(0)),
    st.tuples(st.just("dup"), st.sampled_from(INSTANCES), st.integers(0, 10**6), st.just(0)),
    st.tuples(st.just("rejoin"), st.sampled_from(INSTANCES), st.just(0), st.just(0)),
    st.tuples(st.just("leave"), st.sampled_from(INSTANCES), st.just(0), st.just(0)),
)


class Engine:
    """What an instance really caches (engine hash -> kvherd hash) and every batch it published."""

    def __init__(self) -> None:
        self.cached: dict[int, int] = {}
        self.log: list[KVEventBatch] = []
        self.drop_next = False


def deliver(index: PrefixIndex, name: str, engine: Engine, item: KVEventBatch) -> None:
    """The subscriber's job: deliver, and on a gap replay the missing batches from the log."""
    result = index.apply_batch(name, item)
    if result.need_replay_from is not None:
        for missed in engine.log[result.need_replay_from :]:
            assert index.apply_batch(name, missed).applied


def resync(index: PrefixIndex, name: str, engine: Engine) -> None:
    """Full resync on (re)join: clear, then replay the publisher's log from sequence 0."""
    index.add_instance(name, next_seq=0)
    for item in engine.log:
        index.apply_batch(name, item)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(op, max_size=60))
def test_index_equals_brute_force_model(ops: list[tuple[str, str, int, int]]) -> None:
    index = PrefixIndex(BS)
    engines: dict[str, Engine] = {}
    for name in INSTANCES:
        engines[name] = Engine()
        index.add_instance(name, next_seq=0)
    for kind, name, a, b in ops:
        engine = engines[name]
        if name not in index and kind != "rejoin":
            continue
        events: list[KVEvent] = []
        if kind == "store":
            tokens = PROMPTS[a]
            engine_hashes, kv_hashes = engine_chain(tokens), block_hash_chain(tokens, BS)
            end = min(b, len(engine_hashes))
            start = 0
            while start < end and engine_hashes[start] in engine.cached:
                start += 1
            if start < end:
                events.append(stored(tokens, start, end))
                for k in range(start, end):
                    engine.cached[engine_hashes[k]] = kv_hashes[k]
        elif kind == "remove" and engine.cached:
            rng = random.Random(a)
            victims = rng.sample(sorted(engine.cached), min(b, len(engine.cached)))
            events.append(BlockRemoved(victims))
            for victim in victims:
                del engine.cached[victim]
        elif kind == "clear":
            events.append(AllBlocksCleared())
            engine.cached.clear()
        elif kind == "drop":
            engine.drop_next = True
        elif kind == "dup" and engine.log:
            deliver(index, name, engine, engine.log[a % len(engine.log)])
        elif kind == "rejoin":
            resync(index, name, engine)
        elif kind == "leave":
            index.remove_instance(name)
        if events:
            item = batch(len(engine.log), *events)
            engine.log.append(item)
            if engine.drop_next:
                engine.drop_next = False
            else:
                deliver(index, name, engine, item)
    for name, engine in engines.items():
        if name not in index:
            resync(index, name, engine)
        next_seq = index.next_seq(name)
        assert next_seq is not None
        # A lost tail has no later batch to reveal it; the agent's last_kv_event_seq does.
        for missed in engine.log[next_seq:]:
            assert index.apply_batch(name, missed).applied
        assert index.blocks(name) == set(engine.cached.values()), name
    for tokens in PROMPTS:
        chain = block_hash_chain(tokens, BS)
        expected = {}
        for name, engine in engines.items():
            held = set(engine.cached.values())
            depth = 0
            while depth < len(chain) and chain[depth] in held:
                depth += 1
            if depth:
                expected[name] = depth
        assert index.match(chain) == expected


trusted_op = st.tuples(
    st.sampled_from(["store", "store", "remove", "clear"]),
    st.sampled_from(INSTANCES),
    st.lists(st.integers(0, 30), max_size=8),  # block hashes (repeats within a run allowed)
)


@settings(max_examples=150, deadline=None)
@given(st.lists(trusted_op, max_size=50))
def test_trusted_hashes_equal_an_lru_model(ops: list[tuple[str, str, list[int]]]) -> None:
    """Trusted engine hashes (the simulator's stream): re-stores refresh the LRU order, the
    per-instance bound evicts the least recently stored first, and every mask matches the model."""
    check_trusted_against_lru_model(ops, bound=5, universe=31)


long_trusted_op = st.tuples(
    st.sampled_from(["store", "store", "remove", "clear"]),
    st.sampled_from(INSTANCES),
    # Prefill-sized runs (whole requests stored and freed), drawn from few hashes so that runs
    # overlap other instances' blocks, repeat blocks, name absent ones.
    st.one_of(
        st.lists(st.integers(0, 80), min_size=30, max_size=70, unique=True),
        st.lists(st.integers(0, 80), min_size=30, max_size=70),
    ),
)


@settings(max_examples=100, deadline=None)
@given(st.lists(long_trusted_op, max_size=20))
def test_long_trusted_runs_equal_an_lru_model(ops: list[tuple[str, str, list[int]]]) -> None:
    """The same model with prefill-sized runs, under a bound that some runs exceed."""
    check_trusted_against_lru_model(ops, bound=60, universe=81)


def check_trusted_against_lru_model(
    ops: list[tuple[str, str, list[int]]], bound: int, universe: int
) -> None:
    index = PrefixIndex(BS, max_blocks_per_instance=bound)
    model: dict[str, dict[int, None]] = {name: {} for name in INSTANCES}
    for name in INSTANCES:
        index.add_instance(name, trust_engine_hashes=True)
    for kind, name, hashes in ops:
        held = model[name]
        if kind == "store":
            event: KVEvent = BlockStored(hashes, None, [0] * (BS * len(hashes)), BS)
            for block in hashes:
                held.pop(block, None)
                held[block] = None
            while len(held) > bound:
                del held[next(iter(held))]
        elif kind == "remove":
            event = BlockRemoved(hashes)
            for block in hashes:
                held.pop(block, None)
        else:
            event = AllBlocksCleared()
            held.clear()
        index.apply_events(name, [event])
        # Sets, but under the bound they differ as soon as an eviction takes the wrong block.
        assert index.blocks(name) == set(held)
        assert index.num_blocks() == sum(map(len, model.values()))
        assert index.num_blocks(name) == len(held)
        for block in range(universe):
            owners = {n for n in INSTANCES if block in model[n]}
            expected = sum(index.slots.bit(n) for n in owners)
            assert index.owners.masks([block]) == [expected]


def test_events_for_an_unregistered_instance_name_it() -> None:
    index = PrefixIndex(BS)
    with pytest.raises(KeyError, match="'ghost' is not registered with KV events"):
        index.apply_events("ghost", [BlockRemoved([1])])


# -- approximate index ------------------------------------------------------------------------


def test_approx_index_ttl_refresh_and_bound() -> None:
    index = ApproxIndex(ttl_s=10.0, max_blocks_per_instance=8)
    index.add_instance("a")
    index.add_instance("b", ttl_s=2.0)
    chain = block_hash_chain(PROMPT, BS)
    index.insert("a", chain, now=0.0)
    index.insert("b", chain[:3], now=0.0)
    assert index.match(chain, now=1.0) == {"a": 6, "b": 3}
    assert index.match(chain, now=2.5) == {"a": 6}  # b's short TTL passed
    index.insert("a", chain[:2], now=8.0)  # refresh the first two blocks only
    assert index.match(chain, now=10.5) == {"a": 2}
    assert index.match(chain, now=18.5) == {}
    index.insert("a", list(range(1, 13)), now=20.0)
    assert index.num_blocks("a") == 8  # bounded: the 4 oldest were dropped
    assert index.match(list(range(1, 13)), now=20.0) == {}
    assert index.match(list(range(5, 13)), now=20.0) == {"a": 8}


def test_approx_index_rejects_bad_bounds() -> None:
    with pytest.raises(ValueError):
        ApproxIndex(ttl_s=0)


def test_approx_expiry_is_bounded_per_call_and_catches_up() -> None:
    index = ApproxIndex(ttl_s=1.0, max_expire_per_call=4)
    index.add_instance("a")
    index.add_instance("b")
    chain = list(range(1, 11))
    index.insert("a", chain, now=0.0)
    index.insert("b", chain[:3], now=0.5)
    index.insert("a", chain[:2], now=0.5)  # refreshed: now expire last
    assert index.match(chain, now=0.9) == {"a": 10, "b": 3}  # nothing due yet
    index.expire(2.0)  # 13 entries are due; 4 go per call, oldest first
    assert (index.num_blocks("a"), index.num_blocks("b")) == (6, 3)
    index.expire(2.0)
    assert (index.num_blocks("a"), index.num_blocks("b")) == (2, 3)
    assert index.match(chain, now=2.0) == {}  # a's first block went in the third call
    assert (index.num_blocks("a"), index.num_blocks("b")) == (1, 0)
    index.expire(2.0)
    assert index.num_blocks("a") == 0
    assert len(index.owners) == 0


def test_two_engine_hashes_for_the_same_tokens_are_counted() -> None:
    """An engine that names the same tokens twice (e.g. under two LoRA ids) holds the block until
    both names are removed."""
    index = PrefixIndex(BS)
    index.add_instance("a")
    other = block_hash_chain(PROMPT, BS, cache_salt="lora-2")
    index.apply_batch("a", batch(0, stored(PROMPT, 0, 6), BlockStored(other, None, PROMPT, BS)))
    chain = block_hash_chain(PROMPT, BS)
    assert index.num_blocks("a") == 12 and index.match(chain) == {"a": 6}
    index.apply_batch("a", batch(1, BlockRemoved(engine_chain(PROMPT)[3:])))
    assert index.match(chain) == {"a": 6}  # still named by the second engine hashes
    index.apply_batch("a", batch(2, BlockRemoved([*other[4:], 12345])))
    assert index.match(chain) == {"a": 4} and index.num_blocks("a") == 7
    index.apply_batch("a", batch(3, BlockRemoved(other[:4] + engine_chain(PROMPT)[:3])))
    assert index.match(chain) == {} and len(index.owners) == 0


def test_a_block_named_twice_outlives_an_evicted_name_and_a_clear_forgets_both() -> None:
    """Evictions and clears go through the same removal as `BlockRemoved`: a block keeps the
    instance's claim until its last engine hash goes, and a clear leaves no name behind."""
    index = PrefixIndex(BS, max_blocks_per_instance=8)
    index.add_instance("a")
    other = block_hash_chain(PROMPT, BS, cache_salt="lora-2")
    index.apply_batch("a", batch(0, stored(PROMPT, 0, 6), BlockStored(other, None, PROMPT, BS)))
    chain = block_hash_chain(PROMPT, BS)
    # 12 names, bound 8: the first store's 4 oldest go, the second store still names all 6.
    assert index.stats.evicted == 4 and index.num_blocks("a") == 8
    assert index.match(chain) == {"a": 6} and index.num_blocks() == 8
    index.apply_batch("a", batch(1, AllBlocksCleared()))
    assert index.match(chain) == {} and len(index.owners) == 0 and index.num_blocks() == 0
    index.apply_batch("a", batch(2, stored(PROMPT, 0, 6)))
    index.apply_batch("a", batch(3, BlockRemoved(engine_chain(PROMPT)[2:])))
    assert index.match(chain) == {"a": 2}  # no stale second name kept the removed blocks


@pytest.mark.parametrize("fleet", [5, 150])  # few matches: per-bit rendering; many: bit matrix
def test_cluster_match_array_gives_each_instance_its_depth(fleet: int) -> None:
    """The one form of the match (`ClusterState.match_array`, the mapping derived from it) against
    the depth each instance was given, over both indexes, a freed slot and shifted positions."""
    rng = random.Random(fleet)
    cluster = ClusterState(block_size=16)
    doc = [rng.randrange(32000) for _ in range(16 * 64)]
    chain = block_hash_chain(doc, 16)
    expected = {}
    for k in range(fleet):
        name = f"n{k}"
        cluster.add_instance(name, has_kv_events=k % 3 != 0)
        depth = rng.randrange(0, 65)
        if k % 3:
            cluster.apply_kv_events(name, [BlockStored(chain[:depth], None, doc[: 16 * depth], 16)])
        else:
            cluster.note_routed(name, chain[:depth], now=0.0)
        if depth:
            expected[name] = depth
    cluster.remove_instance("n1")
    expected.pop("n1", None)
    assert len(expected) > (64 if fleet > 100 else 0)
    array = cluster.match_array(chain, now=1.0)
    view = cluster.view(1.0)
    assert {view.instances[i].instance_id: int(array[i]) for i in np.flatnonzero(array)} == expected
    assert cluster.match(chain, now=1.0) == expected
    assert view.prefix_match(RequestView("r", len(doc), tuple(chain))) == expected


# -- property: the approximate index equals a brute-force model --------------------------------

CHAINS = [list(range(1, 9)), [1, 2, 3, 40, 41, 42], [50, 51, 52, 53], [1, 2, 60, 61, 62, 63, 64]]
approx_op = st.one_of(
    st.tuples(
        st.just("insert"),
        st.sampled_from(INSTANCES),
        st.integers(0, len(CHAINS) - 1),
        st.integers(0, 3),
        st.floats(0.0, 3.0),
    ),
    st.tuples(st.just("rejoin"), st.sampled_from(INSTANCES), st.just(0), st.just(0), st.just(0.0)),
    st.tuples(st.just("leave"), st.sampled_from(INSTANCES), st.just(0), st.just(0), st.just(0.0)),
)


@pytest.mark.parametrize("num_shards", [1, 64])
@settings(max_examples=150, deadline=None)
@given(st.lists(approx_op, max_size=40))
def test_approx_index_equals_brute_force_model(
    num_shards: int, ops: list[tuple[str, str, int, int, float]]
) -> None:
    """TTL, refresh on re-insert and the LRU bound, against a model that stores deadlines; one
    dict or sharded, the answers are the same."""
    ttl = {"i0": 2.0, "i1": 5.0, "i2": 1.0}
    index = ApproxIndex(ttl_s=3.0, max_blocks_per_instance=6, num_shards=num_shards)
    model: dict[str, dict[int, float]] = {}
    for name in INSTANCES:
        index.add_instance(name, ttl_s=ttl[name])
        model[name] = {}
    now = 0.0
    for kind, name, which, start, dt in ops:
        now += dt
        if kind == "rejoin":
            index.add_instance(name, ttl_s=ttl[name])
            model[name] = {}
            continue
        if kind == "leave":
            index.remove_instance(name)
            model.pop(name, None)
            continue
        if name not in model:
            continue
        chain = CHAINS[which][start:]
        index.insert(name, chain, now)
        held = model[name]
        for block in dict.fromkeys(chain):  # re-inserted blocks move to the end
            held.pop(block, None)
            held[block] = now + ttl[name]
        while len(held) > 6:
            del held[next(iter(held))]
        for chain in CHAINS:
            expected = {}
            for instance, blocks in model.items():
                depth = 0
                while depth < len(chain) and blocks.get(chain[depth], -1.0) > now:
                    depth += 1
                if depth:
                    expected[instance] = depth
            assert index.match(chain, now) == expected
    index.expire(now)  # expiry is lazy: only calls apply it
    for instance, blocks in model.items():
        assert index.num_blocks(instance) == sum(deadline > now for deadline in blocks.values())


@given(
    st.lists(
        st.tuples(
            st.booleans(),  # add or discard
            st.integers(0, 5),  # instance slot
            st.lists(st.integers(0, 40), max_size=12),  # block hashes (low bits collide)
        ),
        max_size=60,
    )
)
def test_sharded_owners_equal_one_dict(ops: list[tuple[bool, int, list[int]]]) -> None:
    """One class for any shard count: split over shards, the answers are one dict's."""
    plain, sharded = BlockOwners(), BlockOwners(num_shards=4)
    universe = list(range(41))
    for add, slot, hashes in ops:
        if add:
            hashes = list(dict.fromkeys(hashes))  # add_many's callers pass distinct hashes
            plain.add_many(hashes, 1 << slot)
            sharded.add_many(hashes, 1 << slot)
        else:
            plain.discard_many(hashes, 1 << slot)
            sharded.discard_many(hashes, 1 << slot)
        assert sharded.masks(universe) == plain.masks(universe)
        assert len(sharded) == len(plain)  # blocks nobody holds are dropped in both
        for chunk in (hashes, universe[:6], universe[30:]):
            nobody = not any(plain.masks(chunk))
            assert plain.holds_none(chunk) == sharded.holds_none(chunk) == nobody
    with pytest.raises(ValueError):
        BlockOwners(num_shards=3)


# -- property: the chunked walk over long chains equals a block-by-block walk ------------------


@settings(max_examples=200, deadline=None)
@given(
    st.lists(  # per instance: a held prefix, holes punched in it, whether it is pending instead
        st.tuples(
            st.one_of(st.sampled_from([16, 48, 112]), st.integers(0, 140)),  # chunk ends or any
            st.lists(st.integers(0, 139), max_size=3),
            st.booleans(),
        ),
        min_size=1,
        max_size=6,
    ),
    st.integers(1, 140),
)
def test_long_chain_walk_equals_block_by_block(
    held: list[tuple[int, list[int], bool]], length: int
) -> None:
    """Chains span several walk chunks (16, 32, 64, ...): whole chunks under one mask, instances
    dropping out at a chunk's first block, in its middle, or nowhere, over two maps OR-ed."""
    chain = list(range(1000, 1000 + length))
    slots, precise, pending = InstanceSlots(), BlockOwners(), BlockOwners()
    expected = {}
    for k, (depth, holes, is_pending) in enumerate(held):
        blocks = [b for i, b in enumerate(chain[:depth]) if i not in holes]
        (pending if is_pending else precise).add_many(blocks, slots.bit(f"i{k}"))
        matched = 0
        while matched < length and matched < depth and matched not in holes:
            matched += 1
        if matched:
            expected[f"i{k}"] = matched
    assert match_chain(chain, (precise, pending), slots) == expected
