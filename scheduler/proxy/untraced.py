"""What the request path holds as a request's trace, and the trace it holds when tracing is off.

Contract:
- `Trace`: what the path calls on a request's trace (`scheduler.proxy.tracing.RequestTrace` when
  ``--otlp-endpoint`` is on): `span(name, **attributes)`, a context manager yielding a span
  (``set_attribute``, ``add_event``); `headers(span)`, the W3C headers naming it for the instance
  it covers; `route`, `outcome` (attributes of a route or attempt span) and `end(status)`.
- `UNTRACED` does nothing: no span, no header (a client's own ``traceparent`` reaches the
  instances unchanged), no OpenTelemetry import. Every site runs one code path either way.
"""

from __future__ import annotations

from typing import Any, Protocol


class Trace(Protocol):
    def span(self, name: str, **attributes: Any) -> Any: ...
    def headers(self, span: Any) -> list[tuple[bytes, bytes]]: ...
    def route(self, span: Any, chosen: Any, routed: Any) -> None: ...
    def outcome(self, span: Any, outcome: Any) -> None: ...
    def end(self, status: int | str) -> None: ...


class _NoSpan:
    __slots__ = ()

    def __enter__(self) -> _NoSpan:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def set_attribute(self, key: str, value: Any) -> None:
        return None

    def add_event(self, name: str, attributes: Any = None) -> None:
        return None


_NO_SPAN = _NoSpan()


class Untraced:
    __slots__ = ()

    def span(self, name: str, **attributes: Any) -> _NoSpan:
        return _NO_SPAN

    def headers(self, span: Any) -> list[tuple[bytes, bytes]]:
        return []

    def route(self, span: Any, chosen: Any, routed: Any) -> None:
        return None

    def outcome(self, span: Any, outcome: Any) -> None:
        return None

    def end(self, status: int | str) -> None:
        return None


UNTRACED: Trace = Untraced()
