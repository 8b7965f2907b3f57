"""KV tiers in the torch-free engine core: blocks move GPU -> CPU -> disk and load back.

A fake KV memory (one token id per slot, per medium) runs the core's copy orders the way the torch
side does: offloads in order before the step's forward pass, loads any time before they are
reported. Every scheduled chunk first checks that the KV it reads is the request's own tokens, so
a copy run out of order, a slot reused under a load, or a block served to the wrong prompt fails.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from instance_agent.engine.core.batch_scheduler import BatchScheduler, KVLoad, SchedulerConfig
from instance_agent.engine.core.block_manager import BlockManager
from instance_agent.engine.core.request import Request, RequestStatus, SamplingParams
from instance_agent.engine.core.tiers import BlockCopy, SlotEntry, TierConfig, TierStore
from kvherd.kv_events import (
    MEDIUM_CPU,
    MEDIUM_GPU,
    MEDIUM_STORAGE,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
)

BLOCK = 4


def next_token(tokens: Sequence[int]) -> int:
    return (sum(tokens[-5:]) * 31 + len(tokens)) % 200 + 1


def make_request(rid: str, prompt: list[int], max_tokens: int = 2) -> Request:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return Request(rid, prompt, params, block_size=BLOCK)


def tiered(gpu: int, cpu: int = 0, disk: int = 0) -> BlockManager:
    configs = [TierConfig(m, n) for m, n in ((MEDIUM_CPU, cpu), (MEDIUM_STORAGE, disk)) if n]
    tiers = TierStore(configs, BLOCK) if configs else None
    return BlockManager(gpu, BLOCK, watermark=0.0, tiers=tiers)


class FakeKV:
    """Token ids as KV, per medium and block or slot; `copy` runs one `BlockCopy`."""

    def __init__(self, bm: BlockManager) -> None:
        self.mem: dict[str, list[list[int | None]]] = {
            MEDIUM_GPU: [[None] * BLOCK for _ in range(bm.num_blocks)]
        }
        for tier in bm.tiers.tiers if bm.tiers else ():
            self.mem[tier.medium] = [[None] * BLOCK for _ in range(tier.num_blocks)]

    def copy(self, order: BlockCopy) -> None:
        self.mem[order.dst_medium][order.dst] = list(self.mem[order.src_medium][order.src])


class Replayed:
    """The per-medium block sets a consumer rebuilds from the events, checked as they come."""

    def __init__(self) -> None:
        self.blocks: dict[str | None, set[int]] = {}

    def apply(self, events: list[KVEvent]) -> None:
        for event in events:
            if isinstance(event, BlockStored):
                held = self.blocks.setdefault(event.medium, set())
                assert held.isdisjoint(event.block_hashes), f"stored twice on {event.medium}"
                held.update(event.block_hashes)
            elif isinstance(event, BlockRemoved):
                held = self.blocks.setdefault(event.medium, set())
                assert held >= set(event.block_hashes), f"removed unknown on {event.medium}"
                held.difference_update(event.block_hashes)
            else:
                assert isinstance(event, AllBlocksCleared)
                self.blocks.clear()

    def check(self, bm: BlockManager) -> None:
        assert self.blocks.get(MEDIUM_GPU, set()) == set(bm.cached_block_hashes())
        for medium, hashes in (bm.tiers.block_hashes() if bm.tiers else {}).items():
            assert self.blocks.get(medium, set()) == set(hashes), medium


class Driver:
    """Steps a scheduler with the fake KV; loads land `load_delay(rng)` steps after they start."""

    def __init__(self, sched: BatchScheduler, seed: int = 0, max_delay: int = 0) -> None:
        self.sched = sched
        self.bm = sched.block_manager
        self.kv = FakeKV(self.bm)
        self.events = Replayed()
        self.rng = random.Random(seed)
        self.max_delay = max_delay
        self.pending: list[tuple[int, KVLoad]] = []
        self.outputs: dict[str, list[int]] = {}
        self.computed_tokens = 0
        self.fail_loads = False

    def step(self) -> None:
        sched, kv = self.sched, self.kv
        out = sched.schedule()
        for order in self.bm.take_offloads():
            kv.copy(order)
        self.pending += [(self.rng.randint(0, self.max_delay), load) for load in out.loads]
        gpu = kv.mem[MEDIUM_GPU]
        sampled = {}
        for item in out.scheduled:
            req, table = item.request, item.block_ids
            for pos in range(item.num_computed_before):  # attention reads the computed KV
                assert gpu[table[pos // BLOCK]][pos % BLOCK] == req.token_ids[pos], (req, pos)
            for pos in range(
                item.num_computed_before, item.num_computed_before + item.num_new_tokens
            ):
                gpu[table[pos // BLOCK]][pos % BLOCK] = req.token_ids[pos]
            self.computed_tokens += item.num_new_tokens
            if item.samples:
                sampled[req.request_id] = next_token(req.token_ids)
        for req in sched.update_from_output(out, sampled):
            self.outputs[req.request_id] = req.output_token_ids
        still = []
        for delay, load in self.pending:
            if delay > 0:
                still.append((delay - 1, load))
                continue
            if not self.fail_loads:
                for order in load.copies:
                    kv.copy(order)
            sched.finish_load(load.request_id, ok=not self.fail_loads)
        self.pending = still
        self.bm.check_integrity()
        self.events.apply(self.bm.take_events())
        self.events.check(self.bm)

    def run(self, max_steps: int = 5_000) -> dict[str, list[int]]:
        for _ in range(max_steps):
            if not self.sched.has_unfinished():
                return self.outputs
            self.step()
        raise AssertionError("did not finish")


def scheduler(bm: BlockManager, max_num_seqs: int = 8) -> BatchScheduler:
    return BatchScheduler(
        SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=32, max_model_len=64),
        bm,
    )


def serve(driver: Driver, rid: str, prompt: list[int]) -> Request:
    request = make_request(rid, prompt)
    driver.sched.add_request(request)
    driver.run()
    return request


PROMPT_A = list(range(1, 14))  # 13 tokens: 3 full blocks cached, the 4th holds the last token
PROMPT_B = list(range(101, 114))


def test_evicted_blocks_move_down_a_tier_store_first_then_removal() -> None:
    bm = tiered(gpu=4, cpu=3, disk=3)
    driver = Driver(scheduler(bm))
    first = serve(driver, "a", PROMPT_A)
    a_hashes = first.block_hashes[:3]
    serve(driver, "b", PROMPT_B)  # needs all 4 blocks: A's 3 cached blocks are evicted
    assert set(a_hashes) <= set(bm.tiers.block_hashes()[MEDIUM_CPU]) if bm.tiers else False
    assert not set(a_hashes) & set(bm.cached_block_hashes())
    # Order on the wire: each block stored on the CPU before the GPU says it is gone.
    bm2 = tiered(gpu=4, cpu=3)
    sched = scheduler(bm2)
    sched.add_request(make_request("a", PROMPT_A))
    while sched.has_unfinished():
        out = sched.schedule()
        sched.update_from_output(out, {s.request.request_id: 7 for s in out.scheduled if s.samples})
    bm2.take_events()
    sched.add_request(make_request("b", PROMPT_B))
    sched.schedule()
    events = bm2.take_events()
    moved = [e for e in events if e.medium == MEDIUM_CPU]  # type: ignore[union-attr]
    assert [h for e in moved for h in e.block_hashes] == [*reversed(a_hashes)]  # tail first
    assert all(isinstance(e, BlockStored) and e.block_size == BLOCK for e in moved)
    assert moved[0].parent_block_hash == a_hashes[1]  # type: ignore[union-attr]
    assert moved[0].token_ids == PROMPT_A[8:12]  # type: ignore[union-attr]
    removed = events.index(BlockRemoved(list(reversed(a_hashes)), MEDIUM_GPU))
    assert removed > max(events.index(e) for e in moved)
    copies = bm2.take_offloads()
    assert [(c.src_medium, c.dst_medium) for c in copies] == [(MEDIUM_GPU, MEDIUM_CPU)] * 3


def test_a_full_cpu_tier_pushes_its_oldest_block_to_disk_and_a_full_disk_drops() -> None:
    bm = tiered(gpu=4, cpu=2, disk=2)
    driver = Driver(scheduler(bm))
    prompts = [[base + i for i in range(13)] for base in (1, 101, 201, 301)]
    requests = [serve(driver, f"r{n}", p) for n, p in enumerate(prompts)]
    assert bm.tiers is not None
    held = bm.tiers.block_hashes()
    # Each prompt evicts the one before it to the CPU, whose oldest blocks go on to disk.
    everything = set(held[MEDIUM_CPU]) | set(held[MEDIUM_STORAGE])
    assert len(held[MEDIUM_CPU]) == 2 and len(held[MEDIUM_STORAGE]) == 2
    newest_evicted = requests[2].block_hashes[:3]  # r3 evicted r2's blocks: the CPU has two
    assert set(held[MEDIUM_CPU]) <= set(newest_evicted)
    assert not everything & set(requests[0].block_hashes)  # r0's went through and out
    cpu, disk = bm.tiers.tiers
    assert (cpu.counters.stored, cpu.counters.evicted) == (9, 7)
    assert (disk.counters.stored, disk.counters.evicted) == (7, 5)


def test_a_prefix_on_a_lower_tier_loads_back_instead_of_recomputing() -> None:
    bm = tiered(gpu=4, cpu=3, disk=3)
    driver = Driver(scheduler(bm))
    serve(driver, "a", PROMPT_A)
    serve(driver, "b", PROMPT_B)
    before = driver.computed_tokens
    again = serve(driver, "a2", PROMPT_A)
    assert again.num_cached_tokens == 12  # 3 blocks, from the CPU
    assert driver.computed_tokens - before == 13 - 12 + 1  # the last prompt token, one decode
    assert bm.tiers is not None and bm.tiers.tiers[0].counters.hits == 3
    assert driver.outputs["a2"] == driver.outputs["a"]
    assert not set(again.block_hashes[:3]) & set(bm.tiers.block_hashes()[MEDIUM_CPU])


def test_other_requests_keep_stepping_while_a_load_is_in_flight() -> None:
    bm = tiered(gpu=12, cpu=8)
    sched = scheduler(bm)
    driver = Driver(sched, max_delay=10**6)  # loads land only when the test says so
    serve(driver, "a", PROMPT_A)
    serve(driver, "fill", list(range(201, 245)))  # 44 tokens: evicts all of A to the CPU
    assert bm.tiers is not None and len(bm.tiers.block_hashes()[MEDIUM_CPU]) >= 3
    loader = make_request("a2", PROMPT_A, max_tokens=2)
    other = make_request("other", [7, 7, 7, 7, 7], max_tokens=3)
    sched.add_request(loader)
    driver.step()
    assert loader.status is RequestStatus.WAITING_FOR_KV and driver.pending
    assert sched.num_waiting == 1 and sched.num_loading == 1
    sched.add_request(other)
    for _ in range(5):
        driver.step()
    assert "other" in driver.outputs and loader.status is RequestStatus.WAITING_FOR_KV
    driver.pending = [(0, load) for _, load in driver.pending]
    driver.run()
    assert driver.outputs["a2"] == driver.outputs["a"]


def test_a_request_aborted_mid_load_keeps_its_blocks_until_the_load_is_reported() -> None:
    bm = tiered(gpu=12, cpu=8)
    sched = scheduler(bm)
    driver = Driver(sched, max_delay=10**6)
    serve(driver, "a", PROMPT_A)
    serve(driver, "fill", list(range(201, 245)))
    sched.add_request(make_request("a2", PROMPT_A))
    driver.step()
    ((_, load),) = driver.pending
    held = list(bm.block_ids("a2"))
    assert len(held) >= 3 and sched.abort_request("a2") is not None
    assert bm.block_ids("a2") == held and sched.has_unfinished()  # the copy may still write them
    driver.pending = [(0, load)]
    driver.step()
    assert bm.block_ids("a2") == [] and not sched.has_unfinished()
    assert bm.tiers is not None and len(bm.tiers.block_hashes()[MEDIUM_CPU]) >= 3  # still there


def test_a_failed_load_drops_those_entries_and_recomputes() -> None:
    bm = tiered(gpu=4, cpu=3)
    driver = Driver(scheduler(bm))
    serve(driver, "a", PROMPT_A)
    serve(driver, "b", PROMPT_B)
    driver.fail_loads = True
    before = driver.computed_tokens
    again = serve(driver, "a2", PROMPT_A)
    assert driver.computed_tokens - before == 13 + 1  # recomputed all of it
    assert again.num_cached_tokens == 0 and sched_hits(driver) == 0
    assert driver.outputs["a2"] == driver.outputs["a"]


def sched_hits(driver: Driver) -> int:
    assert driver.bm.tiers is not None
    return sum(t.counters.hits for t in driver.bm.tiers.tiers)


def test_tiers_need_prefix_caching_and_a_positive_capacity() -> None:
    with pytest.raises(ValueError, match="prefix caching"):
        BlockManager(
            4, BLOCK, enable_prefix_caching=False, tiers=TierStore([TierConfig("CPU", 2)], BLOCK)
        )
    with pytest.raises(ValueError, match="positive"):
        TierStore([TierConfig(MEDIUM_CPU, 0)], BLOCK)
    with pytest.raises(ValueError, match="GPU"):
        TierStore([TierConfig(MEDIUM_GPU, 2)], BLOCK)


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**31),
    gpu=st.integers(8, 20),
    cpu=st.integers(0, 10),
    disk=st.integers(0, 10),
    max_delay=st.integers(0, 3),
)
def test_random_workloads_read_only_their_own_kv_and_match_no_tiers(
    seed: int, gpu: int, cpu: int, disk: int, max_delay: int
) -> None:
    """Shared prefixes revisited across a pool too small for them; loads landing late; aborts."""
    rng = random.Random(seed)
    heads = [[rng.randint(1, 250) for _ in range(rng.choice((4, 8, 12)))] for _ in range(4)]
    plan = [
        (
            rng.choice(heads) + [rng.randint(1, 250) for _ in range(rng.randint(1, 9))],
            rng.randint(1, 4),  # max_tokens
            rng.randint(0, 3),  # steps before the next arrival
            rng.randrange(n + 1) if rng.random() < 0.1 else None,  # a request to abort
        )
        for n in range(24)
    ]
    results = []
    for manager in (tiered(gpu, cpu, disk), tiered(gpu)):
        sched = scheduler(manager, max_num_seqs=3)
        driver = Driver(sched, seed, max_delay)
        for n, (prompt, max_tokens, steps, abort) in enumerate(plan):
            sched.add_request(make_request(f"r{n}", prompt, max_tokens))
            for _ in range(steps):
                if sched.has_unfinished():
                    driver.step()
            if abort is not None:
                sched.abort_request(f"r{abort}")
        driver.run()
        results.append(driver)
    with_tiers, without = results
    common = with_tiers.outputs.keys() & without.outputs.keys()
    assert {k: with_tiers.outputs[k] for k in common} == {k: without.outputs[k] for k in common}


# -- warm restart: a disk tier listed by `snapshot` fills a fresh store through `restore` ------


def test_a_restored_disk_tier_serves_its_prefixes_and_announces_parents_first() -> None:
    bm = tiered(gpu=4, disk=8)
    driver = Driver(scheduler(bm))
    serve(driver, "a", PROMPT_A)
    serve(driver, "b", PROMPT_B)  # A's three blocks go to disk, tail first
    assert bm.tiers is not None
    listed = bm.tiers.snapshot(MEDIUM_STORAGE)
    a_hashes = make_request("x", PROMPT_A).block_hashes[:3]
    assert [e.block_hash for e in listed] == [*reversed(a_hashes)]  # LRU order: the tail oldest
    restarted = tiered(gpu=4, disk=8)
    restarted.restore_tier(MEDIUM_STORAGE, listed)
    restarted.check_integrity()
    events = restarted.take_events()
    assert [e.block_hashes for e in events] == [[h] for h in a_hashes]  # type: ignore[union-attr]
    assert {e.medium for e in events} == {MEDIUM_STORAGE}  # type: ignore[union-attr]
    assert events[1].parent_block_hash == a_hashes[0]  # type: ignore[union-attr]
    assert restarted.tiers is not None
    assert restarted.tiers.snapshot(MEDIUM_STORAGE) == listed
    again = Driver(scheduler(restarted))
    again.kv.mem[MEDIUM_STORAGE] = driver.kv.mem[MEDIUM_STORAGE]  # the file outlived the process
    again.events.apply(events)
    request = serve(again, "a2", PROMPT_A)
    assert request.num_cached_tokens == 12 and again.outputs["a2"] == driver.outputs["a"]
    # A restored tier goes on as any other: a new slot is one the listing left free.
    serve(again, "c", [base + 500 for base in range(13)])
    restarted.check_integrity()


def test_restore_refuses_a_listing_that_does_not_fit_and_restores_nothing() -> None:
    tokens = bytes(4 * BLOCK)
    good = [SlotEntry(0, 11, None, tokens), SlotEntry(1, 12, 11, tokens)]
    bad = {
        "slot twice": [*good, SlotEntry(1, 13, 12, tokens)],
        "hash twice": [*good, SlotEntry(2, 12, 11, tokens)],
        "slot out of range": [SlotEntry(8, 11, None, tokens)],
        "short tokens": [SlotEntry(0, 11, None, tokens[:4])],
    }
    for name, entries in bad.items():
        bm = tiered(gpu=4, disk=8)
        with pytest.raises(ValueError):
            bm.restore_tier(MEDIUM_STORAGE, entries)
        assert bm.tiers is not None and not bm.tiers.block_hashes()[MEDIUM_STORAGE], name
        assert not bm.take_events(), name
    bm = tiered(gpu=4, cpu=2, disk=8)
    bm.restore_tier(MEDIUM_STORAGE, good)
    with pytest.raises(ValueError, match="not empty"):
        bm.restore_tier(MEDIUM_STORAGE, good)
    with pytest.raises(ValueError, match="already lives"):
        bm.restore_tier(MEDIUM_CPU, good[:1])
    with pytest.raises(ValueError, match="no lower tiers"):
        tiered(gpu=4).restore_tier(MEDIUM_STORAGE, good)
