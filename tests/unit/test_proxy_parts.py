"""Followed call by call, a completion request passes through each part of the proxy once, in
order: admission, the body read into a routed request, dispatch, the attempt's upstream, the relay,
and the fleet's accounting closed once. A real `Proxy` and `Fleet`, a scripted instance on loopback; only the
client side (`Exchange`) is a recording stub."""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import AsyncIterator
from typing import Any

import pytest

from kvherd.tokenizer import ByteTokenizer
from scheduler.core.tenancy import TenantRegistry
from scheduler.fleet import Fleet, FleetSettings, InstanceSpec
from scheduler.metrics import ProxyMetrics
from scheduler.proxy.admission_gate import AdmissionGate
from scheduler.proxy.attempt import Attempt
from scheduler.proxy.model_tokenizers import ModelTokenizers
from scheduler.proxy.proxy import Proxy, ProxyConfig
from scheduler.proxy.relay import Relay
from scheduler.proxy.routed_request import RequestReader

STREAM = (
    b'data: {"id":"c","object":"text_completion","choices":[{"index":0,"text":"a"}]}\n\n'
    b"data: [DONE]\n\n"
)


@contextlib.asynccontextmanager
async def instance(streamed: bool) -> AsyncIterator[str]:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = next(
            int(line.split(b":")[1])
            for line in head.split(b"\r\n")
            if line.lower().startswith(b"content-length:")
        )
        await reader.readexactly(length)
        if streamed:
            writer.write(
                b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                b"transfer-encoding: chunked\r\n\r\n%x\r\n%s\r\n0\r\n\r\n" % (len(STREAM), STREAM)
            )
        else:
            body = b'{"choices":[{"text":"a"}]}'
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(handler, "127.0.0.1", 0)
    try:
        yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    finally:
        server.close()


class ExchangeStub:
    def __init__(self, body: bytes) -> None:
        self.method = b"POST"
        self.headers = [(b"content-type", b"application/json")]
        self.body = body
        self.too_large = False
        self.gone = False
        self.started = False
        self.status: int | None = None
        self.data = b""

    def respond(self, status: int, headers: Any, body: bytes) -> None:
        self.status, self.data, self.started = status, body, True

    def start_stream(self, status: int, headers: Any) -> None:
        self.status, self.started = status, True

    async def write_chunk(self, data: bytes) -> None:
        self.data += data

    def end_stream(self) -> None:
        pass


def trace_calls(monkeypatch: pytest.MonkeyPatch, calls: list[str]) -> None:
    parts = [
        (AdmissionGate, "check"),
        (RequestReader, "read"),
        (AdmissionGate, "dispatch"),
        (Attempt, "open"),
        (Relay, "stream"),
        (Relay, "plain"),
        (Fleet, "request_finished"),
        (Fleet, "request_failed"),
    ]
    for cls, name in parts:
        original = getattr(cls, name)
        label = f"{cls.__name__}.{name}"
        if asyncio.iscoroutinefunction(original):

            async def traced_async(*args: Any, _f: Any = original, _l: str = label) -> Any:
                calls.append(_l)
                return await _f(*args)

            monkeypatch.setattr(cls, name, functools.wraps(original)(traced_async))
        else:

            def traced(*args: Any, _f: Any = original, _l: str = label, **kw: Any) -> Any:
                calls.append(_l)
                return _f(*args, **kw)

            monkeypatch.setattr(cls, name, functools.wraps(original)(traced))


@pytest.mark.parametrize("streamed", [True, False])
async def test_a_completion_passes_through_each_part_once_in_order(
    monkeypatch: pytest.MonkeyPatch, streamed: bool
) -> None:
    calls: list[str] = []
    trace_calls(monkeypatch, calls)
    async with instance(streamed) as url:
        fleet = Fleet("round_robin", FleetSettings(block_size=16), ProxyMetrics())
        await fleet.add_instance(InstanceSpec("a", url, kvherd_agent=False))
        tokenizers = ModelTokenizers(ByteTokenizer())
        proxy = Proxy(fleet, tokenizers, TenantRegistry(), ProxyConfig(), ProxyMetrics())
        body = b'{"prompt": "hello", "max_tokens": 1, "stream": %s}' % (
            b"true" if streamed else b"false"
        )
        exchange = ExchangeStub(body)
        await proxy.completions(exchange)  # type: ignore[arg-type]
        await fleet.stop()
    assert exchange.status == 200, exchange.data
    relay = "Relay.stream" if streamed else "Relay.plain"
    assert calls == [
        "AdmissionGate.check",
        "RequestReader.read",
        "AdmissionGate.dispatch",
        "Attempt.open",
        relay,
        "Fleet.request_finished",
    ]
    assert fleet.inflight.instance_of(next(iter(fleet._aliases.values()))) is None
