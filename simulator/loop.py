"""Virtual-clock discrete-event loop.

Contract: events are callbacks scheduled at a virtual time; `run()` pops them in (time, insertion
order) order, setting `now` before each call, so equal-time events run in the order they were
scheduled and a run is deterministic. Scheduling into the past is an error. Nothing here sleeps or reads
a real clock.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable
from typing import Any


class EventLoop:
    def __init__(self) -> None:
        self.now = 0.0
        self._queue: list[tuple[float, int, Callable[..., None], tuple[Any, ...]]] = []
        self._seq = itertools.count()
        self.num_events = 0

    def call_at(self, when: float, callback: Callable[..., None], *args: Any) -> None:
        if when < self.now:
            raise ValueError(f"cannot schedule at {when} before now ({self.now})")
        heapq.heappush(self._queue, (when, next(self._seq), callback, args))

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
            when, _, callback, args = heapq.heappop(queue)
            self.now = when
            self.num_events += 1
            callback(*args)
