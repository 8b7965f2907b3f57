"""The proxy's registry of vLLM streams it may migrate (`scheduler.proxy.stream_cuts`); the
whole migration, on real vLLM, is tests/vllm/test_vllm_migration.py."""

from __future__ import annotations

import asyncio
from typing import Any, cast

from migration.core.protocol import AbortReason, MigrationStatus
from scheduler.forwarding import UpstreamResponse
from scheduler.proxy.stream_cuts import StreamCuts


class Response:
    """Records the cut the registry makes (the relay's pump would then break)."""

    def __init__(self) -> None:
        self.cut_reason: str | None = None

    def cut(self, reason: str) -> None:
        self.cut_reason = reason


def registered(cuts: StreamCuts, key: str) -> Response:
    response = Response()
    cuts.register(key, cast("UpstreamResponse", response))
    return response


async def test_no_stream_under_the_key_is_not_running() -> None:
    outcome = await StreamCuts().migrate("nobody", "b")
    assert outcome.status is MigrationStatus.ABORTED
    assert outcome.reason is AbortReason.REQUEST_NOT_RUNNING


async def test_a_cut_commits_once_the_destination_opened() -> None:
    cuts = StreamCuts()
    response = registered(cuts, "k")
    order = asyncio.ensure_future(cuts.migrate("k", "b"))
    await asyncio.sleep(0)
    assert response.cut_reason == "migrating to b"
    again = await cuts.migrate("k", "c")  # already moving: a second order is refused
    assert again.reason is AbortReason.REQUEST_NOT_RUNNING
    cut = cuts.taken("k")
    assert cut is not None and cut.dst == "b" and cuts.taken("k") is None
    cuts.unregister("k")  # the pump's end: the taken cut is the relay's to settle
    assert not order.done()
    StreamCuts.settle(cut, "k", opened=True)
    outcome = await order
    assert outcome.status is MigrationStatus.COMMITTED and outcome.request_id == "k"
    assert outcome.downtime_s >= 0


async def test_a_stream_that_ends_first_or_cannot_open_aborts() -> None:
    cuts = StreamCuts()
    registered(cuts, "ends")
    ending = asyncio.ensure_future(cuts.migrate("ends", "b"))
    await asyncio.sleep(0)
    cuts.unregister("ends")  # ended before its pump broke
    assert (await ending).reason is AbortReason.REQUEST_FINISHED
    registered(cuts, "fails")
    failing = asyncio.ensure_future(cuts.migrate("fails", "b"))
    await asyncio.sleep(0)
    cut: Any = cuts.taken("fails")
    StreamCuts.settle(cut, "fails", opened=False)
    assert (await failing).reason is AbortReason.DST_FAILED
    assert cuts.taken("fails") is None
