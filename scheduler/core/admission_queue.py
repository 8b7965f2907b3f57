"""The admission queue: requests waiting for an instance with room, first come first served.

Contract:
- Pure (explicit `now`), generic over what waits (the proxy's futures, the simulator's requests).
- `join(now, item)`: False when ``size`` items already wait (the caller refuses: ``queue_full``);
  else the item waits until ``now + timeout_s`` (`deadline`).
- `wake()`: the head leaves the queue when capacity came free (None when empty). A woken item that
  still finds no room joins again, at the back (`join`).
- `leave(item)`: it stopped waiting (timed out, cancelled, dispatched): a no-op when it is gone.
- `expire(now)`: the items whose deadline passed, removed in queue order (a clock without timers,
  the simulator's, asks for them; the proxy's futures time out on their own `deadline`).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Generic, TypeVar

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class QueueSettings:
    size: int = 1024
    timeout_s: float = 30.0

    def __post_init__(self) -> None:
        if self.size < 0 or self.timeout_s <= 0:
            raise ValueError("queue size must be >= 0 and its timeout > 0")


class AdmissionQueue(Generic[T]):
    """FIFO of waiting items with a bound on their number and on their wait."""

    __slots__ = ("_deadlines", "settings")

    def __init__(self, settings: QueueSettings | None = None) -> None:
        self.settings = settings or QueueSettings()
        self._deadlines: OrderedDict[T, float] = OrderedDict()  # in arrival order

    def __len__(self) -> int:
        return len(self._deadlines)

    def join(self, now: float, item: T) -> bool:
        if len(self._deadlines) >= self.settings.size:
            return False
        self._deadlines[item] = now + self.settings.timeout_s
        return True

    def deadline(self, item: T) -> float:
        return self._deadlines[item]

    def wake(self) -> T | None:
        if not self._deadlines:
            return None
        item, _ = self._deadlines.popitem(last=False)
        return item

    def leave(self, item: T) -> None:
        self._deadlines.pop(item, None)

    def expire(self, now: float) -> list[T]:
        gone: list[T] = []
        deadlines = self._deadlines
        while deadlines:
            item, deadline = next(iter(deadlines.items()))
            if deadline > now:
                break
            del deadlines[item]
            gone.append(item)
        return gone
