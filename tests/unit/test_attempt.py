"""The attempt context: on every exit path of a request (success, upstream error before and after
the first byte, a 5xx, the client gone, a continuation, a migration, cancellation) the fleet's
accounting is finished exactly once per dispatch. Real sockets: scripted instances on loopback, a
real `Fleet`, `UpstreamPool` and `Relay`; only the client side (`Exchange`) is a recording stub."""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest

from kvherd import wire
from scheduler.core.deadlines import Deadlines, DeadlineSettings
from scheduler.fleet import Fleet, FleetSettings, InstanceSpec, NoCapacityError
from scheduler.forwarding import UpstreamError, UpstreamPool
from scheduler.loop_lag import LoopLag
from scheduler.metrics import ProxyMetrics
from scheduler.proxy.attempt import Attempt, UpstreamStatus
from scheduler.proxy.continuation import Continued
from scheduler.proxy.relay import Job, Relay
from scheduler.proxy.routed_request import RoutedRequest

Script = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]

DONE = b"data: [DONE]\n\n"


def chunk(text: str, index: int) -> bytes:
    """One token's frame, with the agents' token ledger (the first also names the resume)."""
    ledger = wire.ledger_line({"index": index, "token_ids": [index + 1]})
    if index == 0:
        ledger = wire.ledger_line({"resume": {"from": 0}, "sampling_seed": None}) + ledger
    choice = {"index": 0, "text": text}
    return ledger + wire.sse({"id": "c", "object": "text_completion", "choices": [choice]})


async def _read_request(reader: asyncio.StreamReader) -> bytes:
    head = await reader.readuntil(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":")[1])
    return await reader.readexactly(length)


def _chunked(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


async def _stream_head(writer: asyncio.StreamWriter) -> None:
    writer.write(
        b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
    )


@contextlib.asynccontextmanager
async def instance(script: Script) -> AsyncIterator[str]:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError):
            await _read_request(reader)
            await script(reader, writer)
            await writer.drain()
        writer.close()

    server = await asyncio.start_server(handler, "127.0.0.1", 0)
    try:
        yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    finally:
        server.close()


async def json_ok(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    body = b'{"choices": []}'
    writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))


async def server_error(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    writer.write(b"HTTP/1.1 503 Service Unavailable\r\ncontent-length: 2\r\n\r\n{}")


async def hang_up(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    writer.transport.abort()


async def whole_stream(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    await _stream_head(writer)
    writer.write(_chunked(chunk("a", 0)) + _chunked(chunk("b", 1)) + _chunked(DONE) + b"0\r\n\r\n")


async def breaks_after_first(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    await _stream_head(writer)
    writer.write(_chunked(chunk("a", 0)))
    await writer.drain()
    await asyncio.sleep(0.05)
    writer.transport.abort()


def migrates_to(url: str) -> Script:
    async def script(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _stream_head(writer)
        notice = wire.migration_notice(url, "r", {"from": 1})
        writer.write(_chunked(chunk("a", 0)) + _chunked(notice) + b"0\r\n\r\n")

    return script


async def resumed_rest(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    await _stream_head(writer)
    writer.write(_chunked(chunk("b", 1)) + _chunked(DONE) + b"0\r\n\r\n")


class ClientStub:
    """What the relay writes to the client; `cancel_after` chunks, then the client is gone."""

    def __init__(self, cancel_after: int | None = None) -> None:
        self.status: int | None = None
        self.data = b""
        self.chunks = 0
        self.cancel_after = cancel_after
        self.ended = False

    def respond(self, status: int, headers: Any, body: bytes) -> None:
        self.status, self.data = status, body

    def start_stream(self, status: int, headers: Any) -> None:
        self.status = status

    async def write_chunk(self, data: bytes) -> None:
        if self.cancel_after is not None and self.chunks >= self.cancel_after:
            raise asyncio.CancelledError
        self.chunks += 1
        self.data += data

    def end_stream(self) -> None:
        self.ended = True


class Books:
    """A real fleet whose finish/fail calls are counted per key."""

    def __init__(self, fleet: Fleet) -> None:
        self.fleet = fleet
        self.calls: Counter[tuple[str, str, str]] = Counter()
        finished, failed = fleet.request_finished, fleet.request_failed

        def on_finished(key: str, inst: Any, ok: bool = True) -> None:
            self.calls["finished", key, inst.instance_id] += 1
            finished(key, inst, ok)

        def on_failed(key: str, inst: Any) -> None:
            self.calls["failed", key, inst.instance_id] += 1
            failed(key, inst)

        fleet.request_finished = on_finished  # type: ignore[method-assign]
        fleet.request_failed = on_failed  # type: ignore[method-assign]

    def closes(self, key: str) -> int:
        return sum(n for (_, k, _), n in self.calls.items() if k == key)


@contextlib.asynccontextmanager
async def fleet_of(*urls: str) -> AsyncIterator[tuple[Books, Relay, UpstreamPool]]:
    fleet = Fleet("round_robin", FleetSettings(block_size=16), ProxyMetrics())
    for n, url in enumerate(urls):
        await fleet.add_instance(InstanceSpec(f"i{n}", url))
    pool = UpstreamPool(connect_timeout=1.0, head_timeout=2.0, read_timeout=2.0)
    books = Books(fleet)
    lag = LoopLag()
    opened: list[Any] = []

    async def continue_stream(job: Job, continued: Continued) -> Any:
        try:
            inst, _ = fleet.dispatch(job.key, 4, [], exclude=job.tried)
        except NoCapacityError:
            return None
        job.tried.add(inst.instance_id)
        attempt = Attempt(fleet, lag, job.key, inst)
        try:
            upstream = await attempt.open(pool, b"/v1/completions", [], b"{}")
        except UpstreamError:
            return None
        opened.append(attempt)
        return attempt, upstream

    relay = Relay(
        fleet, pool, Deadlines(DeadlineSettings()), ProxyMetrics(), continue_stream,
        max_continuations=2, expose_instance=False, fleet_token=None,
    )  # fmt: skip
    try:
        yield books, relay, pool
    finally:
        await fleet.stop()


def job_for(key: str, streamed: bool) -> Job:
    body = {"prompt": "hi", "stream": streamed}
    request = RoutedRequest(b"/v1/completions", False, body, b"{}", 2, [], None, 8, streamed)
    return Job(key, key.encode(), request, [], set(), 0.0)


async def run(
    books: Books, relay: Relay, pool: UpstreamPool, client: ClientStub, streamed: bool
) -> Any:
    fleet = books.fleet
    job = job_for("k", streamed)
    inst, _ = fleet.dispatch("k", 4, [])
    job.tried.add(inst.instance_id)
    attempt = Attempt(fleet, LoopLag(), "k", inst)
    upstream = await attempt.open(pool, b"/v1/completions", [], b"{}")
    if upstream.chunks is not None:
        return await relay.stream(client, job, attempt, upstream)  # type: ignore[arg-type]
    return await relay.plain(client, job, attempt, upstream)  # type: ignore[arg-type]


async def test_success_finishes_once() -> None:
    async with instance(json_ok) as url, fleet_of(url) as (books, relay, pool):
        assert await run(books, relay, pool, ClientStub(), streamed=False) == 200
        assert books.calls == {("finished", "k", "i0"): 1}
        assert books.fleet.inflight.count("i0") == 0


async def test_an_error_before_the_first_byte_fails_once() -> None:
    for script, error in ((hang_up, UpstreamError), (server_error, UpstreamStatus)):
        async with instance(script) as url, fleet_of(url) as (books, relay, pool):
            with pytest.raises(error):
                await run(books, relay, pool, ClientStub(), streamed=True)
            assert books.calls == {("failed", "k", "i0"): 1}, script


async def test_a_stream_lost_after_its_first_byte_fails_once_and_its_continuation_finishes_once() -> (
    None
):
    async with (
        instance(breaks_after_first) as lost,
        instance(whole_stream) as rest,
        fleet_of(lost, rest) as (books, relay, pool),
    ):
        client = ClientStub()
        assert await run(books, relay, pool, client, streamed=True) == 200
        assert books.calls == {("failed", "k", "i0"): 1, ("finished", "k", "i1"): 1}
        assert client.ended and books.fleet.inflight.instance_of("k") is None


async def test_a_stream_that_cannot_be_continued_fails_once() -> None:
    async with instance(breaks_after_first) as url, fleet_of(url) as (books, relay, pool):
        client = ClientStub()
        assert await run(books, relay, pool, client, streamed=True) == "upstream_broke"
        assert books.calls == {("failed", "k", "i0"): 1}
        assert b'"error"' in client.data and client.ended


async def test_a_migrated_stream_finishes_once() -> None:
    async with contextlib.AsyncExitStack() as stack:
        dst = await stack.enter_async_context(instance(resumed_rest))
        src = await stack.enter_async_context(instance(migrates_to(dst)))
        books, relay, pool = await stack.enter_async_context(fleet_of(src, dst))
        client = ClientStub()
        assert await run(books, relay, pool, client, streamed=True) == 200
        assert books.closes("k") == 1 and client.ended
        assert b'"text": "b"' in client.data or b'"text":"b"' in client.data  # the resumed rest


@pytest.mark.parametrize("streamed", [True, False])
async def test_the_client_gone_or_a_cancellation_finishes_once(streamed: bool) -> None:
    async with instance(whole_stream) as url, fleet_of(url) as (books, relay, pool):
        with pytest.raises(asyncio.CancelledError):
            await run(books, relay, pool, ClientStub(cancel_after=0), streamed=True)
        assert books.calls == {("finished", "k", "i0"): 1}
    # Cancelled while the upstream is being opened: still exactly once.
    async with instance(whole_stream) as url, fleet_of(url) as (books, relay, pool):
        task = asyncio.create_task(run(books, relay, pool, ClientStub(), streamed))
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        assert books.closes("k") <= 1
        if books.closes("k") == 0:  # cancelled before its dispatch: nothing to account
            assert books.fleet.inflight.instance_of("k") is None


def test_an_attempt_closes_once_whatever_is_called() -> None:
    class FakeFleet:
        def __init__(self) -> None:
            self.calls: list[str] = []

        def request_finished(self, key: str, inst: Any, ok: bool = True) -> None:
            self.calls.append("finished")

        def request_failed(self, key: str, inst: Any) -> None:
            self.calls.append("failed")

    fleet = FakeFleet()
    with Attempt(fleet, LoopLag(), "k", object()) as attempt:  # type: ignore[arg-type]
        attempt.fail(UpstreamError("x"))
        attempt.finish()
    assert fleet.calls == ["failed"]
    fleet.calls.clear()
    with pytest.raises(UpstreamError), Attempt(fleet, LoopLag(), "k", object()):  # type: ignore[arg-type]
        raise UpstreamError("broke")
    assert fleet.calls == ["failed"]
    fleet.calls.clear()
    with pytest.raises(KeyError), Attempt(fleet, LoopLag(), "k", object()):  # type: ignore[arg-type]
        raise KeyError("a bug")
    assert fleet.calls == ["finished"]
