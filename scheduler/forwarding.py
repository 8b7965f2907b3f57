"""Forwarding requests to instances: a lean pooled HTTP/1.1 client for the proxy's hot path.

Contract:
- One `UpstreamPool` per proxy holds keep-alive connections per instance origin (``http://host:port``);
  a connection goes back to its pool only after its response was read to the end, so a connection is
  never shared by two requests. Idle connections per origin are bounded.
- `UpstreamPool.send(...)` writes one request and returns an `UpstreamResponse` once the status line and
  headers arrived. A body with ``Content-Length`` (the non-streamed case) is read before returning, so
  the caller relays it in one write; a chunked body (SSE) is exposed as `iter_body()`, which yields each
  chunk's payload as it arrives, unchanged (the caller re-frames it; bytes are relayed exactly).
- Errors before any response byte arrived raise `UpstreamConnectError` (connection refused or reset,
  connect timeout) or `UpstreamTimeout` (no response head in time): the caller may retry them elsewhere.
  A reused keep-alive connection that the instance had already closed is retried once on a fresh
  connection inside `send`, since the request never reached the instance's application.
- Timeouts: ``connect_timeout`` for the TCP connect; ``head_timeout`` until the response head and,
  for a Content-Length body, the whole body arrived (queueing, prefill and decode of a non-streamed
  request: the per-request timeout there); ``read_timeout`` between body chunks of a stream.
  `UpstreamResponse.read_timeout` may be changed between chunks (the proxy's first-byte and
  inter-chunk deadlines). Time the proxy's own event loop was late (`scheduler.loop_lag`,
  given as `lag`) is added to every deadline: a connect, head or chunk wait that expires while the
  loop owes time is extended by what it owes.
- `UpstreamResponse.close()` on an unfinished response closes its connection: the instance sees the
  client go away and aborts the request (frees its KV blocks).
- `UpstreamPool.abort(url)` fails every request in flight to `url` at once (an instance ejected
  or removed): waits for a head raise `UpstreamConnectError` (retried elsewhere), streams raise
  `UpstreamError` (continued elsewhere), and the connections are dropped without waiting on the
  instance.

Why not httpx: on this project's 2-core reference machine one pooled ``httpx.AsyncClient`` request to
a trivial server costs about 600 µs of CPU and plain ``httpcore`` about 400 µs, against about 60 µs for
asyncio streams; the proxy's budget is 1 ms added latency and 1,000 requests/s on 2 cores, so the hot
path speaks HTTP/1.1 itself. Each connection is an asyncio protocol that parses the response as it
arrives (no stream reader layer, one timer per wait instead of a timeout context), so a small
response wakes the waiting request once. Load polling (`scheduler.load_poller`) uses a pool of its
own; the rarer control-plane traffic (health probes, admin calls) still uses httpx.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import AsyncIterator, Iterable
from typing import TYPE_CHECKING, cast
from urllib.parse import urlsplit

if TYPE_CHECKING:
    from scheduler.loop_lag import LoopLag

# Response headers that describe the hop, not the payload: never relayed.
HOP_BY_HOP = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"proxy-authenticate",
        b"proxy-authorization",
        b"te",
        b"trailer",
        b"transfer-encoding",
        b"upgrade",
        b"content-length",
        b"date",
        b"server",
    }
)
_MAX_HEAD_BYTES = 64 * 1024
_NO_BODY_STATUS = frozenset({204, 304})


def _line_end(buffer: bytearray, terminator: bytes, what: str) -> int:
    """Where `terminator` starts in `buffer`, or -1 while it may still arrive; a `what` longer
    than `_MAX_HEAD_BYTES` is refused (an upstream cannot make the proxy buffer without bound)."""
    end = buffer.find(terminator)
    if end < 0 and len(buffer) > _MAX_HEAD_BYTES:
        raise ValueError(f"{what} too long")
    return end


class UpstreamError(Exception):
    """The instance could not be reached or did not answer in time."""


class UpstreamConnectError(UpstreamError):
    """No response byte arrived: connect failed, or the connection broke before the response head."""


class UpstreamTimeout(UpstreamError):
    """A connect, response-head or between-chunks deadline passed."""


class UpstreamConnectTimeout(UpstreamConnectError):
    """The TCP connect did not complete in time (under a saturated proxy, no fault of the instance)."""


def parse_origin(url: str) -> tuple[str, int, bytes]:
    """(host, port, base path) of an ``http://host:port[/base]`` instance URL."""
    parts = urlsplit(url)
    if parts.scheme != "http" or not parts.hostname:
        raise ValueError(f"instance URL must be http://host:port, got {url!r}")
    port = parts.port or 80
    return parts.hostname, port, parts.path.rstrip("/").encode()


# Response parsing states of a connection.
_IDLE, _HEAD, _BODY, _CHUNK_SIZE, _CHUNK_DATA, _TRAILERS, _UNTIL_CLOSE, _DONE = range(8)
# Stop reading a stream while this many bytes wait for the client to take them.
_MAX_QUEUED = 256 * 1024


def _expire(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_exception(TimeoutError())


class _Connection(asyncio.Protocol):
    """One keep-alive connection to an instance. The response to the request in flight is parsed
    as its bytes arrive, so a whole small response wakes the waiting request once."""

    def __init__(self, origin: str) -> None:
        self.origin = origin
        self.transport: asyncio.Transport | None = None
        self.reused = False
        self.closed = False
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        self.body: bytes | None = None
        self.keep_alive = False
        self._loop = asyncio.get_running_loop()
        self._state = _IDLE
        self._buffer = bytearray()
        self._length = 0  # of the Content-Length body, or of the chunk being read
        self._head_waiter: asyncio.Future[None] | None = None
        self._chunks: deque[bytes] = deque()
        self._queued = 0
        self._chunk_waiter: asyncio.Future[None] | None = None
        self._error: UpstreamError | None = None
        self._paused = False
        self.busy: set[_Connection] | None = None  # its pool's in-flight set while it serves one

    # -- asyncio.Protocol ---------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is no subclass

    def data_received(self, data: bytes) -> None:
        if self._state == _IDLE:  # bytes nobody asked for: this connection is not reusable
            self.close()
            return
        if self._state == _DONE:
            self.keep_alive = False
            return
        self._buffer += data
        try:
            self._parse()
        except ValueError as exc:
            if self._state in (_HEAD, _BODY):
                self._fail(UpstreamConnectError(f"{self.origin}: malformed response: {exc}"))
            else:
                self._fail(UpstreamError(f"{self.origin}: stream broke: {exc}"))

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        state = self._state
        if state in (_HEAD, _BODY):
            self._fail(
                UpstreamConnectError(f"{self.origin}: connection broke before the response: {exc}")
            )
        elif state == _UNTIL_CLOSE:  # the end of a body framed by the connection's end
            self._state = _DONE
            self._wake()
        elif state in (_CHUNK_SIZE, _CHUNK_DATA, _TRAILERS):
            self._fail(UpstreamError(f"{self.origin}: stream broke: connection closed ({exc})"))

    # -- parsing ------------------------------------------------------------------------------
    def _parse(self) -> None:
        buffer = self._buffer
        while True:
            state = self._state
            if state == _HEAD:
                end = _line_end(buffer, b"\r\n\r\n", "response head")
                if end < 0:
                    return
                head = bytes(buffer[: end + 4])
                del buffer[: end + 4]
                self.status, self.headers, length, chunked, self.keep_alive = _parse_head(head)
                if chunked:
                    self._state = _CHUNK_SIZE
                    self._resolve_head()
                elif length >= 0:
                    self._state = _BODY
                    self._length = length
                else:
                    self._state = _UNTIL_CLOSE
                    self.keep_alive = False
                    self._resolve_head()
            elif state == _BODY:
                if len(buffer) < self._length:
                    return
                self.body = bytes(buffer[: self._length])
                del buffer[: self._length]
                self._state = _DONE
                self._resolve_head()
            elif state == _CHUNK_SIZE:
                end = _line_end(buffer, b"\r\n", "chunk size line")
                if end < 0:
                    return
                size = int(bytes(buffer[:end]).split(b";", 1)[0], 16)
                del buffer[: end + 2]
                if size:
                    self._length = size
                    self._state = _CHUNK_DATA
                else:
                    self._state = _TRAILERS
            elif state == _CHUNK_DATA:
                if len(buffer) < self._length + 2:
                    return
                self._push(bytes(buffer[: self._length]))
                del buffer[: self._length + 2]
                self._state = _CHUNK_SIZE
            elif state == _TRAILERS:
                end = _line_end(buffer, b"\r\n", "trailer line")
                if end < 0:
                    return
                del buffer[: end + 2]
                if end == 0:  # the empty line after the trailers (dropped): the body is complete
                    self._state = _DONE
                    self._wake()
            elif state == _UNTIL_CLOSE:
                if buffer:
                    self._push(bytes(buffer))
                    buffer.clear()
                return
            else:  # _DONE: bytes past the response's end
                if buffer:
                    self.keep_alive = False
                return

    def _resolve_head(self) -> None:
        waiter = self._head_waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _push(self, chunk: bytes) -> None:
        self._chunks.append(chunk)
        self._queued += len(chunk)
        if self._queued > _MAX_QUEUED and not self._paused and self.transport is not None:
            self._paused = True
            self.transport.pause_reading()
        self._wake()

    def _wake(self) -> None:
        waiter = self._chunk_waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _fail(self, error: UpstreamError) -> None:
        self.keep_alive = False
        waiter = self._head_waiter
        if waiter is not None and not waiter.done():
            waiter.set_exception(error)
        else:
            self._error = error
            self._wake()
        self.close()

    # -- the request side ---------------------------------------------------------------------
    def usable(self) -> bool:
        transport = self.transport
        return not self.closed and transport is not None and not transport.is_closing()

    async def exchange(self, payload: bytes, timeout: float) -> None:
        """Send one request; return once its head (and a Content-Length body) arrived."""
        assert self.transport is not None
        self._state = _HEAD
        self.body = None
        self._error = None
        self._chunks.clear()
        self._queued = 0
        waiter = self._head_waiter = self._loop.create_future()
        self.transport.write(payload)
        timer = self._loop.call_later(timeout, _expire, waiter)
        try:
            await waiter
        finally:
            timer.cancel()
            self._head_waiter = None

    async def next_chunk(self, timeout: float) -> bytes | None:
        """The next body chunk of a streamed response; None once it is complete."""
        while True:
            if self._chunks:
                chunk = self._chunks.popleft()
                self._queued -= len(chunk)
                if self._paused and self._queued <= _MAX_QUEUED // 2 and self.transport:
                    self._paused = False
                    self.transport.resume_reading()
                return chunk
            if self._error is not None:
                raise self._error
            if self._state == _DONE:
                return None
            await self._wait_chunk(timeout)

    async def wait_data(self, timeout: float) -> None:
        """Wait up to `timeout` for `pending()` (TimeoutError if it stays false)."""
        if not self.pending():
            await self._wait_chunk(timeout)

    async def _wait_chunk(self, timeout: float) -> None:
        """Until the next chunk, error or end arrives (TimeoutError after `timeout`)."""
        waiter = self._chunk_waiter = self._loop.create_future()
        timer = self._loop.call_later(timeout, _expire, waiter)
        try:
            await waiter
        finally:
            timer.cancel()
            self._chunk_waiter = None

    def complete(self) -> bool:
        """The response was read to its end and the connection may carry another request."""
        return self._state == _DONE and self.keep_alive and not self._buffer

    def pending(self) -> bool:
        """Data or an error is waiting to be taken (it may arrive in the loop turn a timer fired)."""
        return bool(self._chunks) or self._error is not None or self._state == _DONE

    def reset(self) -> None:
        self._state = _IDLE
        self._done_serving()

    def _done_serving(self) -> None:
        busy, self.busy = self.busy, None
        if busy is not None:
            busy.discard(self)

    def close(self) -> None:
        self.closed = True
        self._done_serving()
        if self.transport is not None:
            self.transport.close()

    def abort(self, reason: str) -> None:
        """Fail the request in flight now and drop the connection (see `UpstreamPool.abort`)."""
        state = self._state
        if state in (_HEAD, _BODY):
            self._fail(UpstreamConnectError(f"{self.origin}: {reason}"))
        elif state in (_CHUNK_SIZE, _CHUNK_DATA, _TRAILERS, _UNTIL_CLOSE):
            self._fail(UpstreamError(f"{self.origin}: {reason}"))
        self.close()
        if self.transport is not None:
            self.transport.abort()


class UpstreamResponse:
    """Status, headers and body of one instance response (see the module contract)."""

    __slots__ = ("_conn", "_origin", "_pool", "body", "headers", "read_timeout", "status")

    def __init__(
        self,
        status: int,
        headers: list[tuple[bytes, bytes]],
        body: bytes | None,
        conn: _Connection | None,
        pool: UpstreamPool,
        origin: str,
        read_timeout: float,
    ) -> None:
        self.status = status
        self.headers = headers  # lower-cased names, hop-by-hop ones removed
        self.body = body  # full body when it was framed by Content-Length; else None
        self._conn = conn
        self._pool = pool
        self._origin = origin
        self.read_timeout = read_timeout

    @property
    def streaming(self) -> bool:
        return self.body is None

    def header(self, name: bytes) -> bytes | None:
        for key, value in self.headers:
            if key == name:
                return value
        return None

    async def iter_body(self) -> AsyncIterator[bytes]:
        """Payload chunks as they arrive (chunked or read-until-close bodies)."""
        conn = self._conn
        if conn is None:
            if self.body:
                yield self.body
            return
        lag = self._pool.lag
        while True:
            timeout = self.read_timeout
            since = time.monotonic()
            try:
                chunk = await conn.next_chunk(timeout)
            except TimeoutError as exc:
                owed = 0.0 if lag is None else lag.owed(since)
                while not conn.pending() and owed > 0.01:  # the proxy's lag, not the instance's
                    since = time.monotonic()
                    with contextlib.suppress(TimeoutError):
                        await conn.wait_data(owed)
                    owed = lag.owed(since) if lag is not None else 0.0
                if conn.pending():
                    continue
                self.close()
                raise UpstreamTimeout(f"{self._origin}: no stream data for {timeout:.3g}s") from exc
            except UpstreamError:
                self.close()
                raise
            except BaseException:
                self.close()
                raise
            if chunk is None:
                break
            yield chunk
        self._conn = None
        self._pool.release(self._origin, conn)

    def close(self) -> None:
        """Abandon the response: an unfinished body closes the connection (the instance aborts)."""
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.close()

    def cut(self, reason: str) -> None:
        """Break the body now: a read in flight raises `UpstreamError` (`reason`), and the
        connection closes (the instance aborts the request)."""
        conn = self._conn
        if conn is not None:
            conn.abort(reason)


class UpstreamPool:
    """Keep-alive HTTP/1.1 connections to every instance origin."""

    def __init__(
        self,
        connect_timeout: float = 2.0,
        head_timeout: float = 600.0,
        read_timeout: float = 300.0,
        max_idle_per_origin: int = 512,
        lag: LoopLag | None = None,
    ) -> None:
        self.lag = lag
        self._busy: dict[str, set[_Connection]] = {}
        self.connect_timeout = connect_timeout
        self.head_timeout = head_timeout
        self.read_timeout = read_timeout
        self.max_idle_per_origin = max_idle_per_origin
        self._idle: dict[str, deque[_Connection]] = {}
        self._origins: dict[str, tuple[str, int, bytes, bytes]] = {}

    def _origin(self, url: str) -> tuple[str, int, bytes, bytes]:
        origin = self._origins.get(url)
        if origin is None:
            host, port, base = parse_origin(url)
            origin = (host, port, base, f"{host}:{port}".encode())
            self._origins[url] = origin
        return origin

    async def _connect(self, url: str, host: str, port: int) -> _Connection:
        loop = asyncio.get_running_loop()
        timeout = self.connect_timeout
        for _ in range(4):
            since = time.monotonic()
            try:
                async with asyncio.timeout(timeout):
                    _, conn = await loop.create_connection(lambda: _Connection(url), host, port)
                return conn
            except TimeoutError as exc:
                owed = 0.0 if self.lag is None else self.lag.owed(since)
                if owed <= 0.01:
                    raise UpstreamConnectTimeout(f"{url}: connect timed out") from exc
                timeout = owed  # the proxy's own lag: try again for as long
            except OSError as exc:
                raise UpstreamConnectError(f"{url}: connect failed: {exc}") from exc
        raise UpstreamConnectTimeout(f"{url}: connect timed out (the proxy's loop is saturated)")

    def abort(self, url: str, reason: str) -> int:
        """Fail every request in flight to `url` now; returns how many."""
        busy = list(self._busy.pop(url, ()))
        for conn in busy:
            conn.abort(reason)
        self.forget(url)
        return len(busy)

    def release(self, url: str, conn: _Connection) -> None:
        """Keep `conn` for the next request to `url` if its response was read to the end."""
        idle = self._idle.get(url)
        if idle is None:
            idle = self._idle[url] = deque()
        if len(idle) < self.max_idle_per_origin and conn.complete() and conn.usable():
            conn.reset()
            conn.reused = True
            idle.append(conn)
        else:
            conn.close()

    def forget(self, url: str) -> None:
        """Close the idle connections of an instance that left or failed."""
        for conn in self._idle.pop(url, ()):
            conn.close()

    async def close(self) -> None:
        for url in list(self._idle):
            self.forget(url)

    async def send(
        self,
        url: str,
        method: bytes,
        path: bytes,
        headers: Iterable[tuple[bytes, bytes]],
        body: bytes,
        head_timeout: float | None = None,
    ) -> UpstreamResponse:
        """Send one request to the instance at `url`; see the module contract for errors."""
        host, port, base, host_header = self._origin(url)
        lines = [method, b" ", base, path, b" HTTP/1.1\r\nhost: ", host_header, b"\r\n"]
        for name, value in headers:
            lines += (name, b": ", value, b"\r\n")
        lines += (b"content-length: ", str(len(body)).encode(), b"\r\n\r\n", body)
        payload = b"".join(lines)
        timeout = self.head_timeout if head_timeout is None else head_timeout
        idle = self._idle.get(url)
        while True:
            conn = None
            while idle:
                candidate = idle.pop()
                if candidate.usable():
                    conn = candidate
                    break
                candidate.close()
            if conn is None:
                conn = await self._connect(url, host, port)
            busy = self._busy.get(url)
            if busy is None:
                busy = self._busy[url] = set()
            busy.add(conn)
            conn.busy = busy
            try:
                await conn.exchange(payload, timeout)
            except UpstreamConnectError:
                conn.close()
                if conn.reused:
                    continue  # the instance closed an idle keep-alive connection: not a failure
                raise
            except TimeoutError as exc:
                conn.close()
                raise UpstreamTimeout(f"{url}: no complete response within {timeout}s") from exc
            except BaseException:
                conn.close()
                raise
            if conn.body is not None:
                response = UpstreamResponse(
                    conn.status, conn.headers, conn.body, None, self, url, self.read_timeout
                )
                self.release(url, conn)
                return response
            return UpstreamResponse(
                conn.status, conn.headers, None, conn, self, url, self.read_timeout
            )


def _parse_head(head: bytes) -> tuple[int, list[tuple[bytes, bytes]], int, bool, bool]:
    """(status, relayable headers, content length or -1, chunked, keep-alive) of a response head;
    raises ValueError when it is not HTTP/1.x."""
    status_line, _, header_block = head[:-4].partition(b"\r\n")
    parts = status_line.split(b" ", 2)
    if len(parts) < 2 or not parts[0].startswith(b"HTTP/1."):
        raise ValueError(f"bad status line {status_line[:80]!r}")
    status = int(parts[1])
    headers: list[tuple[bytes, bytes]] = []
    length = -1
    chunked = False
    keep_alive = parts[0] == b"HTTP/1.1"
    for line in header_block.split(b"\r\n"):
        name, _, value = line.partition(b":")
        name = name.strip().lower()
        value = value.strip()
        if name in HOP_BY_HOP:
            if name == b"content-length":
                length = int(value)
            elif name == b"transfer-encoding":
                chunked = b"chunked" in value.lower()
            elif name == b"connection":
                lowered = value.lower()
                keep_alive = (keep_alive or lowered == b"keep-alive") and lowered != b"close"
            continue
        headers.append((name, value))
    if status in _NO_BODY_STATUS:
        length = 0
    return status, headers, length, chunked, keep_alive
