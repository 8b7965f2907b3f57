"""OpenTelemetry spans of a request's life in one agent, off unless ``kvherd agent --otlp-endpoint``.

Contract:
- `AgentTracing.begin(request_id, traceparent, tracestate)` (the HTTP handler, for a request that
  came with a W3C ``traceparent``: the proxy's attempt span, or a client's) and `finished(...)`
  (the engine thread, once the request ended here) make one ``kvherd.agent.request`` span, the
  child of that context, from its arrival to its end, with three children: ``kvherd.agent.queue``
  (arrival to its first step in the batch), ``kvherd.agent.prefill`` (to its first token) and
  ``kvherd.agent.decode`` (to its end); the prompt, cached and output token counts and the
  finish reason as attributes. Spans are made after the fact, with the times the engine loop
  took (`time.monotonic`), so nothing is added to a step.
- A request that never came with a context, or that ended before its first token (refused,
  aborted, migrated in), makes no span. Export is batched off the engine thread.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor, SpanExporter
from opentelemetry.trace import SpanKind, set_span_in_context

from kvherd.otlp import remote_parent


class AgentTracing:
    def __init__(self, exporter: SpanExporter, instance_id: str, batch: bool = True) -> None:
        resource = Resource.create(
            {"service.name": "kvherd-agent", "service.instance.id": instance_id}
        )
        self.provider = TracerProvider(resource=resource)
        processor = BatchSpanProcessor(exporter) if batch else SimpleSpanProcessor(exporter)
        self.provider.add_span_processor(processor)
        self.tracer = self.provider.get_tracer("kvherd.agent")
        self._contexts: dict[str, Any] = {}  # request id -> its remote parent
        self._lock = threading.Lock()  # begin on the event loop, finished on the engine thread
        # Monotonic seconds -> epoch nanoseconds (OpenTelemetry's clock).
        self._epoch_ns = time.time_ns() - time.monotonic_ns()

    def begin(self, request_id: str, traceparent: str | None, tracestate: str | None) -> None:
        if traceparent is None:
            return
        with self._lock:
            self._contexts[request_id] = remote_parent(traceparent, tracestate)

    def forget(self, request_id: str) -> None:
        with self._lock:
            self._contexts.pop(request_id, None)

    def finished(
        self,
        request_id: str,
        arrival: float,
        scheduled: float | None,
        first_token: float | None,
        end: float,
        attributes: dict[str, Any],
    ) -> None:
        with self._lock:
            parent = self._contexts.pop(request_id, None)
        if parent is None or first_token is None:
            return
        ns = self._ns
        root = self.tracer.start_span(
            "kvherd.agent.request",
            context=parent,
            kind=SpanKind.SERVER,
            start_time=ns(arrival),
            attributes={"kvherd.request_id": request_id, **attributes},
        )
        inside = set_span_in_context(root)
        started = scheduled if scheduled is not None else arrival
        for name, begin, until in (
            ("kvherd.agent.queue", arrival, started),
            ("kvherd.agent.prefill", started, first_token),
            ("kvherd.agent.decode", first_token, end),
        ):
            span = self.tracer.start_span(name, context=inside, start_time=ns(begin))
            span.end(end_time=ns(max(begin, until)))
        root.end(end_time=ns(end))

    def _ns(self, monotonic_s: float) -> int:
        return self._epoch_ns + int(monotonic_s * 1e9)

    def shutdown(self) -> None:
        self.provider.shutdown()
