"""Live migration of vLLM streams by the proxy: cut a stream, continue it at the destination.

Contract:
- The relay registers each stream it pumps from an engine that is not a kvherd agent
  (`register(key, response)`, `unregister(key)` when that pump ends).
- `migrate(key, dst)` (the migration driver's order for such a source): with no stream under `key`
  (not streamed, not here, ended, already moving) it is ABORTED ``request_not_running``. Else the
  source's response is cut (vLLM aborts the request; kvherd's connector keeps its full blocks)
  and the relay, whose pump then breaks, continues the very same stream at `dst` from what the
  client has (`continuation.StreamLedger`), asking its connector to pull every full block from
  the source's block server (without one they are recomputed, as in any continuation).
- The relay takes the cut (`taken(key)`) in its pump's failure path and `settle`s it: COMMITTED
  once the destination's stream opened (downtime: the cut to that), ABORTED ``dst_failed`` when
  it did not (the stream is then continued as after a lost instance); a stream that ends before
  its pump breaks settles it ABORTED ``request_finished``.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from migration.core.protocol import AbortReason, MigrationOutcome, MigrationStatus
from scheduler.forwarding import UpstreamResponse


@dataclass(slots=True)
class Cut:
    response: UpstreamResponse
    dst: str | None = None  # the instance asked for, once a migration is asked
    asked_at: float = 0.0
    outcome: asyncio.Future[MigrationOutcome] | None = None


class StreamCuts:
    def __init__(self) -> None:
        self._streams: dict[str, Cut] = {}

    def register(self, key: str, response: UpstreamResponse) -> None:
        self._streams[key] = Cut(response)

    def unregister(self, key: str) -> None:
        cut = self._streams.pop(key, None)
        if cut is not None and cut.outcome is not None:
            _settle(cut, key, AbortReason.REQUEST_FINISHED, "the stream ended first")

    def taken(self, key: str) -> Cut | None:
        """The migration asked for `key`'s stream, if any (it leaves the registry)."""
        cut = self._streams.get(key)
        if cut is None or cut.dst is None:
            return None
        del self._streams[key]
        return cut

    async def migrate(self, key: str, dst: str) -> MigrationOutcome:
        cut = self._streams.get(key)
        if cut is None or cut.dst is not None:
            return _outcome(key, MigrationStatus.ABORTED, AbortReason.REQUEST_NOT_RUNNING)
        cut.dst, cut.asked_at = dst, time.monotonic()
        cut.outcome = asyncio.get_running_loop().create_future()
        cut.response.cut(f"migrating to {dst}")
        return await cut.outcome

    @staticmethod
    def settle(cut: Cut, key: str, opened: bool, finished: bool = False) -> None:
        if opened:
            _settle(cut, key, None, None)
        elif finished:
            _settle(cut, key, AbortReason.REQUEST_FINISHED, "the stream ended first")
        else:
            _settle(cut, key, AbortReason.DST_FAILED, "the destination did not open the stream")


def _settle(cut: Cut, key: str, reason: AbortReason | None, detail: str | None) -> None:
    if cut.outcome is None or cut.outcome.done():
        return
    status = MigrationStatus.COMMITTED if reason is None else MigrationStatus.ABORTED
    outcome = _outcome(key, status, reason, detail)
    outcome.downtime_s = outcome.duration_s = time.monotonic() - cut.asked_at
    cut.outcome.set_result(outcome)


def _outcome(
    key: str, status: MigrationStatus, reason: AbortReason | None, detail: str | None = None
) -> MigrationOutcome:
    return MigrationOutcome(f"proxy-{key}", key, status, reason, detail)
