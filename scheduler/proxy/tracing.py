"""OpenTelemetry traces of the request path, off unless ``kvherd serve --otlp-endpoint URL``.

Contract:
- Off, the proxy holds no `Tracing` and each request `scheduler.proxy.untraced.UNTRACED` (no span
  is made), and a client's W3C ``traceparent``/``tracestate`` go to the instances unchanged.
- `Tracing(exporter, sample_ratio=R)` (`kvherd.otlp.exporter(url)`: OTLP/HTTP protobuf, batched
  off the event loop; a client's sampled flag is kept, other requests traced at ratio R) makes
  each request one trace: `request(...)` a ``kvherd.request`` server span, the child of the
  client's ``traceparent`` when it sent a valid one. Its children (`RequestTrace.span`, ended on
  every path, ERROR with the exception's message when one escapes): ``kvherd.admission`` (rate
  limits and admission), ``kvherd.route`` (chosen instance, matched blocks, the policy's reason
  and each candidate's score, whether it queued), ``kvherd.attempt`` per attempt (instance,
  status; a P/D handoff an event naming the decode instance), ``kvherd.continuation``,
  ``kvherd.migration`` (destination).
- `headers(span)`: the ``traceparent`` (and ``tracestate``) naming `span`, sent to the instance
  it covers (vLLM and kvherd agents read it). `shutdown()` flushes what is left.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor, SpanExporter
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
from opentelemetry.trace import Span, SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from kvherd.otlp import remote_parent
from scheduler.core.router import Routed
from scheduler.fleet import FleetInstance
from scheduler.forwarding import UpstreamError
from scheduler.proxy.attempt import UpstreamStatus

_PROPAGATOR = TraceContextTextMapPropagator()


class Tracing:
    def __init__(
        self,
        exporter: SpanExporter,
        batch: bool = True,
        service_name: str = "kvherd-proxy",
        sample_ratio: float = 1.0,
    ) -> None:
        # A client's sampled flag is kept; other requests are traced at `sample_ratio`.
        sampler = ParentBased(TraceIdRatioBased(sample_ratio))
        self.provider = TracerProvider(
            resource=Resource.create({"service.name": service_name}), sampler=sampler
        )
        processor = BatchSpanProcessor(exporter) if batch else SimpleSpanProcessor(exporter)
        self.provider.add_span_processor(processor)
        self.tracer = self.provider.get_tracer("kvherd.proxy")

    def request(
        self, path: bytes, request_id: bytes, traceparent: bytes | None, tracestate: bytes | None
    ) -> RequestTrace:
        parent = remote_parent(
            None if traceparent is None else traceparent.decode("latin-1"),
            None if tracestate is None else tracestate.decode("latin-1"),
        )
        root = self.tracer.start_span(
            "kvherd.request",
            context=parent,
            kind=SpanKind.SERVER,
            attributes={
                "http.request.method": "POST",
                "url.path": path.decode("latin-1"),
                "kvherd.request_id": request_id.decode("latin-1"),
            },
        )
        return RequestTrace(self.tracer, root)

    def shutdown(self) -> None:
        self.provider.shutdown()


class RequestTrace:
    """One request's trace: its root span and the children made under it."""

    __slots__ = ("_context", "_tracer", "root")

    def __init__(self, tracer: trace.Tracer, root: Span) -> None:
        self._tracer = tracer
        self.root = root
        self._context = trace.set_span_in_context(root)

    @contextlib.contextmanager
    def span(self, name: str, **attributes: Any) -> Iterator[Span]:
        span = self._tracer.start_span(name, context=self._context, attributes=attributes)
        try:
            yield span
        except BaseException as exc:
            span.set_status(Status(StatusCode.ERROR, f"{type(exc).__name__}: {exc}"))
            raise
        finally:
            span.end()

    @staticmethod
    def headers(span: Span) -> list[tuple[bytes, bytes]]:
        carrier: dict[str, str] = {}
        _PROPAGATOR.inject(carrier, context=trace.set_span_in_context(span))
        return [(k.encode(), v.encode("latin-1")) for k, v in carrier.items()]

    @staticmethod
    def route(span: Span, chosen: tuple[FleetInstance, int, bool], routed: Routed | None) -> None:
        """The route decision: the instance, its cached blocks, whether it queued, and the
        policy's reason and score per candidate (higher is better: a cost's negation)."""
        instance, matched, queued = chosen
        span.set_attribute("kvherd.instance", instance.instance_id)
        span.set_attribute("kvherd.matched_blocks", matched)
        span.set_attribute("kvherd.queued", queued)
        if routed is not None and routed.instance_id == instance.instance_id:
            decision = routed.decision
            span.set_attribute("kvherd.reason", decision.reason)
            scores = decision.scores
            if instance.instance_id in scores:
                span.set_attribute("kvherd.score", float(scores[instance.instance_id]))
            span.set_attribute("kvherd.candidates", [f"{i}={v:.6g}" for i, v in scores.items()])

    @staticmethod
    def outcome(span: Span, outcome: int | str | UpstreamError) -> None:
        """An attempt's end: the status it relayed, or why it is retried."""
        if isinstance(outcome, UpstreamStatus):
            span.set_attribute("http.response.status_code", outcome.response.status)
            span.set_status(Status(StatusCode.ERROR, "the instance answered 5xx"))
        elif isinstance(outcome, UpstreamError):
            span.set_status(Status(StatusCode.ERROR, str(outcome)))
        elif isinstance(outcome, int):
            span.set_attribute("http.response.status_code", outcome)
        else:
            span.set_attribute("kvherd.outcome", outcome)

    def end(self, status: int | str) -> None:
        root = self.root
        if isinstance(status, int):
            root.set_attribute("http.response.status_code", status)
        else:
            root.set_attribute("kvherd.outcome", status)
        if not isinstance(status, int) or status >= 500:
            root.set_status(Status(StatusCode.ERROR, str(status)))
        root.end()
