"""Which simulated instance serves which model: a trace's model names -> the proxy's model index.

Contract:
- `FleetModels` is the fleet's catalogue: its base models, each on the instances it names (by
  position; None: every instance), how many LoRA adapters an instance holds at once
  (`max_loras`, vLLM's ``--max-loras``) and what loading one into a slot costs (`lora_load_s`).
- A trace's `model` that is no base model is a LoRA adapter of its `parent` (or of the fleet's
  only base model); every instance serving the parent lists the adapter, as vLLM lists each of
  its ``--lora-modules`` with ``parent`` in ``/v1/models``.
- `FleetModels.index(trace, instance_ids)` builds production's own
  `scheduler.core.model_index.ModelIndex` from those cards; `ModelRoutes.of(model)` answers the
  router's (only, adapter) for a request as the proxy does (`ModelIndex.route`, an adapter when
  the model has a parent), once per model name. `ValueError` for a catalogue that cannot serve
  the trace (an adapter whose parent is no base model, or is ambiguous).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from scheduler.core.model_index import ModelCard, ModelIndex
from simulator.traces import Trace

# What loading an adapter into a free slot costs by default: the `kvherd` policy's own price of
# a load (`lora_load_tokens` 256, "~20 ms"), so the simulated cost and the policy's agree.
DEFAULT_LORA_LOAD_S = 0.020
DEFAULT_BASE_MODEL = "base"


@dataclass(frozen=True, slots=True)
class FleetModels:
    base_models: tuple[tuple[str, tuple[int, ...] | None], ...] = ((DEFAULT_BASE_MODEL, None),)
    max_loras: int = 1  # vLLM's default
    lora_load_s: float = DEFAULT_LORA_LOAD_S

    def __post_init__(self) -> None:
        if not self.base_models:
            raise ValueError("a fleet serves at least one base model")
        if self.max_loras < 1:
            raise ValueError(f"max_loras must be at least 1, got {self.max_loras}")
        if not self.lora_load_s >= 0:
            raise ValueError(f"the adapter load time must be >= 0 s, got {self.lora_load_s}")

    def cards(self, trace: Trace, instance_ids: Sequence[str]) -> dict[str, list[ModelCard]]:
        """Per instance, its model cards: its base models, then their adapters the trace names."""
        bases = dict(self.base_models)
        adapters: dict[str, str] = {}  # adapter -> its base model
        for request in trace.requests:
            model = request.model
            if model is None or model in bases:
                continue
            parent = request.parent
            if parent is None:
                if len(bases) > 1:
                    raise ValueError(
                        f"adapter {model!r} names no parent and the fleet serves "
                        f"{len(bases)} base models"
                    )
                parent = next(iter(bases))
            if parent not in bases:
                raise ValueError(f"adapter {model!r}: its parent {parent!r} is no base model")
            if adapters.setdefault(model, parent) != parent:
                raise ValueError(f"adapter {model!r} names two parents")
        out: dict[str, list[ModelCard]] = {}
        for position, instance_id in enumerate(instance_ids):
            served = [b for b, where in self.base_models if where is None or position in where]
            cards: list[ModelCard] = [{"id": b, "parent": None} for b in served]
            cards += [{"id": a, "parent": p} for a, p in adapters.items() if p in served]
            out[instance_id] = cards
        return out

    def index(self, trace: Trace, instance_ids: Sequence[str]) -> ModelRoutes:
        index = ModelIndex()
        for instance_id, cards in self.cards(trace, instance_ids).items():
            index.set_models(instance_id, cards)
        return ModelRoutes(index)


class ModelRoutes:
    """The router's (only, adapter) per model name, from the model index, cached by name."""

    __slots__ = ("_answers", "index")

    def __init__(self, index: ModelIndex) -> None:
        self.index = index
        self._answers: dict[str, tuple[frozenset[str] | None, str | None]] = {}

    def of(self, model: str) -> tuple[frozenset[str] | None, str | None]:
        """(only, adapter) for `model`; `UnknownModelError` when no instance serves it."""
        answer = self._answers.get(model)
        if answer is None:
            only = self.index.route(model)
            answer = (only, model if self.index.parent(model) else None)
            self._answers[model] = answer
        return answer


def parse_base_models(text: str) -> tuple[tuple[str, tuple[int, ...] | None], ...]:
    """``NAME[=FIRST-LAST|=I],...`` (instance positions, inclusive; none: every instance)."""
    out: list[tuple[str, tuple[int, ...] | None]] = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, sep, where = item.partition("=")
        name = name.strip()
        if not name or any(name == seen for seen, _ in out):
            raise ValueError(f"--base-models: bad or repeated model name in {item!r}")
        if not sep:
            out.append((name, None))
            continue
        first, dash, last = where.partition("-")
        try:
            lo = int(first)
            hi = int(last) if dash else lo
        except ValueError:
            raise ValueError(f"--base-models: {item!r} wants NAME=FIRST-LAST") from None
        if not 0 <= lo <= hi:
            raise ValueError(f"--base-models: {item!r} wants 0 <= FIRST <= LAST")
        out.append((name, tuple(range(lo, hi + 1))))
    if not out:
        raise ValueError("--base-models names no model")
    return tuple(out)
