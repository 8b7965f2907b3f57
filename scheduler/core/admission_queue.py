"""The admission queue: requests waiting for an instance with room, by class, then by fair share.

Contract:
- Pure (explicit `now`), generic over what waits (the proxy's futures, the simulator's requests).
- `join(now, item, tenant, priority, since)`: False when ``size`` items already wait (the caller
  refuses: ``queue_full``); else the item waits until ``now + timeout_s`` (`deadline`), aging from
  `since` (a woken item that found no room joins again, at the back of its tenant, from its first
  join).
- `wake(now)`: the next item leaves the queue when capacity came free (None when empty): an item
  that waited ``aging_s`` first (the oldest; so no class starves beyond that bound), else from the
  lowest ``priority`` value waiting (vLLM's order), and within a class by weighted fair share
  between tenants: each item is tagged ``max(V, its tenant's last tag) + 1 / weight`` (start-time
  fair queuing, ``V`` the class's last woken tag), the lowest tag first. A tenant alone takes all
  (idle share is lent); backlogged tenants are served in proportion to their weights.
- `ahead(tenant, priority)`: items a new one would wait behind (the classes before its own, and in
  its own each tenant's items up to that tenant's share of the new one's turn; an estimate).
- `leave(item)`: it stopped waiting (a no-op when gone); `expire(now)`: those past their deadline.
"""

from __future__ import annotations

import heapq
import math
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class QueueSettings:
    size: int = 1024
    timeout_s: float = 30.0
    aging_s: float = 10.0  # a waiting item goes first after this long, whatever its class

    def __post_init__(self) -> None:
        if self.size < 0 or self.timeout_s <= 0 or self.aging_s <= 0:
            raise ValueError("queue size must be >= 0, its timeout and aging > 0")


@dataclass(slots=True)
class _Class:
    """One priority class: its tenants' items (tag, join number, item) in arrival order."""

    vtime: float = 0.0
    items: dict[str | None, deque[tuple[float, int, Any]]] = field(default_factory=dict)
    counts: dict[str | None, int] = field(default_factory=dict)  # live items by tenant
    last: dict[str | None, float] = field(default_factory=dict)  # each tenant's last tag


@dataclass(frozen=True, slots=True)
class _Entry:
    seq: int
    tenant: str | None
    priority: int
    joined: float
    deadline: float


class AdmissionQueue(Generic[T]):
    """Waiting items in class, fair-share and aging order (see the module contract)."""

    __slots__ = ("_by_age", "_classes", "_entries", "_seq", "_weight", "settings")

    def __init__(
        self,
        settings: QueueSettings | None = None,
        weight: Callable[[str | None], float] | None = None,
    ) -> None:
        self.settings = settings or QueueSettings()
        self._weight = weight or (lambda _: 1.0)
        self._entries: OrderedDict[T, _Entry] = OrderedDict()  # in arrival (deadline) order
        self._by_age: list[tuple[float, int, T]] = []  # a heap by first join (stale ones too)
        self._classes: dict[int, _Class] = {}
        self._seq = 0

    def __len__(self) -> int:
        return len(self._entries)

    def join(
        self,
        now: float,
        item: T,
        tenant: str | None = None,
        priority: int = 0,
        since: float | None = None,
    ) -> bool:
        if len(self._entries) >= self.settings.size:
            return False
        self._seq += 1
        klass = self._classes.setdefault(priority, _Class())
        tag = max(klass.vtime, klass.last.get(tenant, -math.inf)) + 1 / self._weight(tenant)
        klass.last[tenant] = tag
        klass.items.setdefault(tenant, deque()).append((tag, self._seq, item))
        klass.counts[tenant] = klass.counts.get(tenant, 0) + 1
        joined = now if since is None else since
        self._entries[item] = _Entry(
            self._seq, tenant, priority, joined, now + self.settings.timeout_s
        )
        heapq.heappush(self._by_age, (joined, self._seq, item))
        return True

    def deadline(self, item: T) -> float:
        return self._entries[item].deadline

    def ahead(self, tenant: str | None = None, priority: int = 0) -> int:
        before = 0
        for value, klass in self._classes.items():
            if value < priority:
                before += sum(klass.counts.values())
            elif value == priority:
                mine = klass.counts.get(tenant, 0)
                share = (mine + 1) / self._weight(tenant)
                for other, count in klass.counts.items():
                    before += (
                        count
                        if other == tenant
                        else min(count, math.ceil(share * self._weight(other)))
                    )
        return before

    def wake(self, now: float) -> T | None:
        if not self._entries:
            return None
        by_age = self._by_age
        while not self._live(by_age[0]):
            heapq.heappop(by_age)
        joined, _, oldest = by_age[0]
        if now - joined >= self.settings.aging_s:
            self._remove(oldest)
            return oldest
        klass = self._classes[min(self._classes)]
        best: tuple[float, int, Any] | None = None
        for queue in klass.items.values():
            while queue and not self._live(queue[0]):
                queue.popleft()
            if queue and (best is None or queue[0] < best):
                best = queue[0]
        assert best is not None, "a class with live items"
        klass.vtime = best[0]
        item: T = best[2]
        self._remove(item)
        return item

    def _live(self, queued: tuple[float, int, Any]) -> bool:
        """A (tag or join time, join number, item) of an item still waiting from that join."""
        entry = self._entries.get(queued[2])
        return entry is not None and entry.seq == queued[1]

    def _remove(self, item: T) -> None:
        entry = self._entries.pop(item)
        klass = self._classes[entry.priority]
        left = klass.counts[entry.tenant] - 1
        if left:
            klass.counts[entry.tenant] = left
        else:  # its stale entries go too; its last tag stays for its next item
            del klass.counts[entry.tenant]
            del klass.items[entry.tenant]
            if not klass.counts:
                del self._classes[entry.priority]
        if not self._entries:
            self._by_age.clear()

    def leave(self, item: T) -> None:
        if item in self._entries:
            self._remove(item)

    def expire(self, now: float) -> list[T]:
        gone: list[T] = []
        entries = self._entries
        while entries:
            item, entry = next(iter(entries.items()))
            if entry.deadline > now:
                break
            self._remove(item)
            gone.append(item)
        return gone
