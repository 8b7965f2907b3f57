"""`LoraSlots`: resident adapters, LRU eviction of idle ones, one path per name for good."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from instance_agent.engine.core.lora_slots import LoraSlotError, LoraSlots


@dataclass(frozen=True)
class Adapter:
    name: str
    path: str


def idle(_: str) -> bool:
    return False


def test_a_full_table_evicts_the_least_recently_used_idle_adapter() -> None:
    slots: LoraSlots[Adapter] = LoraSlots(2)
    assert slots.install(Adapter("A", "/a"), idle) is None
    assert slots.install(Adapter("B", "/b"), idle) is None
    slots.touch("A")  # B is now the least recently used
    assert slots.install(Adapter("C", "/c"), idle) == "B"
    assert list(slots.adapters) == ["A", "C"]
    # A runs requests: C goes instead, although A was used before C.
    slots.touch("C")
    assert slots.install(Adapter("D", "/d"), lambda name: name == "A") == "C"
    with pytest.raises(LoraSlotError, match="every LoRA slot"):
        slots.install(Adapter("E", "/e"), lambda name: True)
    assert list(slots.adapters) == ["A", "D"]


def test_names_are_unique_and_keep_their_path() -> None:
    slots: LoraSlots[Adapter] = LoraSlots(1)
    slots.install(Adapter("A", "/a"), idle)
    with pytest.raises(LoraSlotError, match="already been loaded"):
        slots.install(Adapter("A", "/a"), idle)
    slots.remove("A", idle)
    with pytest.raises(LoraSlotError, match="cannot be found"):
        slots.remove("A", idle)
    with pytest.raises(LoraSlotError, match="cannot be loaded from '/other'"):
        slots.check_path("A", "/other")
    slots.install(Adapter("A", "/a"), idle)  # the same weights again: fine
    with pytest.raises(LoraSlotError, match="requests running"):
        slots.remove("A", lambda name: True)
    with pytest.raises(ValueError):
        LoraSlots(0)
