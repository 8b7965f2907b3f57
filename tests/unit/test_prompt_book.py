"""`scheduler.core.prompt_book`: chains with their tokens, one entry per lineage, bounded."""

from __future__ import annotations

import pytest

from kvherd.block_hash import block_hash_chain
from scheduler.core.prompt_book import PromptBook

BS = 4


def _chain(tokens: list[int]) -> list[int]:
    return block_hash_chain(tokens, BS)


def test_a_longer_turn_replaces_the_heads_it_covers() -> None:
    book = PromptBook()
    system = list(range(8))
    turn_1 = [*system, 100, 101, 102, 103, 104]  # 3 full blocks, a partial one
    turn_2 = [*turn_1, 105, 106, 107, 108, 109, 110, 111]  # 5 full blocks
    other = [*system, 200, 201, 202, 203]
    book.note(_chain(system), system, BS)
    book.note(_chain(turn_1), turn_1, BS)
    book.note(_chain(other), other, BS)  # shares the system prompt, covers it: already dropped
    book.note(_chain(turn_2), turn_2, BS)
    listed = [(list(c), list(t)) for c, t in book.recent()]
    assert listed == [(_chain(turn_2), turn_2[:20]), (_chain(other), other)]
    assert book.num_tokens == 20 + 12


def test_a_repeat_refreshes_and_the_least_recent_go_past_the_capacity() -> None:
    book = PromptBook(capacity_tokens=3 * 2 * BS)
    prompts = [[k] * (2 * BS) for k in range(3)]
    for p in prompts:
        book.note(_chain(p), p, BS)
    book.note(_chain(prompts[0]), prompts[0], BS)  # now the most recent
    fourth = [9] * (2 * BS)
    book.note(_chain(fourth), fourth, BS)
    assert [t[0] for _, t in book.recent()] == [9, 0, 2]
    assert book.num_tokens == 3 * 2 * BS
    book.note([], [], BS)  # no full block: nothing to keep
    assert len(book) == 3


def test_a_chain_longer_than_its_tokens_is_refused() -> None:
    with pytest.raises(ValueError, match="need over"):
        PromptBook().note([1, 2], [0] * BS, BS)
