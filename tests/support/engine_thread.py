"""An engine stepping on its own thread, serving migration calls between steps (in-process fleets).

Contract:
- `EngineThread(engine, adapter)` steps `engine` (anything with ``step() -> outputs`` and
  ``has_unfinished()``) whenever it has work, and otherwise sleeps on a condition. Functions
  submitted with `call` run on that thread between two steps, in order, and their result (or
  exception) is returned to the awaiting coroutine: exactly the `EngineCall` the migration drivers
  need. `adapter` is what those functions receive (the engine's `MigratableEngine` view).
- Every output's new token ids are appended to `tokens[request_id]` (and its arrival time to
  `token_times[request_id]`); `finish_reasons` records how
  each request ended here. `after_step` hooks run on the thread after each step (fault injection,
  measuring progress).
- The agent runs its own `EngineLoop` instead; this runner serves benchmarks and tests that put
  several engines in one process.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any, TypeVar

from migration.core.protocol import MigratableEngine

T = TypeVar("T")


class EngineThread:
    def __init__(self, engine: Any, adapter: MigratableEngine, name: str = "engine") -> None:
        self.engine = engine
        self.adapter = adapter
        self.tokens: dict[str, list[int]] = {}
        self.token_times: dict[str, list[float]] = {}  # when each request's outputs arrived
        self.finish_reasons: dict[str, str | None] = {}
        self.step_times: list[float] = []  # wall-clock end of every step
        self.after_step: list[Callable[[Any], None]] = []
        self.error: BaseException | None = None
        self._cond = threading.Condition()
        self._commands: deque[Callable[[], None]] = deque()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    async def call(self, fn: Callable[[MigratableEngine], T]) -> T:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()

        def command() -> None:
            try:
                value = fn(self.adapter)
            except BaseException as e:
                loop.call_soon_threadsafe(_settle, future, None, e)
                return
            loop.call_soon_threadsafe(_settle, future, value, None)

        with self._cond:
            self._commands.append(command)
            self._cond.notify()
        return await future

    async def run(self, fn: Callable[[Any], T]) -> T:
        """Like `call`, with the engine itself instead of its migration view."""
        engine = self.engine
        return await self.call(lambda _adapter: fn(engine))

    def stop(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify()
        self._thread.join(30)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._commands and not self._stopping and not self._has_work():
                    self._cond.wait()
                commands = list(self._commands)
                self._commands.clear()
                if self._stopping:
                    return
            for command in commands:
                command()
            if self._has_work():
                try:
                    outputs = self.engine.step()
                except BaseException as e:  # surfaced to the test or benchmark, never swallowed
                    self.error = e
                    return
                if not outputs:
                    # Only suspended requests are left (a migration's stop-and-copy): nothing to
                    # step until a command changes that.
                    with self._cond:
                        if not self._commands and not self._stopping:
                            self._cond.wait(0.001)
                    continue
                now = time.perf_counter()
                self.step_times.append(now)
                for out in outputs:
                    self.tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
                    self.token_times.setdefault(out.request_id, []).append(now)
                    if out.finished:
                        self.finish_reasons[out.request_id] = out.finish_reason
                for hook in self.after_step:
                    hook(self.engine)

    def _has_work(self) -> bool:
        return self.error is None and bool(self.engine.has_unfinished())


def _settle(future: asyncio.Future[Any], value: Any, error: BaseException | None) -> None:
    if future.done():
        return
    if error is None:
        future.set_result(value)
    else:
        future.set_exception(error)
