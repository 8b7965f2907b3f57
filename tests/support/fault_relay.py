"""Test helper: a TCP relay in front of an agent that fires a fault at one HTTP control message.

Usage::

    with FaultRelay(agent.url) as relay:           # relay.url is the agent's front door
        relay.arm(Fault("/kvherd/v1/migration/commit", "before", lambda: os.kill(pid, SIGKILL)))
        ...                                          # the proxy and the agents use relay.url
        relay.fired.wait(60)                         # the fault ran

Contract:
- Bytes pass through unchanged both ways (streams, keep-alive, any route); the relay runs its own
  event loop in a daemon thread, so sync and async tests and the chaos bench all use it alike.
- Requests from the client side are read as HTTP/1.1 (head, ``content-length`` body). The one
  armed `Fault` fires at the first request whose path ends with `path` and whose JSON body passes
  `match`: ``"before"`` runs the action before the request is forwarded, ``"after"`` once the
  upstream's whole answer (head and ``content-length`` body; the head of a streamed one) was
  relayed back (the peer is then acting on it: a reservation made, a commit accepted),
  ``"event"`` once the answer's `events`-th server-sent event was relayed, after which every later
  byte of that answer is dropped (a cut at a chosen token, not at a time). It fires once; `fired`
  is set after the action ran; `disarm` takes back a fault that has not fired.
- When either side closes, both are closed: a request to an upstream killed by a fault fails at
  the client as a dead peer would.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal


@dataclass
class Fault:
    path: str
    when: Literal["before", "after", "event"]
    action: Callable[[], None]
    match: Callable[[Any], bool] = lambda body: True
    events: int = 0  # with "event": the server-sent events relayed before the action


class FaultRelay:
    def __init__(self, upstream: str) -> None:
        host, port = upstream.removeprefix("http://").rstrip("/").split(":")
        self._upstream = (host, int(port))
        self._fault: Fault | None = None
        self.fired = threading.Event()
        self.seen: list[str] = []  # the paths of every request relayed, in order
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        self._server = asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(30)
        self.port = int(self._server.sockets[0].getsockname()[1])
        self.url = f"http://127.0.0.1:{self.port}"

    def arm(self, fault: Fault) -> None:
        self.fired.clear()
        self._fault = fault

    def disarm(self) -> None:
        self._fault = None

    def close(self) -> None:
        async def stop() -> None:
            self._server.close()
            for task in [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]:
                task.cancel()

        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(stop(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    def __enter__(self) -> FaultRelay:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    async def _start(self) -> asyncio.Server:
        return await asyncio.start_server(self._serve, "127.0.0.1", 0)

    def _take(self, path: str, body: bytes) -> Fault | None:
        fault = self._fault
        if fault is None or not path.split("?", 1)[0].endswith(fault.path):
            return None
        try:
            parsed = json.loads(body) if body else None
        except ValueError:
            parsed = None
        if not fault.match(parsed):
            return None
        self._fault = None
        return fault

    def _fire(self, fault: Fault) -> None:
        try:
            fault.action()
        finally:
            self.fired.set()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(*self._upstream)
        except OSError:
            writer.close()
            return
        answered: list[Fault] = []  # an "after" fault waiting for the answer's first bytes
        cutting: list[Fault] = []  # an "event" fault counting the answer's events

        async def client_to_upstream() -> None:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.split(b"\r\n")
                path = lines[0].split(b" ")[1].decode("latin-1")
                length = 0
                chunked = False
                for line in lines[1:]:
                    name, _, value = line.partition(b":")
                    name = name.strip().lower()
                    if name == b"content-length":
                        length = int(value.strip())
                    elif name == b"transfer-encoding" and b"chunked" in value.lower():
                        chunked = True
                self.seen.append(path)
                if chunked:  # not a control message: relay the rest of the connection as is
                    up_writer.write(head)
                    while data := await reader.read(65536):
                        up_writer.write(data)
                        await up_writer.drain()
                    return
                body = await reader.readexactly(length) if length else b""
                fault = self._take(path, body)
                if fault is not None and fault.when == "before":
                    self._fire(fault)
                elif fault is not None:
                    (cutting if fault.when == "event" else answered).append(fault)
                up_writer.write(head + body)
                await up_writer.drain()

        async def upstream_to_client() -> None:
            answer = b""  # the answer to the request an "after" fault waits on, so far
            streamed = b""  # the answer an "event" fault cuts, so far
            cut = False
            while data := await up_reader.read(65536):
                if cut:
                    continue  # after the cut: dropped until the upstream closes
                if cutting:
                    streamed += data
                    end = _after_events(streamed, cutting[0].events)
                    if end is not None:
                        writer.write(data[: len(data) - (len(streamed) - end)])
                        await writer.drain()
                        cut = True
                        self._fire(cutting.pop())
                        continue
                writer.write(data)
                await writer.drain()
                if answered:
                    answer += data
                    if _complete(answer):
                        answer = b""
                        self._fire(answered.pop())

        tasks = [
            asyncio.ensure_future(client_to_upstream()),
            asyncio.ensure_future(upstream_to_client()),
        ]
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            pass
        finally:
            for task in tasks:
                task.cancel()
            for w in (writer, up_writer):
                w.close()
            for task in tasks:
                with contextlib.suppress(BaseException):
                    await task


def _after_events(answer: bytes, events: int) -> int | None:
    """Where in `answer` (a response so far) its `events`-th server-sent event ends, with the
    chunk's closing CRLF of a chunked body; None while it has fewer."""
    head_end = answer.find(b"\r\n\r\n")
    if head_end < 0:
        return None
    at = head_end + 4
    for _ in range(events):
        found = answer.find(b"\n\n", at)
        if found < 0:
            return None
        at = found + 2
    return at + 2 if answer.startswith(b"\r\n", at) else at


def _complete(answer: bytes) -> bool:
    """`answer` holds a whole HTTP response (a chunked one: its head)."""
    head, sep, body = answer.partition(b"\r\n\r\n")
    if not sep:
        return False
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return len(body) >= int(value.strip())
    return True
