"""The prefix hand-over plan (`scheduler.core.handover`): who pulls which of a leaving instance's
prefixes, and what is left."""

from __future__ import annotations

from scheduler.core.handover import Move, Offer, plan_handover


def test_a_prefix_goes_where_least_moves_then_where_most_room_is() -> None:
    offers = [
        Offer([1, 2, 3, 4], {"a": 2}),  # a holds half of it: two blocks move there
        Offer([5, 6], {}),  # nobody holds it: the one with most room left
        Offer([7, 8, 9], {"a": 3}),  # held whole: left where it is
    ]
    plan = plan_handover(offers, {"a": 10, "b": 10})
    assert plan.moves == [Move(0, "a", 2), Move(1, "b", 2)]
    assert (plan.held, plan.no_room, plan.num_blocks) == (1, 0, 4)


def test_room_is_charged_and_a_later_smaller_prefix_may_still_fit() -> None:
    offers = [Offer([1, 2, 3], {}), Offer([4, 5, 6, 7], {}), Offer([8], {})]
    plan = plan_handover(offers, {"a": 4})
    assert plan.moves == [Move(0, "a", 3), Move(2, "a", 1)]
    assert plan.no_room == 1


def test_a_head_the_plan_moves_counts_as_held_for_the_prefixes_sharing_it() -> None:
    offers = [Offer([1, 2, 3], {}), Offer([1, 2, 9], {}), Offer([1, 2, 3], {})]
    plan = plan_handover(offers, {"a": 5, "b": 5})
    # The second shares two blocks with the first: only its tail moves, to the same survivor.
    assert plan.moves == [Move(0, "a", 3), Move(1, "a", 1)]
    assert plan.held == 1


def test_no_survivor_leaves_everything() -> None:
    plan = plan_handover([Offer([1], {})], {})
    assert plan.moves == [] and plan.no_room == 1
