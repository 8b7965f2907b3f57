"""One attempt at a request on one instance: its upstream, and the fleet's accounting closed once.

Contract:
- An `Attempt` starts when the fleet dispatched the request's key to an instance, and ends with
  exactly one of the fleet's `request_finished` / `request_failed`, whatever the path: `finish(ok)`
  (answered; ``ok``: counts as a success for outlier detection), `fail(exc)` (the instance failed
  it; a connect timeout while the proxy's own loop is saturated is no evidence against the
  instance and finishes instead), or, as a context manager, on exit: an `UpstreamError` fails it,
  anything else (client gone, cancellation, a bug) finishes it. Calls after the first are no-ops.
- `open(pool, path, headers, body, head_timeout, watch)` POSTs the body and returns the `Upstream`:
  a 5xx is `UpstreamStatus` (kept: relayed if no other instance answers); a stream's first chunk
  is read before anything reaches the client (an instance that dies during prefill is retried
  elsewhere); `watch` wraps the chunks first (the P/D handoff line). An error fails the attempt.
- `follow(instance)`: the request migrated; the attempt names the instance it runs on now (the
  fleet moved its accounting at the migration's commit).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING

from scheduler.forwarding import (
    UpstreamConnectTimeout,
    UpstreamError,
    UpstreamPool,
    UpstreamResponse,
)
from scheduler.loop_lag import LoopLag

if TYPE_CHECKING:
    from scheduler.fleet import Fleet, FleetInstance


class UpstreamStatus(UpstreamError):
    """The instance answered 5xx: a failure, with its response kept."""

    def __init__(self, response: UpstreamResponse) -> None:
        super().__init__(f"HTTP {response.status}")
        self.response = response


@dataclass(slots=True)
class Upstream:
    """An opened upstream response: its chunks (None unless streamed) and the first of them."""

    response: UpstreamResponse
    chunks: AsyncIterator[bytes] | None
    first: bytes


class Attempt:
    __slots__ = ("_lag", "closed", "fleet", "instance", "key")

    def __init__(self, fleet: Fleet, lag: LoopLag, key: str, instance: FleetInstance) -> None:
        self.fleet = fleet
        self._lag = lag
        self.key = key
        self.instance = instance
        self.closed = False

    def finish(self, ok: bool = True) -> None:
        if not self.closed:
            self.closed = True
            self.fleet.request_finished(self.key, self.instance, ok=ok)

    def fail(self, exc: UpstreamError | None = None) -> None:
        if self.closed:
            return
        if isinstance(exc, UpstreamConnectTimeout) and self._lag.saturated():
            self.finish(ok=False)
            return
        self.closed = True
        self.fleet.request_failed(self.key, self.instance)

    def follow(self, instance: FleetInstance) -> None:
        self.instance = instance

    def __enter__(self) -> Attempt:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if isinstance(exc, UpstreamError):
            self.fail(exc)
        else:
            self.finish()

    async def open(
        self,
        pool: UpstreamPool,
        path: bytes,
        headers: list[tuple[bytes, bytes]],
        body: bytes,
        head_timeout: float | None = None,
        watch: Callable[[AsyncIterator[bytes]], AsyncIterator[bytes]] | None = None,
    ) -> Upstream:
        try:
            response = await pool.send(
                self.instance.url, b"POST", path, headers, body, head_timeout=head_timeout
            )
        except UpstreamError as exc:
            self.fail(exc)
            raise
        except BaseException:
            self.finish()
            raise
        if response.status >= 500:
            response.close()
            error = UpstreamStatus(response)
            self.fail(error)
            raise error
        if not response.streaming:
            return Upstream(response, None, b"")
        if head_timeout is not None:
            response.read_timeout = head_timeout
        chunks = response.iter_body()
        if watch is not None:
            chunks = watch(chunks)
        try:
            first = await anext(chunks, b"")
        except UpstreamError as exc:
            self.fail(exc)
            raise
        except BaseException:
            response.close()
            self.finish()
            raise
        return Upstream(response, chunks, first)
