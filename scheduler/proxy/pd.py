"""The proxy's side of P/D disaggregation: ask the prefill instance for the handoff, read its outcome.

Contract:
- When the fleet pairs a request with a decode instance (`Fleet.handoff_target`), the request goes
  to its prefill instance with `handoff_headers(url, fleet_token)` (``X-Kvherd-Handoff: URL`` and
  the fleet token, per attempt: retries and continuations elsewhere are sent without them). That
  agent reserves on URL as it admits the request, moves its KV there while it prefills, streams
  the first token at once and hands the request over after it (`instance_agent.pd_handoff`); the
  proxy's migration reattachment continues the stream there, a non-streamed request is relayed
  by the prefill agent.
- `watch(chunks, ...)` passes a streamed request's bytes from its prefill instance through, taking
  out the agent's handoff ledger line (``: kvherd {"handoff": {...}}``; never relayed, never seen
  by the continuation ledger). On ``ok`` it moves the request's accounting to the decode instance
  (`Fleet.request_migrated`) before the migration notice that follows the line is acted on, and
  records the handoff (`ProxyMetrics.handoff`: outcome; seconds, the report's ``duration_s``:
  from the first token's frame written to the commit, the part of the client's second-token gap
  the handoff causes; downtime, from the first token sampled; bytes, blocks sent and
  deduplicated); ``fallback`` (the request decodes where it was prefilled) is counted as such; a
  stream that breaks or ends before any outcome counts ``failed`` (its continuation elsewhere is
  the proxy's usual one). A client that leaves counts nothing. Whenever the request will not move,
  the decode instance stops counting it as incoming (`Fleet.handoff_failed`). `HandoffOutcome`
  settles each handoff exactly once, for both drivers of it below.
- `take_outcome(response, ...)` does the same for a non-streamed response from the
  ``X-Kvherd-Handoff`` response header, which it removes from the headers relayed.
- Between two vLLM servers running kvherd's connector the proxy runs the handoff itself: the
  prefill instance computes the prompt for one token (`prefill_only`, never relayed), then the
  request itself goes to the decode instance, which pulls every full prompt block from the
  prefill instance's block server (`kvherd.vllm_connector`) and decodes from there.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import orjson

from kvherd import wire
from scheduler.fleet import Fleet
from scheduler.forwarding import UpstreamError, UpstreamResponse
from scheduler.metrics import ProxyMetrics

HANDOFF_HEADER = b"x-kvherd-handoff"
_LINE = wire.LEDGER_PREFIX + b'{"handoff":'


def handoff_headers(dst_url: str, fleet_token: str | None) -> list[tuple[bytes, bytes]]:
    """The headers asking for a handoff to `dst_url` (the agent wants the fleet token too)."""
    headers = [(HANDOFF_HEADER, dst_url.encode())]
    if fleet_token:
        headers.append((b"authorization", b"Bearer " + fleet_token.encode()))
    return headers


class HandoffOutcome:
    """One request's handoff to `decode_id`, settled once: the first of `moved`, `fell_back` and
    `failed` tells the fleet (the request's accounting moves to the decode instance, or the decode
    instance stops counting it as incoming) and counts the outcome; any later call is a no-op."""

    __slots__ = ("_fleet", "_metrics", "decode_id", "key", "settled")

    def __init__(self, fleet: Fleet, metrics: ProxyMetrics, key: str, decode_id: str) -> None:
        self._fleet = fleet
        self._metrics = metrics
        self.key = key
        self.decode_id = decode_id
        self.settled = False

    def _settle(self) -> bool:
        first = not self.settled
        self.settled = True
        return first

    def moved(self, report: dict[str, Any] | None = None) -> None:
        """Committed on the decode instance; `report` the agent's figures, when it sent them."""
        if not self._settle():
            return
        self._fleet.request_migrated(self.key, self.decode_id)
        if report is None:
            self._metrics.handoff("ok")
            return
        self._metrics.handoff(
            "ok",
            seconds=float(report.get("duration_s") or 0.0),
            downtime_s=float(report.get("downtime_s") or 0.0),
            bytes_sent=int(report.get("bytes_sent") or 0),
            blocks_sent=int(report.get("blocks_sent") or 0),
            blocks_skipped=int(report.get("blocks_skipped") or 0),
            bytes_skipped=int(report.get("bytes_skipped") or 0),
        )

    def fell_back(self) -> None:
        """It decodes where it was prefilled."""
        if self._settle():
            self._fleet.handoff_failed(self.key)
            self._metrics.handoff("fallback")

    def failed(self, counted: bool = True) -> None:
        """No outcome came (`counted`: False for an answer that was itself an error)."""
        if self._settle():
            self._fleet.handoff_failed(self.key)
            if counted:
                self._metrics.handoff("failed")

    def reported(self, report: Any) -> None:
        """The agent's handoff report (its ledger line or response header), whatever it holds."""
        if not isinstance(report, dict) or report.get("outcome") not in ("ok", "fallback"):
            self.failed()
        elif report["outcome"] == "fallback":
            self.fell_back()
        else:
            self.moved(report)


def _partial_marker(data: bytes) -> int:
    """Length of the longest proper prefix of the handoff line's start that `data` ends with."""
    for size in range(min(len(_LINE) - 1, len(data)), 0, -1):
        if data.endswith(_LINE[:size]):
            return size
    return 0


async def watch(chunks: AsyncIterator[bytes], handoff: HandoffOutcome) -> AsyncIterator[bytes]:
    """The prefill instance's stream without its handoff line (see the module contract)."""
    held = b""
    try:
        async for chunk in chunks:
            if handoff.settled:  # the line was read: the rest passes through
                yield chunk
                continue
            data = held + chunk if held else chunk
            at = data.find(_LINE)
            if at < 0:
                keep = _partial_marker(data)
                held = data[len(data) - keep :] if keep else b""
                out = data[: len(data) - keep]
            else:
                end = data.find(b"\n", at)
                if end < 0:  # the line goes on in the next chunk
                    held, out = data[at:], data[:at]
                else:
                    held = b""
                    try:
                        report = orjson.loads(data[at + len(wire.LEDGER_PREFIX) : end])
                        report = report["handoff"]
                    except (orjson.JSONDecodeError, KeyError, TypeError):
                        report = None
                    handoff.reported(report)
                    out = data[:at] + data[end + 1 :]
            if out:
                yield out
        if held:
            yield held
        handoff.failed()  # a no-op once the line was read
    except UpstreamError:
        handoff.failed()
        raise


def take_outcome(response: UpstreamResponse, handoff: HandoffOutcome) -> None:
    """Record a non-streamed response's handoff and drop its header from what is relayed."""
    value = response.header(HANDOFF_HEADER)
    if value is None:
        handoff.failed(counted=response.status < 400)
        return
    response.headers = [h for h in response.headers if h[0] != HANDOFF_HEADER]
    try:
        report = orjson.loads(value)
    except orjson.JSONDecodeError:
        report = None
    handoff.reported(report)


def prefill_only(body: dict[str, Any]) -> bytes:
    """`body` asking for its first token alone, not streamed: the prefill of a vLLM handoff."""
    asked = {k: v for k, v in body.items() if k not in _DECODE_ONLY}
    asked["max_tokens"] = 1
    return orjson.dumps(asked)


# Fields of a request that shape its decode or its stream, not its prefill.
_DECODE_ONLY = frozenset(
    {"stream", "stream_options", "max_completion_tokens", "min_tokens", "kv_transfer_params"}
)
