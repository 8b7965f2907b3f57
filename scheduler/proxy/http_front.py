"""The proxy's client-facing HTTP/1.1 server: httptools parsing in an asyncio protocol.

Contract:
- `FrontServer(routes, fallback_app, ...)` listens on one address. A request whose path is in
  `routes` goes, once its whole body has arrived, to that route's handler as an `Exchange` (one
  task per request; the handler checks the method); every other request goes to `fallback_app`,
  an ASGI app (FastAPI: models, health, metrics, 404), which gets the whole body in one
  ``http.request`` message and whose response is buffered and written in one piece (it serves
  small control responses only).
- `Exchange` answers exactly once: `respond` (status line, headers and body in one socket write,
  framed by Content-Length) or `start_stream` + `write_chunk`* + `end_stream` (chunked; each chunk's
  bytes relayed unchanged; `write_chunk` waits while the client reads slower than the stream comes).
  Every response carries ``date``; handlers pass the rest of the headers (lower-cased names).
- Keep-alive per HTTP/1.1 (``connection: close`` and HTTP/1.0 without keep-alive close after the
  response); pipelined requests are answered in order (reading pauses while one waits); idle
  connections close after `keep_alive_s`; ``Expect: 100-continue`` is answered.
- A request head (URL and headers) over about `MAX_HEAD_BYTES` gets 400 and the connection
  closes.
- At most `max_connections` client connections are held: one more is answered at once with 429
  (``Retry-After: 1``, the OpenAI error object, ``code: too_many_connections``) and closed, so
  idle or slow clients cannot take every descriptor the process has (its admin API and
  upstream connections need some too).
  `refused_connections` counts them.
- `door`, when given, sees each POST head to a route while nothing else is pending on its
  connection; a 429 it returns is written at once and the body is dropped as it arrives (the
  connection stays open per keep-alive; after ``Expect: 100-continue`` it closes).
- A body over `max_body_bytes` is not buffered: the handler sees `Exchange.too_large` set and an
  empty body. Unparsable requests get 400 and the connection closes.
- A client that disconnects before its response completed cancels the request's task with
  `Exchange.gone` set, so the handler can tell it from a server shutdown and close its upstream
  request (the instance aborts it and frees its KV blocks).
- `stop()`: stop accepting, close idle connections, let in-flight requests finish (all of them
  are cancelled at once when `force_exit` is or becomes set), then close every connection.

Why not uvicorn: on the proxy's hot path uvicorn's ASGI cycle (scope and message dicts, a receive
and a send await per message, a separate socket write for the head and the body, so the client
wakes twice) cost about as much CPU as the proxy's own routing; the admin API keeps uvicorn.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable, Coroutine, MutableMapping
from email.utils import formatdate
from http import HTTPStatus
from typing import Any, cast
from urllib.parse import unquote

import httptools

log = logging.getLogger("kvherd.http")

Handler = Callable[["Exchange"], Coroutine[Any, Any, None]]
# The door (`scheduler.proxy.door_gate`): a route's request head in, None or a 429's headers and body.
DoorCheck = Callable[[list[tuple[bytes, bytes]]], tuple[list[tuple[bytes, bytes]], bytes] | None]
ASGIApp = Callable[
    [
        MutableMapping[str, Any],
        Callable[[], Awaitable[MutableMapping[str, Any]]],
        Callable[[MutableMapping[str, Any]], Awaitable[None]],
    ],
    Awaitable[None],
]

_STATUS_LINES = {
    int(s): b"HTTP/1.1 %d %s\r\n" % (int(s), s.phrase.encode("latin-1")) for s in HTTPStatus
}
_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
_BAD_REQUEST_BODY = (
    b'{"error":{"message":"malformed HTTP request","type":"invalid_request_error",'
    b'"param":null,"code":"bad_http"}}'
)
_BAD_REQUEST = (
    b"HTTP/1.1 400 Bad Request\r\ncontent-type: application/json\r\nconnection: close\r\n"
    b"content-length: %d\r\n\r\n%s" % (len(_BAD_REQUEST_BODY), _BAD_REQUEST_BODY)
)
_OVERLOADED_BODY = (
    b'{"error":{"message":"too many open connections","type":"rate_limit_error",'
    b'"param":null,"code":"too_many_connections"}}'
)
_OVERLOADED = (
    b"HTTP/1.1 429 Too Many Requests\r\ncontent-type: application/json\r\nretry-after: 1\r\n"
    b"connection: close\r\ncontent-length: %d\r\n\r\n%s" % (len(_OVERLOADED_BODY), _OVERLOADED_BODY)
)
_INTERNAL_ERROR = (
    b'{"error":{"message":"internal proxy error","type":"server_error","param":null,"code":null}}'
)
MAX_HEAD_BYTES = 64 * 1024
# Pause reading a client whose unanswered pipelined requests pile up past this many.
_MAX_PIPELINED = 16
_WRITE_HIGH_WATER = 256 * 1024


def _status_line(status: int) -> bytes:
    line = _STATUS_LINES.get(status)
    return line if line is not None else b"HTTP/1.1 %d Unknown\r\n" % status


class _DateHeader:
    """The ``date`` header line, formatted at most once a second (it is on every response)."""

    __slots__ = ("_line", "_second")

    def __init__(self) -> None:
        self._second = -1
        self._line = b""

    def line(self) -> bytes:
        now = int(time.time())
        if now != self._second:
            self._second = now
            self._line = b"date: %s\r\n" % formatdate(now, usegmt=True).encode()
        return self._line


_DATE = _DateHeader()


class Exchange:
    """One request on a client connection and the means to answer it (see the module contract)."""

    __slots__ = (
        "_conn",
        "_finished",
        "_started",
        "body",
        "gone",
        "headers",
        "keep_alive",
        "method",
        "path",
        "query",
        "too_large",
    )

    def __init__(
        self, conn: _FrontProtocol, method: bytes, path: bytes, query: bytes, keep_alive: bool
    ) -> None:
        self._conn = conn
        self.method = method
        self.path = path  # raw, not percent-decoded
        self.query = query
        self.headers: list[tuple[bytes, bytes]] = []
        self.body = b""
        self.too_large = False
        self.keep_alive = keep_alive
        self.gone = False  # the client disconnected before the response completed
        self._started = False
        self._finished = False

    @property
    def started(self) -> bool:
        return self._started

    def _head(self, status: int, headers: list[tuple[bytes, bytes]], framing: bytes) -> list[bytes]:
        parts = [_status_line(status), _DATE.line()]
        for name, value in headers:
            parts += (name, b": ", value, b"\r\n")
        if not self.keep_alive:
            parts.append(b"connection: close\r\n")
        parts.append(framing)
        return parts

    def respond(self, status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> None:
        """The whole response in one write."""
        if self._started:
            raise RuntimeError("response already started")
        self._started = True
        parts = self._head(status, headers, b"content-length: %d\r\n\r\n" % len(body))
        if self.method != b"HEAD":
            parts.append(body)
        self._conn.write(b"".join(parts))
        self._finish()

    def start_stream(self, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        if self._started:
            raise RuntimeError("response already started")
        self._started = True
        self._conn.write(
            b"".join(self._head(status, headers, b"transfer-encoding: chunked\r\n\r\n"))
        )

    async def write_chunk(self, data: bytes) -> None:
        if data:
            self._conn.write(b"%x\r\n%s\r\n" % (len(data), data))
            await self._conn.drain()

    def end_stream(self) -> None:
        self._conn.write(b"0\r\n\r\n")
        self._finish()

    def _finish(self) -> None:
        self._finished = True
        self._conn.response_done(self)


class _FrontProtocol(asyncio.Protocol):
    """One client connection: parse requests, run one at a time, write their responses."""

    def __init__(self, server: FrontServer) -> None:
        self._server = server
        self._loop = asyncio.get_running_loop()
        self._parser = httptools.HttpRequestParser(self)
        self._transport: asyncio.Transport | None = None
        self._url = b""
        self._head_size = 0
        self._in_head = False
        self._current: Exchange | None = None  # being parsed
        self._body: list[bytes] = []
        self._body_size = 0
        self._expect_continue = False
        self._queue: deque[Exchange] = deque()  # parsed, waiting for the one in flight
        self._active: Exchange | None = None  # in flight
        self._task: asyncio.Task[None] | None = None
        self._paused_reading = False
        self._write_paused: asyncio.Future[None] | None = None
        self._closed = False
        self._bad_request = False  # answer the request in flight, then 400 and close
        self._shed = False  # the request being read was answered at the door: drop its body
        self.idle_since = time.monotonic()

    # -- asyncio.Protocol ---------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)  # uvloop's is no subclass
        server = self._server
        if len(server.connections) >= server.max_connections:
            server.refused_connections += 1
            self._transport.write(_OVERLOADED)
            self.close()
            return
        self._transport.set_write_buffer_limits(high=_WRITE_HIGH_WATER)
        server.connections.add(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self._closed = True
        self._server.connections.discard(self)
        self._queue.clear()
        if self._write_paused is not None and not self._write_paused.done():
            self._write_paused.set_result(None)
        active, task = self._active, self._task
        if active is not None and task is not None and not task.done():
            active.gone = True
            task.cancel()

    def data_received(self, data: bytes) -> None:
        was_in_head = self._in_head
        try:
            self._parser.feed_data(data)
            if was_in_head and self._in_head:
                # All of it is head: httptools reports a header only once the next one starts.
                self._count_head(len(data))
        except (httptools.HttpParserError, httptools.HttpParserUpgrade, ValueError):
            # An upgrade (websocket, h2c) is no more supported than a malformed request.
            self._queue.clear()
            if self._active is None:
                self.write(_BAD_REQUEST)
                self.close()
            else:  # answer the one in flight, then close
                self._bad_request = True

    def pause_writing(self) -> None:
        if self._write_paused is None or self._write_paused.done():
            self._write_paused = self._loop.create_future()

    def resume_writing(self) -> None:
        if self._write_paused is not None and not self._write_paused.done():
            self._write_paused.set_result(None)

    # -- httptools callbacks ------------------------------------------------------------------
    def on_message_begin(self) -> None:
        self._url = b""
        self._head_size = 0
        self._in_head = True
        self._body = []
        self._body_size = 0
        self._expect_continue = False
        self._current = None

    def on_url(self, url: bytes) -> None:
        self._url += url
        self._count_head(len(url))

    def _count_head(self, size: int) -> None:
        # httptools itself bounds nothing: an endless head would grow without limit.
        self._head_size += size
        if self._head_size > MAX_HEAD_BYTES:
            raise ValueError("request head too large")

    def on_header(self, name: bytes, value: bytes) -> None:
        self._count_head(len(name) + len(value))
        if self._current is None:
            self._current = self._new_exchange()
        name = name.lower()
        if name == b"expect" and value.lower() == b"100-continue":
            self._expect_continue = True
        self._current.headers.append((name, value))

    def _new_exchange(self) -> Exchange:
        url = httptools.parse_url(self._url)
        return Exchange(self, self._parser.get_method(), url.path, url.query or b"", True)

    def on_headers_complete(self) -> None:
        self._in_head = False
        if self._current is None:  # a request without headers
            self._current = self._new_exchange()
        exchange = self._current
        exchange.keep_alive = self._parser.should_keep_alive() and self._server.accepting
        server = self._server
        if (
            server.door is not None
            and self._active is None
            and not self._queue
            and exchange.method == b"POST"
            and exchange.path in server.routes
        ):
            answer = server.door(exchange.headers)
            if answer is not None:
                # Refused from the head, in this callback: no task, no body kept, no parse.
                self._shed = True
                if self._expect_continue:  # its body will not come: close once answered
                    exchange.keep_alive = False
                exchange.respond(429, *answer)
                if self._expect_continue:
                    self.close()
                return
        if self._expect_continue and self._active is None and not self._queue:
            self.write(_CONTINUE)

    def on_body(self, body: bytes) -> None:
        if self._shed:
            return
        self._body_size += len(body)
        if self._body_size <= self._server.max_body_bytes:
            self._body.append(body)
        elif self._body:
            self._body = []  # over the limit: drop what was kept, count the rest

    def on_message_complete(self) -> None:
        exchange = self._current
        if exchange is None:
            return
        self._current = None
        if self._shed:
            self._shed = False
            self.idle_since = time.monotonic()
            if not exchange.keep_alive or not self._server.accepting:
                self.close()
            return
        if self._body_size > self._server.max_body_bytes:
            exchange.too_large = True
        elif self._body:
            exchange.body = self._body[0] if len(self._body) == 1 else b"".join(self._body)
        self._body = []
        if self._active is None:
            self._run(exchange)
        else:
            self._queue.append(exchange)
            if len(self._queue) >= _MAX_PIPELINED and not self._paused_reading:
                self._paused_reading = True
                assert self._transport is not None
                self._transport.pause_reading()

    # -- request lifecycle --------------------------------------------------------------------
    def _run(self, exchange: Exchange) -> None:
        self._active = exchange
        handler = self._server.routes.get(exchange.path)
        coro = self._server.fallback(exchange) if handler is None else handler(exchange)
        task = self._loop.create_task(coro)
        self._task = task
        task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Task[None]) -> None:
        exchange = self._active
        if exchange is None or task is not self._task:
            return
        if not task.cancelled() and task.exception() is not None:
            log.error("request handler failed", exc_info=task.exception())
        if not exchange._finished:
            # The handler ended without completing its response (a bug, or cancelled): the
            # client cannot tell where the response ends, so the connection must go.
            if not exchange.started and not self._closed:
                exchange.keep_alive = False
                exchange.respond(500, [(b"content-type", b"application/json")], _INTERNAL_ERROR)
            else:
                self.close()

    def response_done(self, exchange: Exchange) -> None:
        """`exchange`'s response is written: close, or go on with the next request."""
        if exchange is not self._active:
            return
        self._active = None
        self._task = None
        self.idle_since = time.monotonic()
        if self._bad_request:
            self.write(_BAD_REQUEST)
            self.close()
        elif not exchange.keep_alive or not self._server.accepting:
            self.close()
        elif self._queue:
            self._run(self._queue.popleft())
            if self._paused_reading and len(self._queue) < _MAX_PIPELINED:
                self._paused_reading = False
                assert self._transport is not None
                self._transport.resume_reading()

    @property
    def idle(self) -> bool:
        return self._active is None and not self._queue

    def write(self, data: bytes) -> None:
        if not self._closed and self._transport is not None:
            self._transport.write(data)

    async def drain(self) -> None:
        paused = self._write_paused
        if paused is not None and not paused.done():
            await paused

    def close(self) -> None:
        if not self._closed and self._transport is not None:
            self._closed = True
            self._transport.close()

    def cancel(self) -> None:
        """Server shutdown without waiting: end the request in flight and the connection."""
        if self._task is not None and not self._task.done():
            self._task.cancel()
        self.close()


class FrontServer:
    """Listens and owns the client connections; see the module contract."""

    def __init__(
        self,
        routes: dict[bytes, Handler],
        fallback_app: ASGIApp,
        max_body_bytes: int,
        keep_alive_s: float = 30.0,
        max_connections: int = 4096,
        door: DoorCheck | None = None,
    ) -> None:
        if max_connections < 1:
            raise ValueError("max_connections must be >= 1")
        self.routes = routes
        self.fallback_app = fallback_app
        self.max_body_bytes = max_body_bytes
        self.keep_alive_s = keep_alive_s
        self.max_connections = max_connections
        self.door = door
        self.refused_connections = 0
        self.connections: set[_FrontProtocol] = set()
        self.accepting = True
        self.force_exit = False
        self.started = False
        self._server: asyncio.AbstractServer | None = None
        self._reaper: asyncio.Task[None] | None = None
        self.sockname: tuple[str, int] | None = None

    async def start(self, host: str, port: int, backlog: int = 4096) -> None:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            lambda: _FrontProtocol(self), host, port, backlog=backlog, reuse_address=True
        )
        self.sockname = self._server.sockets[0].getsockname()[:2]
        self._reaper = loop.create_task(self._reap_idle())
        self.started = True

    async def _reap_idle(self) -> None:
        """Close keep-alive connections idle for longer than `keep_alive_s`."""
        while True:
            await asyncio.sleep(min(self.keep_alive_s / 2, 5.0))
            cutoff = time.monotonic() - self.keep_alive_s
            for conn in [c for c in self.connections if c.idle and c.idle_since < cutoff]:
                conn.close()

    async def stop(self, poll_s: float = 0.05) -> None:
        """Stop accepting; finish (cancel, once `force_exit` is set) the requests in flight."""
        self.accepting = False
        if self._server is not None:
            self._server.close()
        if self._reaper is not None:
            self._reaper.cancel()
        for conn in list(self.connections):
            if conn.idle:
                conn.close()
        # A connection closes itself once its response in flight completes (accepting is off).
        while self.connections:
            if self.force_exit:
                for conn in list(self.connections):
                    conn.cancel()
                    self.connections.discard(conn)
                break
            await asyncio.sleep(poll_s)
        if self._server is not None:
            await self._server.wait_closed()

    # -- the ASGI fallback --------------------------------------------------------------------
    async def fallback(self, exchange: Exchange) -> None:
        """Serve `exchange` through the ASGI app, buffering its (small) response."""
        path = exchange.path.decode("latin-1")
        scope: dict[str, Any] = {
            "type": "http",
            "asgi": {"version": "3.0", "spec_version": "2.3"},
            "http_version": "1.1",
            "method": exchange.method.decode("latin-1"),
            "scheme": "http",
            "path": unquote(path) if "%" in path else path,
            "raw_path": exchange.path,
            "query_string": exchange.query,
            "root_path": "",
            "headers": exchange.headers,
            "client": None,
            "server": self.sockname,
        }
        if exchange.too_large:
            scope["headers"] = [h for h in exchange.headers if h[0] != b"content-length"]
        delivered = False
        forever: asyncio.Future[None] = asyncio.get_running_loop().create_future()

        async def receive() -> MutableMapping[str, Any]:
            nonlocal delivered
            if not delivered:
                delivered = True
                return {"type": "http.request", "body": exchange.body, "more_body": False}
            with contextlib.suppress(asyncio.CancelledError):
                await forever  # until the client goes away (the task is cancelled)
            return {"type": "http.disconnect"}

        status = 500
        headers: list[tuple[bytes, bytes]] = []
        body: list[bytes] = []

        async def send(message: MutableMapping[str, Any]) -> None:
            nonlocal status, headers
            if message["type"] == "http.response.start":
                status = message["status"]
                headers = [
                    (bytes(k).lower(), bytes(v))
                    for k, v in message.get("headers", [])
                    if bytes(k).lower() not in (b"content-length", b"transfer-encoding")
                ]
            elif message["type"] == "http.response.body":
                body.append(message.get("body", b""))
                if not message.get("more_body", False):
                    exchange.respond(status, headers, b"".join(body))

        await self.fallback_app(scope, receive, send)
