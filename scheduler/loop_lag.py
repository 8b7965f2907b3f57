"""Event-loop lag: how long the proxy's own loop was late, so its lag is never blamed on an instance.

Contract:
- `LoopLag` ticks every ``interval_s`` on the running loop and records how late each tick ran (the
  time the loop was busy elsewhere: tokenizing, hashing, a flood of requests). It keeps the last
  ``window_s`` seconds of ticks.
- `owed(since)`: the loop's lag since monotonic time `since` (the sum of the late ticks' lateness,
  plus the current tick's lateness while it is overdue): the part of a wait that was the proxy's,
  not the instance's. Deadlines are extended by it (`scheduler.forwarding`).
- `saturated()`: the loop ran late by more than ``saturated_fraction`` of the recent window;
  timeouts then are not evidence against an instance (`scheduler.proxy.proxy`).
- Without `start()` (or before the first tick) nothing is owed: `owed` returns 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque


class LoopLag:
    def __init__(
        self, interval_s: float = 0.05, window_s: float = 10.0, saturated_fraction: float = 0.2
    ) -> None:
        self.interval_s = interval_s
        self.window_s = window_s
        self.saturated_fraction = saturated_fraction
        self._ticks: deque[tuple[float, float]] = deque()  # (tick time, lateness), late ticks only
        self._expected: float | None = None  # when the pending tick is due
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="kvherd-loop-lag")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _run(self) -> None:
        while True:
            self._expected = time.monotonic() + self.interval_s
            await asyncio.sleep(self.interval_s)
            self.record(time.monotonic())

    def record(self, now: float) -> None:
        """One tick ran at `now` (the periodic task calls it; tests call it with made-up times)."""
        expected, self._expected = self._expected, None
        if expected is not None and now - expected > 0.001:
            self._ticks.append((now, now - expected))
        cutoff = now - self.window_s
        ticks = self._ticks
        while ticks and ticks[0][0] < cutoff:
            ticks.popleft()

    def expect(self, due: float) -> None:
        """The next tick is due at `due` (tests; the periodic task sets it itself)."""
        self._expected = due

    def owed(self, since: float, now: float | None = None) -> float:
        now = time.monotonic() if now is None else now
        total = 0.0
        for at, lateness in reversed(self._ticks):
            if at < since:
                break
            total += min(lateness, at - since)
        expected = self._expected
        if expected is not None and now > expected:  # the pending tick is overdue right now
            total += now - max(expected, since)
        return total

    def saturated(self, now: float | None = None) -> bool:
        now = time.monotonic() if now is None else now
        span = min(self.window_s, 2.0)
        return self.owed(now - span, now) > self.saturated_fraction * span
