"""The prefix index per tier: vLLM's tier events (self-describing and placeholders), unknown
media, and matches that report depth per tier."""

from __future__ import annotations

import logging

import pytest

from kvherd.block_hash import block_hash_chain
from kvherd.kv_events import BlockRemoved, BlockStored, KVEvent, KVEventBatch
from policies.views import RequestView
from scheduler.core.cluster_state import ClusterState
from scheduler.core.prefix_index import PrefixIndex

BS = 4
PROMPT = list(range(100, 124))  # 6 blocks


def engine_chain(tokens: list[int]) -> list[int]:
    return block_hash_chain(tokens, BS, cache_salt="engine-seed", algo="sha256")


def gpu_stored(start: int, end: int, medium: str | None = "GPU") -> BlockStored:
    hashes = engine_chain(PROMPT)
    return BlockStored(
        hashes[start:end],
        hashes[start - 1] if start else None,
        PROMPT[start * BS : end * BS],
        BS,
        medium=medium,
    )


def moved_down(index: int, medium: str, placeholder: bool) -> list[KVEvent]:
    """A block moving down a tier, as vLLM (placeholder) or kvherd (self-describing) says it."""
    hashes = engine_chain(PROMPT)
    store = (
        BlockStored([hashes[index]], None, [], 0, medium=medium)
        if placeholder
        else BlockStored(
            [hashes[index]],
            hashes[index - 1] if index else None,
            PROMPT[index * BS : (index + 1) * BS],
            BS,
            medium=medium,
        )
    )
    return [store, BlockRemoved([hashes[index]], medium="GPU")]


def kv_chain() -> list[int]:
    return block_hash_chain(PROMPT, BS)


@pytest.mark.parametrize("placeholder", [False, True])
def test_blocks_moving_down_keep_their_chain_on_the_lower_tiers(placeholder: bool) -> None:
    index = PrefixIndex(BS)
    index.add_instance("a")
    events: list[KVEvent] = [gpu_stored(0, 6)]
    for i in (5, 4, 3):  # the tail is evicted first
        events += moved_down(i, "CPU", placeholder)
    events += [BlockStored([engine_chain(PROMPT)[5]], None, [], 0, medium="STORAGE")]
    events += [BlockRemoved([engine_chain(PROMPT)[5]], medium="CPU")]
    index.apply_batch("a", KVEventBatch(0, 0.0, events))
    assert index.match(kv_chain()) == {"a": 3}  # the GPU tier alone
    assert index.match_tiers(kv_chain()) == {"a": [3, 2, 1]}
    assert index.blocks("a", "CPU") == set(kv_chain()[3:5])
    assert index.num_blocks("a") == 6
    # Loaded back: GPU store, then the lower copy goes.
    hashes = engine_chain(PROMPT)
    index.apply_events("a", [gpu_stored(3, 4), BlockRemoved([hashes[3]], medium="CPU")])
    assert index.match_tiers(kv_chain()) == {"a": [4, 1, 1]}
    index.apply_events("a", [BlockRemoved(hashes[:4], medium="GPU")])
    assert index.match_tiers(kv_chain()) == {}  # the chain's head is gone: nothing continues


def test_unknown_medium_is_the_lowest_tier_with_one_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    index = PrefixIndex(BS)
    index.add_instance("a")
    caplog.set_level(logging.WARNING)
    index.apply_events("a", [gpu_stored(0, 2), gpu_stored(2, 3, medium="NVME-OF")])
    index.apply_events("a", [gpu_stored(3, 4, medium="NVME-OF")])
    assert index.match_tiers(kv_chain()) == {"a": [2, 0, 2]}  # never GPU
    assert index.stats.unknown_medium == 2
    assert [r.levelname for r in caplog.records] == ["WARNING"]
    assert "NVME-OF" in caplog.records[0].getMessage()


def test_trusted_hashes_and_instances_split_by_tier() -> None:
    index = PrefixIndex(BS)
    chain = kv_chain()
    for name in ("a", "b"):
        index.add_instance(name, trust_engine_hashes=True)
    index.apply_events("a", [BlockStored(chain[:2], None, PROMPT[:8], BS, medium="GPU")])
    index.apply_events("a", [BlockStored(chain[2:4], chain[1], PROMPT[8:16], BS, medium="CPU")])
    index.apply_events("b", [BlockStored(chain[:5], None, PROMPT[:20], BS, medium="STORAGE")])
    assert index.match_tiers(chain) == {"a": [2, 2, 0], "b": [0, 0, 5]}
    index.remove_instance("b")
    assert index.num_blocks() == 4
    assert len(index.tier_owners[2]) == 0


def test_memory_bound_forgets_the_lowest_tier_first() -> None:
    index = PrefixIndex(BS, max_blocks_per_instance=4)
    chain = kv_chain()
    index.add_instance("a", trust_engine_hashes=True)
    index.apply_events("a", [BlockStored(chain[:2], None, PROMPT[:8], BS)])
    index.apply_events("a", [BlockStored(chain[2:4], chain[1], PROMPT[8:16], BS, medium="CPU")])
    index.apply_events("a", [BlockStored(chain[5:6], chain[4], PROMPT[20:], BS)])
    assert index.num_blocks("a") == 4
    assert index.blocks("a") == {chain[0], chain[1], chain[5]}  # the GPU tier keeps its blocks
    assert index.blocks("a", "CPU") == {chain[3]}
    assert index.stats.evicted == 1


def test_cluster_view_reports_depth_per_tier() -> None:
    cluster = ClusterState(block_size=BS)
    chain = kv_chain()
    for name in ("a", "b", "c"):
        cluster.add_instance(name, has_kv_events=True, trust_engine_hashes=True)
    cluster.apply_kv_events("a", [BlockStored(chain[:3], None, PROMPT[:12], BS)])
    cluster.apply_kv_events(
        "a", [BlockStored(chain[3:5], chain[2], PROMPT[12:20], BS, medium="CPU")]
    )
    cluster.apply_kv_events("b", [BlockStored(chain[:6], None, PROMPT, BS, medium="STORAGE")])
    request = RequestView("r", len(PROMPT), tuple(chain), BS)
    view = cluster.view(0.0)
    assert view.prefix_match_array(request).tolist() == [3.0, 0.0, 0.0]
    assert view.prefix_match_tiers(request).tolist() == [[3, 0, 0], [2, 0, 0], [0, 6, 0]]
    assert dict(view.prefix_match(request)) == {"a": 3}


def test_a_routing_decision_reports_its_hits_per_tier() -> None:
    """`Routed.tier_blocks` (the proxy's ``kvherd_routed_hit_blocks_total{medium}``): the chosen
    instance's hits per tier; empty while no instance reports a lower tier."""
    from policies import load_dispatch_policy
    from scheduler.core.router import Router

    chain = kv_chain()

    def routed(*events: BlockStored) -> tuple[tuple[int, ...], int]:
        cluster = ClusterState(block_size=BS)
        cluster.add_instance("a", has_kv_events=True, trust_engine_hashes=True)
        cluster.apply_kv_events("a", list(events))
        router = Router(cluster, load_dispatch_policy("kvherd"))
        got = router.route("r", now=0.0, num_tokens=len(PROMPT), block_hashes=chain)
        return got.tier_blocks, got.matched_blocks

    gpu = BlockStored(chain[:3], None, PROMPT[:12], BS)
    assert routed(gpu) == ((), 3)
    cpu = BlockStored(chain[3:5], chain[2], PROMPT[12:20], BS, medium="CPU")
    assert routed(gpu, cpu) == ((3, 2, 0), 3)
