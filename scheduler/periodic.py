"""A background task that runs one round of work every ``interval_s`` seconds on the event loop.

Contract:
- `start` creates the task once (later calls do nothing); `stop` cancels it and waits for it to end.
- An exception in a round is logged and the next round still runs: a bug in probing, polling or a
  migration policy must not silently stop the proxy's background work.
- With ``wait_first`` the task sleeps before its first round (for work that is pointless right at
  start-up); otherwise the first round runs at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable


class PeriodicTask:
    def __init__(
        self,
        name: str,
        round: Callable[[], Awaitable[None]],
        interval_s: float,
        log: logging.Logger,
        *,
        wait_first: bool = False,
    ) -> None:
        self.name = name
        self._round = round
        self.interval_s = interval_s
        self._log = log
        self._wait_first = wait_first
        self._task: asyncio.Task[None] | None = None

    async def _run(self) -> None:
        if self._wait_first:
            await asyncio.sleep(self.interval_s)
        while True:
            try:
                await self._round()
            except Exception:
                self._log.exception("%s: round failed", self.name)
            await asyncio.sleep(self.interval_s)

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name=self.name)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
