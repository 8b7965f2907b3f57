"""LoRA adapter slots of one simulated instance: `max_loras` slots, loads timed, LRU eviction.

Contract:
- `acquire(adapter, now, item)` pins the adapter for one request and returns when it is ready:
  `now` when it sits in a slot (loaded), its load's end while it is loading, or `now` + the load
  time when a slot is free or holds an adapter no request pins (the least recently acquired such
  one is evicted). With every slot pinned it returns None and keeps `item` waiting, first come
  first served, for the first slot its adapter may take.
- `release(adapter, now)` unpins it (the request ended); returns the waiting items that now have
  their adapter, each with when it is ready, in the order they came (one whose adapter still
  finds no slot lets later ones with a slot go first, as vLLM's scheduler skips a request whose
  adapter has no slot).
- `active` are the pinned adapters (requests running or waiting for them, vLLM's
  ``vllm:lora_requests_info`` running + waiting adapters): what the instance reports.
- `stats`: loads, evictions and requests that waited for a slot. Pure: times are arguments.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Generic, TypeVar

Item = TypeVar("Item")


@dataclass(slots=True)
class SlotStats:
    loads: int = 0
    evictions: int = 0
    slot_waits: int = 0  # requests that found every slot pinned


class AdapterSlots(Generic[Item]):
    __slots__ = ("_ready", "_users", "_waiting", "load_s", "max_loras", "stats")

    def __init__(self, max_loras: int, load_s: float) -> None:
        if max_loras < 1:
            raise ValueError(f"max_loras must be at least 1, got {max_loras}")
        self.max_loras = max_loras
        self.load_s = load_s
        # Adapter -> when its load ends, in least-recently-acquired-first order: the slots.
        self._ready: OrderedDict[str, float] = OrderedDict()
        self._users: dict[str, int] = {}  # adapter -> requests pinning it
        self._waiting: list[tuple[str, Item]] = []
        self.stats = SlotStats()

    @property
    def active(self) -> tuple[str, ...]:
        return tuple(sorted(self._users))

    def resident(self) -> tuple[str, ...]:
        """The adapters in slots, loaded or loading, least recently acquired first."""
        return tuple(self._ready)

    def acquire(self, adapter: str, now: float, item: Item) -> float | None:
        ready = self._take(adapter, now)
        if ready is None:
            self.stats.slot_waits += 1
            self._waiting.append((adapter, item))
        return ready

    def release(self, adapter: str, now: float) -> list[tuple[Item, float]]:
        left = self._users[adapter] - 1
        if left:
            self._users[adapter] = left
            return []
        del self._users[adapter]
        started: list[tuple[Item, float]] = []
        kept: list[tuple[str, Item]] = []
        for waiting, item in self._waiting:
            ready = self._take(waiting, now)
            if ready is None:
                kept.append((waiting, item))
            else:
                started.append((item, ready))
        self._waiting = kept
        return started

    def _take(self, adapter: str, now: float) -> float | None:
        """Pin `adapter`, loading it if need be; None when no slot can take it."""
        slots = self._ready
        ready = slots.get(adapter)
        if ready is None:
            if len(slots) >= self.max_loras:
                victim = next((a for a in slots if a not in self._users), None)
                if victim is None:
                    return None
                del slots[victim]
                self.stats.evictions += 1
            ready = now + self.load_s
            self.stats.loads += 1
        slots[adapter] = ready
        slots.move_to_end(adapter)
        self._users[adapter] = self._users.get(adapter, 0) + 1
        return max(ready, now)
