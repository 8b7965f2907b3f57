"""The client's W3C ``traceparent`` on its way to the instance: passed on unchanged with tracing
off (no span made), replaced by the attempt span's (same trace, the client's span its
grandparent) with tracing on. A real `Proxy` and `Fleet` and an instance on loopback that
records the head it got; only the client side (`Exchange`) is a recording stub."""

from __future__ import annotations

import asyncio
from typing import Any

from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from kvherd.tokenizer import ByteTokenizer
from scheduler.core.tenancy import TenantRegistry
from scheduler.fleet import Fleet, FleetSettings, InstanceSpec
from scheduler.metrics import ProxyMetrics
from scheduler.proxy.model_tokenizers import ModelTokenizers
from scheduler.proxy.proxy import Proxy, ProxyConfig
from scheduler.proxy.tracing import Tracing

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT = f"00-{TRACE_ID}-00f067aa0ba902b7-01"


class ExchangeStub:
    def __init__(self) -> None:
        self.method = b"POST"
        self.headers = [
            (b"content-type", b"application/json"),
            (b"traceparent", CLIENT.encode()),
            (b"tracestate", b"vendor=1"),
        ]
        self.body = b'{"prompt": "hello", "max_tokens": 1}'
        self.too_large = self.gone = self.started = False
        self.status: int | None = None

    def respond(self, status: int, headers: Any, body: bytes) -> None:
        self.status, self.started = status, True


async def _sent_head(tracing: Tracing | None) -> dict[bytes, bytes]:
    heads: list[bytes] = []

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        heads.append(head)
        length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
        await reader.readexactly(length)
        body = b'{"choices":[{"text":"a"}]}'
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(handler, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    fleet = Fleet("round_robin", FleetSettings(block_size=16), ProxyMetrics())
    await fleet.add_instance(InstanceSpec("a", url, kvherd_agent=False))
    proxy = Proxy(
        fleet,
        ModelTokenizers(ByteTokenizer()),
        TenantRegistry(),
        ProxyConfig(),
        ProxyMetrics(),
        tracing=tracing,
    )
    exchange = ExchangeStub()
    await proxy.completions(exchange)  # type: ignore[arg-type]
    await fleet.stop()
    await proxy.pool.close()
    server.close()
    assert exchange.status == 200
    lines = heads[0].split(b"\r\n")[1:]
    return dict(line.lower().split(b": ", 1) for line in lines if b": " in line)


async def test_off_the_client_s_traceparent_goes_on_unchanged() -> None:
    head = await _sent_head(None)
    assert head[b"traceparent"] == CLIENT.encode() and head[b"tracestate"] == b"vendor=1"


async def test_on_the_instance_gets_its_attempt_span_s() -> None:
    exporter = InMemorySpanExporter()
    head = await _sent_head(Tracing(exporter, batch=False))
    version, trace_id, span_id, flags = head[b"traceparent"].decode().split("-")
    assert (version, trace_id, flags) == ("00", TRACE_ID, "01")
    attempt = next(s for s in exporter.get_finished_spans() if s.name == "kvherd.attempt")
    assert span_id == f"{attempt.context.span_id:016x}"
    assert head[b"tracestate"] == b"vendor=1"  # carried in the trace's context
