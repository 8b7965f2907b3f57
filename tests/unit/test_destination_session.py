"""The destination's protocol steps, sans-IO, on explicit time (`migration.core.destination`)."""

from __future__ import annotations

import pytest

from migration.core.destination import (
    Accept,
    Adopt,
    DestinationProtocol,
    Refuse,
    ReserveBlocks,
    ShareCached,
)
from migration.core.protocol import AbortReason

BS = 16


def test_stage_zero_shares_the_cached_prefix_then_reserves_the_rest() -> None:
    d = DestinationProtocol("r", BS, now=0.0)
    assert d.on_reserve(0, 4, 0, [11, 12, 13, 14], now=1.0) == ShareCached((11, 12, 13, 14))
    assert d.on_shared([7, 8]) == ReserveBlocks(2)  # partial shared blocks: two found cached
    assert d.on_reserved([20, 21]) == Accept((7, 8), (20, 21))


def test_a_later_stage_shares_nothing_and_reserves_its_blocks() -> None:
    d = DestinationProtocol("r", BS, now=0.0)
    assert d.on_reserve(1, 3, 0, [1, 2, 3], now=1.0) == ReserveBlocks(3)
    assert d.on_reserved([5, 6, 7]) == Accept((), (5, 6, 7))


def test_no_room_refuses() -> None:
    d = DestinationProtocol("r", BS, now=0.0)
    d.on_reserve(0, 4, 0, [1, 2, 3, 4], now=0.0)
    assert d.on_shared([9]) == ReserveBlocks(3)
    action = d.on_reserved(None)
    assert isinstance(action, Refuse) and action.reason is AbortReason.DST_REFUSED
    assert "3 blocks" in action.detail


def test_blocks_reserved_ahead_feed_later_stages_and_must_be_filled() -> None:
    d = DestinationProtocol("r", BS, now=0.0)
    d.on_reserve(0, 1, 3, [1, 2, 3], now=0.0)
    assert d.on_shared([]) == ReserveBlocks(3)
    assert d.on_reserved([10, 11, 12]) == Accept((), (10,))
    refused = d.on_commit("r", 3 * BS, 1, now=1.0)
    assert isinstance(refused, Refuse) and "2 blocks reserved ahead" in refused.detail
    assert d.on_reserve(1, 2, 0, [2, 3], now=1.0) == Accept((), (11, 12))  # nothing to reserve
    assert d.on_commit("r", 3 * BS, 3, now=2.0) == Adopt()


def test_commit_check_fails_on_a_state_that_does_not_match_the_blocks() -> None:
    d = DestinationProtocol("r", BS, now=0.0)
    for rid, tokens, held in (("other", BS, 1), ("r", 3 * BS, 1)):
        action = d.on_commit(rid, tokens, held, now=1.0)
        assert isinstance(action, Refuse) and action.reason is AbortReason.DST_FAILED
    assert d.on_commit("r", BS, 1, now=1.0) == Adopt()


def test_abort_refuses_as_the_source_cancelled() -> None:
    assert DestinationProtocol("r", BS, now=0.0).on_abort().reason is AbortReason.SRC_CANCELLED


def test_timeout_counts_from_the_last_message() -> None:
    d = DestinationProtocol("r", BS, now=0.0)
    assert not d.expired(5.0, timeout_s=5.0) and d.expired(5.1, timeout_s=5.0)
    d.on_reserve(1, 1, 0, [], now=5.0)
    assert not d.expired(9.0, timeout_s=5.0) and d.expired(10.5, timeout_s=5.0)


def test_an_answer_without_a_stage_is_a_driver_bug() -> None:
    with pytest.raises(RuntimeError):
        DestinationProtocol("r", BS, now=0.0).on_shared([])
