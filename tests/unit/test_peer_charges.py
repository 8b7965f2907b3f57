"""Router replicas' charges (`scheduler.core.peer_charges`) and how an instance's view adds them."""

from __future__ import annotations

import pytest

from scheduler.core.instance_state import InstanceState
from scheduler.core.load_report import LoadReport
from scheduler.core.peer_charges import Charge, PeerCharges, parse_charges


def test_totals_sum_fresh_peers_and_forget_a_silent_one() -> None:
    peers = PeerCharges(own="r0", ttl_s=1.0)
    peers.update("r1", 0.0, {"a": Charge(2, 1, 100, 4)})
    peers.update("r2", 0.5, {"a": Charge(1, 0, 0, 2), "b": Charge(3, 3, 300, 6)})
    peers.update("r0", 0.5, {"a": Charge(50, 50, 5000, 100)})  # its own answer: never counted
    assert peers.totals(0.9) == {"a": Charge(3, 1, 100, 6), "b": Charge(3, 3, 300, 6)}
    assert sorted(peers.fresh_peers(0.9)) == ["r1", "r2"]
    # r1 said nothing for over ttl_s: it died or is cut off, its charges stop counting.
    assert peers.totals(1.2) == {"a": Charge(1, 0, 0, 2), "b": Charge(3, 3, 300, 6)}
    peers.update("r2", 1.3, {})
    assert peers.totals(1.4) == {}


def test_parse_refuses_anything_but_four_non_negative_ints_per_instance() -> None:
    body = {"replica": "r1", "charges": {"a": [1, 0, 16, 2]}}
    assert parse_charges(body) == ("r1", {"a": Charge(1, 0, 16, 2)})
    for bad in (
        [],
        {"charges": {}},
        {"replica": "r1", "charges": []},
        {"replica": "r1", "charges": {"a": [1, 2, 3]}},
        {"replica": "r1", "charges": {"a": [1, 2, 3, -1]}},
        {"replica": "r1", "charges": {"a": [1, 2, 3, 4.5]}},
        {"replica": "r1", "charges": {"a": [True, 0, 0, 0]}},
    ):
        with pytest.raises(ValueError):
            parse_charges(bad)


def test_a_view_counts_the_peers_in_flight_beside_its_own() -> None:
    state = InstanceState("a", block_size=16)
    state.dispatch("mine", prompt_tokens=32, uncached_tokens=32, now=0.0)
    state.peer = Charge(inflight=3, pending_prefill=2, pending_prefill_tokens=64, blocks=6)
    view = state.view()
    assert (view.inflight, view.pending_prefill, view.pending_prefill_tokens) == (4, 3, 96)
    assert view.inflight_blocks == 8
    # Unreported: the load is the routers' accounting, the peers' included.
    assert (view.num_running, view.num_waiting) == (1, 3)
    # Reported: what reached the engine is in the report already (the peers' deltas are not known).
    state.apply_report(LoadReport(num_running=5, num_waiting=0), now=1.0)
    assert (state.view().num_running, state.view().num_waiting) == (5, 0)
