"""Active probes do not blame an instance for the proxy's own loop lag (`scheduler.prober`).

A real HTTP server in a thread of its own answers ``/health``; the prober runs on this test's loop.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from scheduler.loop_lag import LoopLag
from scheduler.prober import ActiveProber

TIMEOUT_S = 0.3


class HealthServer:
    """``GET /health`` answers `status` with `body` once `release` is set; `arrived` is set when a
    probe came in."""

    def __init__(self) -> None:
        self.status, self.body = 200, b""
        self.arrived = threading.Event()
        self.release = threading.Event()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                outer.arrived.set()
                outer.release.wait(30)
                self.send_response(outer.status)
                self.send_header("content-length", str(len(outer.body)))
                self.end_headers()
                self.wfile.write(outer.body)

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.release.set()
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def server() -> Iterator[HealthServer]:
    started = HealthServer()
    yield started
    started.close()


async def probe_while_the_loop_is_blocked(
    server: HealthServer, prober: ActiveProber, blocked_s: float
) -> bool | None:
    probing = asyncio.ensure_future(prober.probe("a", server.url))
    while not server.arrived.is_set():
        await asyncio.sleep(0.005)
    time.sleep(blocked_s)  # the proxy's loop is busy (tokenizing, hashing, a flood)
    server.release.set()  # the instance answers at once: it was never the slow one
    return await probing


async def test_a_probe_timing_out_while_the_loop_lagged_does_not_count(
    server: HealthServer,
) -> None:
    results: list[tuple[str, bool]] = []
    prober = ActiveProber(lambda: {}, lambda i, ok: results.append((i, ok)), timeout_s=TIMEOUT_S)
    lag = LoopLag(interval_s=0.02)
    lag.start()
    prober.lag_owed = lag.owed
    await asyncio.sleep(0.05)  # the lag's first ticks
    try:
        outcome = await probe_while_the_loop_is_blocked(server, prober, 3 * TIMEOUT_S)
    finally:
        await lag.stop()
        await prober.stop()
    assert outcome is True and results == [("a", True)]


async def test_without_the_loop_lag_the_same_probe_is_a_failure(server: HealthServer) -> None:
    """The counterpart: a prober that does not know the loop's lag blames the instance."""
    results: list[tuple[str, bool]] = []
    prober = ActiveProber(lambda: {}, lambda i, ok: results.append((i, ok)), timeout_s=TIMEOUT_S)
    try:
        outcome = await probe_while_the_loop_is_blocked(server, prober, 3 * TIMEOUT_S)
    finally:
        await prober.stop()
    assert outcome is False and results == [("a", False)]


async def test_a_loop_lagging_past_the_extension_leaves_the_probe_inconclusive(
    server: HealthServer,
) -> None:
    results: list[tuple[str, bool]] = []
    prober = ActiveProber(lambda: {}, lambda i, ok: results.append((i, ok)), timeout_s=TIMEOUT_S)
    prober.lag_owed = lambda since: time.monotonic() - since  # lagging the whole time
    try:
        assert await prober.probe("a", server.url) is None
    finally:
        await prober.stop()
    assert results == []


async def test_an_instance_that_does_not_answer_fails_its_probe(server: HealthServer) -> None:
    results: list[tuple[str, bool]] = []
    prober = ActiveProber(lambda: {}, lambda i, ok: results.append((i, ok)), timeout_s=TIMEOUT_S)
    prober.lag_owed = LoopLag().owed  # never started: nothing owed
    try:
        assert await prober.probe("a", server.url) is False
    finally:
        await prober.stop()
    assert results == [("a", False)]


@pytest.mark.parametrize(
    ("status", "body", "alive"),
    [
        (503, b'{"status": "draining"}', True),  # an agent handing its requests over
        (503, b'{"status": "overloaded"}', False),
        (503, b"[]", False),
        (503, b"not json", False),
        (500, b'{"status": "engine_dead"}', False),
    ],
)
async def test_a_draining_agent_passes_its_probe(
    server: HealthServer, status: int, body: bytes, alive: bool
) -> None:
    """Ejecting a draining agent would fail its requests over while they migrate away."""
    server.status, server.body = status, body
    server.release.set()
    results: list[tuple[str, bool]] = []
    prober = ActiveProber(lambda: {}, lambda i, ok: results.append((i, ok)), timeout_s=5.0)
    try:
        assert await prober.probe("a", server.url) is alive
    finally:
        await prober.stop()
    assert results == [("a", alive)]
