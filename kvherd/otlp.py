"""OTLP/HTTP export of kvherd's traces, shared by the proxy and the agents.

Contract:
- `check_endpoint(url)`: ValueError unless `url` is an ``http(s)://`` URL.
- `exporter(url)`: spans as OTLP/HTTP protobuf to ``URL/v1/traces`` (appended unless `url` ends
  so); ImportError, naming the ``tracing`` extra, without the OpenTelemetry packages.
- `remote_parent(traceparent, tracestate)`: the W3C trace context a span continues (an empty
  context when the header is absent or invalid: the span then starts a trace of its own).
"""

from __future__ import annotations

from typing import Any
from urllib.parse import urlsplit

EXTRA_HINT = "pip install 'kvherd[tracing]'"


def check_endpoint(url: str) -> None:
    if not url.startswith(("http://", "https://")) or not urlsplit(url).hostname:
        raise ValueError(f"--otlp-endpoint must be an http(s):// URL, got {url!r}")


def exporter(url: str) -> Any:
    try:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    except ImportError as exc:
        raise ImportError(
            f"--otlp-endpoint needs the OpenTelemetry packages ({EXTRA_HINT}): {exc}"
        ) from None
    url = url.rstrip("/")
    if not url.endswith("/v1/traces"):
        url += "/v1/traces"
    return OTLPSpanExporter(endpoint=url, timeout=5)


def remote_parent(traceparent: str | None, tracestate: str | None) -> Any:
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    carrier = {}
    if traceparent is not None:
        carrier["traceparent"] = traceparent
        if tracestate is not None:
            carrier["tracestate"] = tracestate
    return TraceContextTextMapPropagator().extract(carrier)
