"""Which instances serve which model or LoRA adapter: model name -> instances, kept as an index.

Contract:
- Pure, no clock. `set_models(instance_id, cards)` records what an instance serves, as the model
  cards of its ``/v1/models`` (vLLM: ``id``, ``parent`` = the base model of a LoRA adapter, None for
  a base model; kvherd agents: their model); None means "not known" (the instance did not describe
  itself): it may be sent any model. Returns whether anything changed (``created`` aside: vLLM
  stamps it with the time of every listing). `remove_instance` forgets one.
- `route(model)` is the request path's one dict lookup: None when every instance may take the
  model (a one-model fleet, or no `model` in the request), else the frozenset of instances that
  serve it (plus those whose models are unknown); `UnknownModelError` when none may. The answers
  are rebuilt on every change of membership or of a model list, never per request.
- `parent(model)`: the base model of an adapter (None: a base model or unknown); `cards()`: every
  model the fleet serves, base models first, each once, as vLLM's ``/v1/models`` lists them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

ModelCard = Mapping[str, Any]


def _listed(cards: Sequence[ModelCard] | None) -> list[dict[str, Any]] | None:
    """What a model list says, without its listing time."""
    if cards is None:
        return None
    return [{k: v for k, v in card.items() if k != "created"} for card in cards]


class UnknownModelError(KeyError):
    """No instance serves the requested model or adapter."""


class ModelIndex:
    __slots__ = ("_cards", "_instances", "_parent", "_routes", "_unknown")

    def __init__(self) -> None:
        self._cards: dict[str, tuple[ModelCard, ...] | None] = {}  # instance -> its cards
        self._instances: frozenset[str] = frozenset()
        self._unknown: frozenset[str] = frozenset()  # instances that serve anything
        self._routes: dict[str, frozenset[str] | None] = {}  # model -> route() answer
        self._parent: dict[str, str] = {}  # adapter -> its base model

    def set_models(self, instance_id: str, cards: Sequence[ModelCard] | None) -> bool:
        new = None if cards is None else tuple(cards)
        if instance_id in self._cards and _listed(self._cards[instance_id]) == _listed(new):
            return False
        self._cards[instance_id] = new
        self._rebuild()
        return True

    def remove_instance(self, instance_id: str) -> bool:
        if self._cards.pop(instance_id, ()) == ():
            return False
        self._rebuild()
        return True

    def models_of(self, instance_id: str) -> list[str] | None:
        """The names an instance serves (None: not known)."""
        cards = self._cards.get(instance_id)
        return None if cards is None else [card["id"] for card in cards]

    def route(self, model: str | None) -> frozenset[str] | None:
        """The instances that may take `model` (None: any instance); see the module contract."""
        if model is None:
            return None
        try:
            return self._routes[model]
        except KeyError:
            if self._unknown:
                return None if self._unknown == self._instances else self._unknown
            raise UnknownModelError(model) from None

    def parent(self, model: str) -> str | None:
        return self._parent.get(model)

    def cards(self) -> list[ModelCard]:
        seen: dict[str, ModelCard] = {}
        for instance_id in sorted(self._cards):
            for card in self._cards[instance_id] or ():
                seen.setdefault(card["id"], card)
        listed = list(seen.values())
        return [c for c in listed if not c.get("parent")] + [c for c in listed if c.get("parent")]

    def _rebuild(self) -> None:
        served: dict[str, set[str]] = {}
        parent: dict[str, str] = {}
        for instance_id, cards in self._cards.items():
            for card in cards or ():
                served.setdefault(card["id"], set()).add(instance_id)
                if card.get("parent"):
                    parent.setdefault(card["id"], card["parent"])
        self._instances = frozenset(self._cards)
        self._unknown = frozenset(i for i, cards in self._cards.items() if cards is None)
        routes: dict[str, frozenset[str] | None] = {}
        for model, holders in served.items():
            may = frozenset(holders) | self._unknown
            routes[model] = None if may == self._instances else may
        self._routes = routes
        self._parent = parent
