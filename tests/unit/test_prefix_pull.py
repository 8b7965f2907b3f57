"""The prefix-pull rule: recompute at the preferred instance, route to the holder, or pull its
blocks, by estimated TTFT (`scheduler.core.prefix_pull`), and the router acting on it."""

from __future__ import annotations

import numpy as np
import pytest

from policies.base import DispatchPolicy
from policies.views import ClusterView, Decision, InstanceView, RequestView
from scheduler.core.cluster_state import ClusterState
from scheduler.core.prefix_pull import PullAction, PullPeer, PullSettings, choose_pull, pull_peer
from scheduler.core.router import Router

BS = 16
REQUEST = RequestView("r", 512 * BS, tuple(range(512)), BS)  # 8,192 tokens
# 10k prefill tokens/s, 100 kB of KV per token over 50 GB/s: a pulled token costs 2 us, a
# recomputed one 100 us.
SETTINGS = PullSettings(prefill_tokens_per_s=1e4, kv_bytes_per_token=1e5)


def view(instances: list[InstanceView], tiers: list[list[float]]) -> ClusterView:
    """A hand-built view whose match per tier is `tiers` (rows GPU, CPU, STORAGE)."""
    table = np.array(tiers, dtype=np.float64)
    gpu = {inst.instance_id: int(d) for inst, d in zip(instances, table[0], strict=True) if d}
    return ClusterView(
        instances, 0.0, lambda request: gpu, tier_matcher=lambda request, _gpu: table[1:]
    )


def inst(name: str, **fields: float) -> InstanceView:
    return InstanceView(name, capacity=10_000, free_blocks=10_000, **fields)  # type: ignore[arg-type]


def busy(name: str) -> InstanceView:
    return inst(name, num_running=10, waiting_prefill_tokens=50_000)


def test_no_holder_deeper_than_the_preferred_instance_recomputes_without_estimates() -> None:
    cluster = view([inst("p"), busy("h")], [[300, 200], [0, 0], [0, 0]])
    choice = choose_pull(REQUEST, cluster, "p", SETTINGS)
    assert (choice.action, choice.instance_id, choice.estimates) == (
        PullAction.RECOMPUTE,
        "p",
        {},
    )


def test_a_holder_below_the_minimum_gain_is_not_considered() -> None:
    # 127 blocks deeper = 2,032 tokens < 2,048.
    cluster = view([inst("p"), inst("h")], [[100, 227], [0, 0], [0, 0]])
    assert choose_pull(REQUEST, cluster, "p", SETTINGS).estimates == {}
    cluster = view([inst("p"), inst("h")], [[100, 228], [0, 0], [0, 0]])
    assert choose_pull(REQUEST, cluster, "p", SETTINGS).estimates != {}
    lower = PullSettings(prefill_tokens_per_s=1e4, kv_bytes_per_token=1e5, min_gain_tokens=0)
    cluster = view([inst("p"), inst("h")], [[100, 101], [0, 0], [0, 0]])
    assert choose_pull(REQUEST, cluster, "p", lower).estimates != {}


def test_a_busy_holder_and_a_fast_link_pull_to_the_idle_instance() -> None:
    cluster = view([inst("p"), busy("h")], [[0, 400], [0, 0], [0, 0]])
    choice = choose_pull(REQUEST, cluster, "p", SETTINGS)
    assert (choice.action, choice.instance_id, choice.source) == (PullAction.PULL, "p", "h")
    assert (choice.first_block, choice.num_blocks) == (0, 400)
    transfer = 400 * BS * 1e5 / 50e9 + 50e-6
    assert choice.estimates[PullAction.PULL] == pytest.approx(transfer + (8192 - 6400) / 1e4)
    assert choice.estimates[PullAction.RECOMPUTE] == pytest.approx(8192 / 1e4)
    assert choice.estimates[PullAction.ROUTE] == pytest.approx((50_000 + 320 + 1792) / 1e4)
    assert choice.reason.startswith("pull (est. TTFT: recompute 819 ms")


def test_an_idle_holder_gets_the_request_routed_to_it() -> None:
    cluster = view([busy("p"), inst("h")], [[0, 400], [0, 0], [0, 0]])
    choice = choose_pull(REQUEST, cluster, "p", SETTINGS)
    assert (choice.action, choice.instance_id, choice.source) == (PullAction.ROUTE, "h", None)


def test_a_slow_link_recomputes_with_the_estimates_kept() -> None:
    slow = PullSettings(prefill_tokens_per_s=1e4, kv_bytes_per_token=1e5, bandwidth=1e8)
    cluster = view([inst("p"), busy("h")], [[0, 400], [0, 0], [0, 0]])
    choice = choose_pull(REQUEST, cluster, "p", slow)
    assert choice.action is PullAction.RECOMPUTE and choice.instance_id == "p"
    assert choice.estimates[PullAction.PULL] > choice.estimates[PullAction.RECOMPUTE]


def test_the_pull_starts_past_the_preferred_gpu_hits_and_replaces_its_lower_tier_ones() -> None:
    # p: 100 GPU blocks, then 50 on CPU; h: 400 deep. The pull copies positions 100..400.
    cluster = view([inst("p"), busy("h")], [[100, 400], [50, 0], [0, 0]])
    choice = choose_pull(REQUEST, cluster, "p", SETTINGS)
    assert (choice.action, choice.first_block, choice.num_blocks) == (PullAction.PULL, 100, 300)
    load = 50 * BS * 0.05  # p's own CPU hits at the default load ratio
    assert choice.estimates[PullAction.RECOMPUTE] == pytest.approx((load + 8192 - 150 * BS) / 1e4)


def test_an_agent_sends_only_its_gpu_blocks_so_only_those_are_priced() -> None:
    # h: 100 GPU, 100 CPU, 200 disk blocks. An agent's block server sends its GPU cache alone:
    # the pull plan copies those 100 blocks, and the rest of h's prefix is only worth a route.
    cluster = view([inst("p"), busy("h")], [[0, 100], [0, 100], [0, 200]])
    choice = choose_pull(REQUEST, cluster, "p", SETTINGS)
    assert (choice.action, choice.first_block, choice.num_blocks) == (PullAction.PULL, 0, 100)
    transfer = 100 * BS * 1e5 / 50e9 + 50e-6
    assert choice.estimates[PullAction.PULL] == pytest.approx(transfer + (8192 - 1600) / 1e4)
    idle = view([inst("p"), inst("h")], [[0, 100], [0, 100], [0, 200]])
    assert choose_pull(REQUEST, idle, "p", SETTINGS).action is PullAction.ROUTE
    only_lower = view([inst("p"), busy("h")], [[0, 0], [0, 100], [0, 300]])
    assert set(choose_pull(REQUEST, only_lower, "p", SETTINGS).estimates) == {
        PullAction.RECOMPUTE,
        PullAction.ROUTE,
    }


def test_a_vllm_connector_sends_its_host_and_disk_blocks_and_their_read_time_counts() -> None:
    # The connector's server sends its host store and disk tier (a copy of every GPU block).
    peers = {"p": pull_peer(False, None), "h": pull_peer(False, "tcp://h:1")}
    cluster = view([inst("p"), busy("h")], [[0, 100], [0, 100], [0, 200]])
    choice = choose_pull(REQUEST, cluster, "p", SETTINGS, peers.__getitem__)
    assert (choice.action, choice.source, choice.num_blocks) == (PullAction.PULL, "h", 400)
    transfer = 400 * BS * 1e5 / 50e9 + 50e-6 + 200 * BS * 0.4 / 1e4
    assert choice.estimates[PullAction.PULL] == pytest.approx(transfer + 1792 / 1e4)


def test_a_holder_without_a_block_server_or_of_another_kind_is_never_a_source() -> None:
    # h is deepest (400 GPU blocks) but cannot send; s holds 300 and can.
    cluster = view([inst("p"), busy("h"), busy("s")], [[0, 400, 300], [0, 0, 0], [0, 0, 0]])
    for h in (pull_peer(True, None), pull_peer(False, "tcp://h:1"), pull_peer(False, None)):
        peers = {"p": pull_peer(True, "tcp://p:1"), "h": h, "s": pull_peer(True, "tcp://s:1")}
        choice = choose_pull(REQUEST, cluster, "p", SETTINGS, peers.__getitem__)
        assert (choice.action, choice.source, choice.num_blocks) == (PullAction.PULL, "s", 300)
        del peers["s"]  # s gone: only h holds the prefix, and it cannot send it
        alone = view([inst("p"), busy("h")], [[0, 400], [0, 0], [0, 0]])
        choice = choose_pull(REQUEST, alone, "p", SETTINGS, peers.__getitem__)
        assert set(choice.estimates) == {PullAction.RECOMPUTE, PullAction.ROUTE}
        assert choice.action is PullAction.RECOMPUTE and choice.source is None
    # A vLLM destination pulls from a vLLM connector, never from an agent.
    peers = {"p": pull_peer(False, None), "h": pull_peer(True, "tcp://h:1")}
    alone = view([inst("p"), busy("h")], [[0, 400], [0, 0], [0, 0]])
    assert (
        PullAction.PULL
        not in choose_pull(REQUEST, alone, "p", SETTINGS, peers.__getitem__).estimates
    )


def test_the_holder_is_the_deepest_dispatchable_one_and_never_covers_the_last_token() -> None:
    draining = InstanceView("d", capacity=10_000, free_blocks=10_000, draining=True)
    cluster = view(
        [inst("p"), draining, busy("a"), busy("b")],
        [[0, 512, 300, 250], [0, 0, 0, 50], [0, 0, 0, 0]],
    )
    choice = choose_pull(REQUEST, cluster, "p", SETTINGS)
    assert choice.source == "a"  # a and b are 300 deep; a has more of it on GPU
    full = view([inst("p"), busy("h")], [[0, 512], [0, 0], [0, 0]])
    assert choose_pull(REQUEST, full, "p", SETTINGS).num_blocks == 511


class _Fixed(DispatchPolicy):
    name = "fixed"

    def __init__(self, instance_id: str) -> None:
        self.instance_id = instance_id

    def choose(self, request: RequestView, cluster: ClusterView) -> Decision:
        return Decision(self.instance_id)


def _router(
    preferred: str, holder_busy: bool, peers: dict[str, PullPeer] | None = None
) -> tuple[Router, ClusterState]:
    from kvherd.kv_events import BlockStored
    from scheduler.core.load_report import LoadReport

    state = ClusterState(block_size=BS)
    for iid in ("p", "h"):
        state.add_instance(iid, has_kv_events=True, trust_engine_hashes=True, now=0.0)
    state.apply_kv_events(
        "h", [BlockStored(list(REQUEST.block_hashes[:400]), None, [], BS, medium="GPU")]
    )
    if holder_busy:
        state.apply_report("h", LoadReport(num_running=10, waiting_prefill_tokens=50_000), 0.0)
    lookup = None if peers is None else peers.__getitem__
    return Router(state, _Fixed(preferred), pull=SETTINGS, peers=lookup), state


def test_the_router_charges_a_pull_as_cached_and_sends_a_route_to_the_holder() -> None:
    router, state = _router("p", holder_busy=True)
    routed = router.route("r", now=0.0, num_tokens=8192, block_hashes=REQUEST.block_hashes)
    assert routed.instance_id == "p" and routed.pull is not None
    assert (routed.pull.action, routed.pull.source, routed.pull.num_blocks) == (
        PullAction.PULL,
        "h",
        400,
    )
    assert state.view(0.0)["p"].pending_prefill_tokens == 8192 - 400 * BS
    router, _ = _router("p", holder_busy=False)
    other = tuple(range(1000, 1512))  # a prompt nobody holds: it stays on p, 8,192 tokens
    assert router.route("x", now=0.0, num_tokens=8192, block_hashes=other).pull is None
    routed = router.route("r", now=0.0, num_tokens=8192, block_hashes=REQUEST.block_hashes)
    assert routed.instance_id == "h" and routed.pull is not None
    assert routed.pull.action is PullAction.ROUTE and routed.decision.reason.startswith("route")


def test_the_router_charges_nothing_as_cached_from_a_holder_that_cannot_send() -> None:
    peers = {"p": pull_peer(True, "tcp://p:1"), "h": pull_peer(True, None)}
    router, state = _router("p", holder_busy=True, peers=peers)
    routed = router.route("r", now=0.0, num_tokens=8192, block_hashes=REQUEST.block_hashes)
    assert routed.instance_id == "p" and routed.pull is not None
    assert routed.pull.action is PullAction.RECOMPUTE
    assert state.view(0.0)["p"].pending_prefill_tokens == 8192


def test_a_pull_copies_only_what_the_holder_is_known_to_hold() -> None:
    # h's match says 400 blocks, but its KV events confirmed only `known` of them: the rest were
    # routed there and may still be prefilling, so there is nothing to copy past `known`.
    def confirmed(known: int | None) -> ClusterView:
        instances = [inst("p"), busy("h")]
        gpu = {"h": 400}
        table = np.zeros((2, 2))
        return ClusterView(
            instances,
            0.0,
            lambda request: gpu,
            tier_matcher=lambda request, _gpu: table,
            confirmed_matcher=lambda request, iid: known if iid == "h" else 0,
        )

    unconfirmed = choose_pull(REQUEST, confirmed(0), "p", SETTINGS)
    assert unconfirmed.action is PullAction.RECOMPUTE
    assert set(unconfirmed.estimates) == {PullAction.RECOMPUTE, PullAction.ROUTE}
    partly = choose_pull(REQUEST, confirmed(300), "p", SETTINGS)
    assert (partly.action, partly.first_block, partly.num_blocks) == (PullAction.PULL, 0, 300)
    transfer = 300 * BS * 1e5 / 50e9 + 50e-6
    assert partly.estimates[PullAction.PULL] == pytest.approx(transfer + (8192 - 4800) / 1e4)
    unknown = choose_pull(REQUEST, confirmed(None), "p", SETTINGS)  # no events: the match rules
    assert (unknown.action, unknown.num_blocks) == (PullAction.PULL, 400)


def test_blocks_only_routed_to_an_instance_are_not_confirmed_until_its_events_say_so() -> None:
    from kvherd.kv_events import BlockStored

    router, state = _router("h", holder_busy=False)
    fresh = tuple(range(2000, 2512))
    router.route("first", now=0.0, num_tokens=8192, block_hashes=fresh)  # h prefills it
    request = RequestView("again", 8192, fresh, BS)
    view = state.view(0.0)
    assert view.prefix_match_array(request)[view.index_of("h")] > 0  # routed: the match counts it
    assert view.confirmed_depth(request, "h") == 0
    state.apply_kv_events("h", [BlockStored(list(fresh[:100]), None, [], BS, medium="GPU")])
    assert state.view(0.0).confirmed_depth(request, "h") == 100
