"""Prefix hand-over on scale-in: which of a leaving instance's prefixes each survivor pulls.

Contract:
- Pure. `plan_handover(offers, room)` takes the leaving instance's cached prefixes, hottest first
  (`Offer`: its chain length in blocks, and per survivor the leading blocks of it the survivor
  holds already, from the prefix index), and each survivor's room in blocks for what it pulls.
- A prefix some survivor holds whole is left (``held``). Otherwise it goes to the survivor that
  holds most of it already, so the fewest blocks move, then to the one with most room left; the
  blocks it lacks are charged to that room. A prefix no survivor has room for is left
  (``no_room``); the next ones are still tried (a shorter one may fit).
- What the plan moves counts as held by its survivor from then on: a later prefix sharing its
  head costs only its own tail there (chains hottest first share heads often).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class Offer:
    chain: Sequence[int]  # the prefix's block hashes, first block first
    held: Mapping[str, int]  # survivor -> leading blocks of it the survivor holds

    @property
    def num_blocks(self) -> int:
        return len(self.chain)


@dataclass(frozen=True, slots=True)
class Move:
    offer: int  # its position in the offers
    survivor: str
    num_blocks: int  # blocks the survivor pulls (the chain less what it holds)


@dataclass(slots=True)
class HandoverPlan:
    moves: list[Move] = field(default_factory=list)
    held: int = 0  # prefixes a survivor holds whole already
    no_room: int = 0  # prefixes no survivor had room for

    @property
    def num_blocks(self) -> int:
        return sum(move.num_blocks for move in self.moves)


def plan_handover(offers: Sequence[Offer], room: Mapping[str, int]) -> HandoverPlan:
    """Each offer to a survivor, or left (see the module contract)."""
    left = dict(room)
    plan = HandoverPlan()
    planned: dict[str, set[int]] = {s: set() for s in left}  # blocks the plan moves there
    for position, offer in enumerate(offers):
        if any(h >= offer.num_blocks for h in offer.held.values()):
            plan.held += 1
            continue
        best: tuple[int, int, int] | None = None
        chosen: str | None = None
        for order, survivor in enumerate(left):
            holds = max(offer.held.get(survivor, 0), _leading(offer.chain, planned[survivor]))
            lacking = offer.num_blocks - holds
            if lacking > left[survivor]:
                continue
            key = (lacking, -left[survivor], order)
            if best is None or key < best:
                best, chosen = key, survivor
        if chosen is None or best is None:
            plan.no_room += 1
            continue
        if not best[0]:  # what the plan moves there already holds it whole
            plan.held += 1
            continue
        left[chosen] -= best[0]
        planned[chosen].update(offer.chain)
        plan.moves.append(Move(position, chosen, best[0]))
    return plan


def _leading(chain: Sequence[int], blocks: set[int]) -> int:
    """How many leading blocks of `chain` are in `blocks`."""
    for depth, block in enumerate(chain):
        if block not in blocks:
            return depth
    return len(chain)
