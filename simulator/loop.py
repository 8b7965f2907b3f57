"""Virtual-clock discrete-event loop.

Contract: events are callbacks scheduled at a virtual time; `run()` pops them in (time, insertion
order) order, setting `now` (and `current`, the running event's (time, order) key) before each
call, so equal-time events run in the order they were scheduled and a run is deterministic.
Scheduling into the past is an error. `key_at(when)` hands out the key an event scheduled now at
`when` would get, for work a caller keeps outside the queue and applies lazily, in the same order,
before the first event that reads it (`current` > key). Nothing here sleeps or reads a real clock.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Callable
from typing import Any


class EventLoop:
    def __init__(self) -> None:
        self.now = 0.0
        self._queue: list[tuple[float, int, bool, Callable[..., None], tuple[Any, ...]]] = []
        self._barriers: list[float] = []  # times of the queued barrier events (a heap)
        self._seq = itertools.count()
        self.current: tuple[float, int] = (0.0, -1)
        self.num_events = 0

    def call_at(self, when: float, callback: Callable[..., None], *args: Any) -> None:
        if when < self.now:
            raise ValueError(f"cannot schedule at {when} before now ({self.now})")
        heapq.heappush(self._queue, (when, next(self._seq), True, callback, args))
        heapq.heappush(self._barriers, when)

    def call_at_order(
        self, when: float, order: int, callback: Callable[..., None], *args: Any
    ) -> None:
        """`call_at` with an explicit tie-break `order` in place of the insertion order: a
        negative one runs before every event `call_at` queues for the same time (a feed that
        queues its next item only when the last one runs keeps the order queueing them all up
        front would have given)."""
        if when < self.now:
            raise ValueError(f"cannot schedule at {when} before now ({self.now})")
        heapq.heappush(self._queue, (when, order, True, callback, args))
        heapq.heappush(self._barriers, when)

    def call_at_quiet(self, when: float, callback: Callable[..., None], *args: Any) -> None:
        """Schedule an event that is no barrier (see the module contract)."""
        if when < self.now:
            raise ValueError(f"cannot schedule at {when} before now ({self.now})")
        heapq.heappush(self._queue, (when, next(self._seq), False, callback, args))

    def key_at(self, when: float) -> tuple[float, int]:
        """The (time, order) key of an event scheduled now at `when`, without queueing one."""
        if when < self.now:
            raise ValueError(f"cannot schedule at {when} before now ({self.now})")
        return (when, next(self._seq))

    def next_barrier(self) -> float:
        return self._barriers[0] if self._barriers else math.inf

    def call_later(self, delay: float, callback: Callable[..., None], *args: Any) -> None:
        self.call_at(self.now + delay, callback, *args)

    def __len__(self) -> int:
        return len(self._queue)

    def run(self, until: float | None = None) -> None:
        """Run events until the queue is empty (or the next event is later than `until`)."""
        queue = self._queue
        while queue:
            if until is not None and queue[0][0] > until:
                self.now = until
                return
            when, seq, barrier, callback, args = heapq.heappop(queue)
            if barrier:
                # Events leave in time order, so this barrier is the earliest one.
                heapq.heappop(self._barriers)
            self.now = when
            self.current = (when, seq)
            self.num_events += 1
            callback(*args)
