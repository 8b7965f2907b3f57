"""The proxy's client-facing HTTP/1.1 server (`scheduler.proxy.http_front`) over real sockets: framing,
keep-alive, pipelining, 100-continue, body limits, malformed requests, client disconnects, the ASGI
fallback, and a graceful stop that lets the request in flight finish."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, MutableMapping
from typing import Any

from scheduler.proxy.http_front import Exchange, FrontServer

Connection = tuple[asyncio.StreamReader, asyncio.StreamWriter]


async def read_response(reader: asyncio.StreamReader) -> tuple[bytes, dict[bytes, bytes], bytes]:
    """(status line, headers, body) of one response, Content-Length or chunked."""
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
    status, *lines = head[:-4].split(b"\r\n")
    headers = {k.lower(): v.strip() for k, _, v in (line.partition(b":") for line in lines)}
    if b"content-length" in headers:
        return status, headers, await reader.readexactly(int(headers[b"content-length"]))
    assert headers[b"transfer-encoding"] == b"chunked"
    body = b""
    while size := int(await reader.readuntil(b"\r\n"), 16):
        body += (await reader.readexactly(size + 2))[:-2]
    assert await reader.readuntil(b"\r\n") == b"\r\n"
    return status, headers, body


async def closed(reader: asyncio.StreamReader) -> bool:
    """Whether the server closes the connection (within 10 s) without sending anything more."""
    return await asyncio.wait_for(reader.read(), 10) == b""


def post(path: bytes, body: bytes, *extra: bytes) -> bytes:
    lines = [b"POST %s HTTP/1.1" % path, b"host: x", b"content-length: %d" % len(body), *extra]
    return b"\r\n".join(lines) + b"\r\n\r\n" + body


class Handlers:
    """Route handlers that record what they saw."""

    def __init__(self) -> None:
        self.gone: list[bool] = []
        self.release = asyncio.Event()
        self.entered = asyncio.Event()

    async def echo(self, exchange: Exchange) -> None:
        if exchange.too_large:
            exchange.respond(413, [], b"too large")
            return
        headers = [(b"x-method", exchange.method), (b"x-query", exchange.query)]
        exchange.respond(200, headers, exchange.body)

    async def stream(self, exchange: Exchange) -> None:
        exchange.start_stream(200, [(b"content-type", b"text/event-stream")])
        for piece in (b"data: 1\n\n", b"", b"data: 2\n\n"):
            await exchange.write_chunk(piece)
        exchange.end_stream()

    async def slow(self, exchange: Exchange) -> None:
        self.entered.set()
        try:
            await self.release.wait()
        except asyncio.CancelledError:
            self.gone.append(exchange.gone)
            raise
        exchange.respond(200, [], b"late")


async def fallback_app(
    scope: MutableMapping[str, Any], receive: Any, send: Any
) -> None:  # a stand-in for the FastAPI app: answers with what it received
    message = await receive()
    body = b"%s %s %s" % (scope["method"].encode(), scope["path"].encode(), message["body"])
    await send({"type": "http.response.start", "status": 404, "headers": [(b"x-asgi", b"1")]})
    await send({"type": "http.response.body", "body": body[:3], "more_body": True})
    await send({"type": "http.response.body", "body": body[3:]})


@contextlib.asynccontextmanager
async def front(handlers: Handlers, max_body_bytes: int = 1024) -> AsyncIterator[FrontServer]:
    server = FrontServer(
        {b"/echo": handlers.echo, b"/stream": handlers.stream, b"/slow": handlers.slow},
        fallback_app,
        max_body_bytes,
    )
    await server.start("127.0.0.1", 0)
    try:
        yield server
    finally:
        server.force_exit = True
        await server.stop()


async def connect(server: FrontServer) -> Connection:
    assert server.sockname is not None
    return await asyncio.open_connection(*server.sockname)


async def test_framing_keepalive_pipelining_and_fallback() -> None:
    handlers = Handlers()
    async with front(handlers) as server:
        reader, writer = await connect(server)
        # Three pipelined requests in one write: answered in order on one connection.
        writer.write(
            post(b"/echo?a=1", b"one")
            + post(b"/stream", b"")
            + b"GET /v1/models HTTP/1.1\r\nhost: x\r\n\r\n"
        )
        status, headers, body = await read_response(reader)
        assert (status, body) == (b"HTTP/1.1 200 OK", b"one")
        assert headers[b"x-method"] == b"POST" and headers[b"x-query"] == b"a=1"
        assert b"date" in headers and b"connection" not in headers
        status, headers, body = await read_response(reader)
        assert body == b"data: 1\n\ndata: 2\n\n"
        assert headers[b"content-type"] == b"text/event-stream"
        status, headers, body = await read_response(reader)
        assert (status, body) == (b"HTTP/1.1 404 Not Found", b"GET /v1/models ")
        assert headers[b"x-asgi"] == b"1"
        # A body over the limit reaches the handler as too_large, and the connection stays usable.
        writer.write(post(b"/echo", b"x" * 2000) + post(b"/echo", b"after"))
        assert (await read_response(reader))[2] == b"too large"
        assert (await read_response(reader))[2] == b"after"
        # Expect: 100-continue is answered before the body is sent.
        writer.write(
            post(b"/echo", b"", b"expect: 100-continue").replace(b"length: 0", b"length: 4")
        )
        continued = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
        assert continued == b"HTTP/1.1 100 Continue\r\n\r\n"
        writer.write(b"body")
        assert (await read_response(reader))[2] == b"body"
        # Connection: close is honoured after the response.
        writer.write(post(b"/echo", b"bye", b"connection: close"))
        status, headers, body = await read_response(reader)
        assert headers[b"connection"] == b"close" and body == b"bye"
        assert await closed(reader)
        writer.close()
        # HTTP/1.0 without keep-alive closes too; a malformed request gets 400 and a close.
        reader, writer = await connect(server)
        writer.write(b"POST /echo HTTP/1.0\r\ncontent-length: 2\r\n\r\nhi")
        assert (await read_response(reader))[2] == b"hi"
        assert await closed(reader)
        writer.close()
        for bad in (
            b"BREW /echo HTCPCP/1.0\r\n\r\n",
            b"GET /echo HTTP/1.1\r\n" + b"x-big: %s\r\n" % (b"y" * 1000) * 70,  # head too large
        ):
            reader, writer = await connect(server)
            writer.write(bad)
            status, headers, body = await read_response(reader)
            assert status == b"HTTP/1.1 400 Bad Request" and b'"error"' in body
            assert await closed(reader)
            writer.close()


async def test_client_disconnect_cancels_the_handler_with_gone_set() -> None:
    handlers = Handlers()
    async with front(handlers) as server:
        _, writer = await connect(server)
        writer.write(post(b"/slow", b"{}"))
        await handlers.entered.wait()
        writer.close()
        for _ in range(200):
            if handlers.gone:
                break
            await asyncio.sleep(0.01)
        assert handlers.gone == [True]


async def test_stop_lets_the_request_in_flight_finish_and_refuses_new_ones() -> None:
    handlers = Handlers()
    async with front(handlers) as server:
        busy_reader, busy_writer = await connect(server)
        idle_reader, idle_writer = await connect(server)
        busy_writer.write(post(b"/slow", b"{}"))
        await handlers.entered.wait()
        stopping = asyncio.create_task(server.stop())
        assert await closed(idle_reader)  # the idle keep-alive connection is closed
        assert not stopping.done()
        handlers.release.set()
        assert (await read_response(busy_reader))[2] == b"late"
        assert handlers.gone == []
        assert await closed(busy_reader)
        await asyncio.wait_for(stopping, 10)
        assert server.sockname is not None
        try:
            await asyncio.open_connection(*server.sockname)
        except OSError:
            pass
        else:
            raise AssertionError("the stopped server still accepts connections")
        busy_writer.close()
        idle_writer.close()
