"""The relay: an instance's response to the client, JSON or SSE, following live migrations.

Contract:
- `Relay.plain(exchange, job, attempt, upstream)` relays a JSON response in one piece (or a stream
  that is not a 200, chunk by chunk) and finishes the attempt.
- `Relay.stream(exchange, job, attempt, upstream)` relays a 200 stream through its
  `continuation.StreamLedger` as chunks arrive, under the instance's inter-chunk deadline
  (`scheduler.core.deadlines`; each gap observed). When the instance is lost (the stream breaks,
  hangs past its deadline, sends an error frame) the attempt fails and the rest of the stream is
  opened elsewhere by the proxy's `Continue` (at most ``max_continuations`` times); a stream whose
  end alone was lost gets its closing frames; one that cannot be continued gets an error frame.
- Migrations: an agent ends a migrated stream with a notice frame (`kvherd.wire.NOTICE_PREFIX`,
  never relayed); the relay POSTs its ``resume`` to ``URL/kvherd/v1/requests/{id}/resume`` on the
  destination (a fleet instance only) and relays that stream from the next token, as often as the
  request moves. A stream that breaks at a destination fails that destination; every instance
  but it, the former source included, may continue it. The fleet counts a stream in flight for
  as long as it is relayed, across its attempts (`Fleet.stream_opened` .. `stream_closed`).
- Response headers: the upstream's, with ``X-Request-Id`` the client's, ``X-Kvherd-Instance``
  only with ``expose_instance``, and the job's `reply_headers` (a limited tenant's rate limits).
  A job that `count_output` gets its `output_tokens` once relayed (the JSON's usage, the stream's
  tokens). An answer's own ``cached_tokens`` (a JSON's usage; a stream's, when it asked for usage)
  goes to the fleet's cache-truth check (`Fleet.cache_reported`).
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol
from urllib.parse import quote

import orjson

from kvherd import wire
from scheduler.core.deadlines import Deadlines
from scheduler.forwarding import UpstreamError, UpstreamPool, UpstreamResponse
from scheduler.metrics import ProxyMetrics
from scheduler.proxy.attempt import Attempt, Upstream
from scheduler.proxy.continuation import (
    Continued,
    StreamLedger,
    continuable_on_vllm,
    error_frame,
)
from scheduler.proxy.http_front import Exchange
from scheduler.proxy.routed_request import RoutedRequest
from scheduler.proxy.stream_cuts import StreamCuts
from scheduler.proxy.untraced import UNTRACED, Trace

if TYPE_CHECKING:
    from scheduler.fleet import Fleet, FleetInstance

log = logging.getLogger("kvherd.proxy")

_NOTICE = wire.NOTICE_PREFIX


@dataclass(slots=True)
class Job:
    """A request in flight through the proxy: what its relay and its continuations need."""

    key: str  # the fleet's id for it (routing key, the id the instances see)
    request_id: bytes  # the client's
    request: RoutedRequest
    headers: list[tuple[bytes, bytes]]  # sent upstream
    tried: set[str]  # instances that served or failed it
    started: float  # perf_counter when its body began to be read (decision time)
    reply_headers: list[tuple[bytes, bytes]] = field(default_factory=list)  # sent to the client
    count_output: bool = False  # a rate-limited tenant's: count its output tokens
    output_tokens: int | None = None  # counted once relayed (None: not counted, or unknown)
    trace: Trace = UNTRACED  # its trace (`scheduler.proxy.untraced`)
    slo_ttft_s: float | None = None  # the TTFT its client asked for (``X-Kvherd-Slo-Ttft-Ms``)


class Continue(Protocol):
    """Opens the rest of a stream on another instance (or on instance `on`, pulling its full
    blocks from the block server `pull_from`): (its attempt, its upstream), or None."""

    def __call__(
        self, job: Job, continued: Continued, on: str | None = None, pull_from: str | None = None
    ) -> Awaitable[tuple[Attempt, Upstream] | None]: ...


def completion_tokens(body: bytes | None) -> int | None:
    """``usage.completion_tokens`` of a JSON response (None when it names none)."""
    try:
        usage = orjson.loads(body or b"null")["usage"]
        count = usage["completion_tokens"]
    except (orjson.JSONDecodeError, TypeError, KeyError):
        return None
    return count if type(count) is int and count >= 0 else None


_CACHED_TOKENS = re.compile(rb'"cached_tokens":\s*(\d+)')


def cached_tokens_in(data: bytes) -> int | None:
    """The last ``usage.prompt_tokens_details.cached_tokens`` in a response's bytes (None: none)."""
    found = _CACHED_TOKENS.findall(data)
    return int(found[-1]) if found else None


def _split(data: bytes) -> tuple[bytes, bytes, bytes]:
    """`data` as (bytes to relay now, bytes to hold back, a migration notice's start)."""
    at = data.find(_NOTICE)
    if at >= 0:
        return data[:at], b"", data[at:]
    # A chunk may end inside a notice's first bytes: hold those back until the next one.
    keep = len(data) - _notice_prefix(data)
    return data[:keep], data[keep:], b""


def _notice_prefix(data: bytes) -> int:
    """Length of the longest proper prefix of a notice frame that `data` ends with."""
    if data.endswith(b"\n"):  # the usual case: a chunk ends with a whole frame
        return 0
    for size in range(min(len(_NOTICE) - 1, len(data)), 0, -1):
        if data.endswith(_NOTICE[:size]):
            return size
    return 0


class Relay:
    def __init__(
        self,
        fleet: Fleet,
        pool: UpstreamPool,
        deadlines: Deadlines,
        metrics: ProxyMetrics,
        continue_stream: Continue,
        *,
        max_continuations: int,
        expose_instance: bool,
        fleet_token: str | None,
    ) -> None:
        self.fleet = fleet
        self.pool = pool
        self.deadlines = deadlines
        self.metrics = metrics
        self.continue_stream = continue_stream
        self.max_continuations = max_continuations
        self.expose_instance = expose_instance
        self.fleet_token = fleet_token
        self.cuts = StreamCuts()  # vLLM streams, for the proxy's own migrations

    def _headers(self, response: UpstreamResponse, job: Job, instance: FleetInstance) -> list:
        headers = [h for h in response.headers if h[0] != b"x-request-id"]
        headers.append((b"x-request-id", job.request_id))
        if self.expose_instance:
            headers.append((b"x-kvherd-instance", instance.instance_id.encode()))
        if job.reply_headers:
            headers += job.reply_headers
        return headers

    async def plain(
        self, exchange: Exchange, job: Job, attempt: Attempt, upstream: Upstream
    ) -> int | str:
        response = upstream.response
        headers = self._headers(response, job, attempt.instance)
        ok = response.status < 400
        with attempt:
            if upstream.chunks is None:
                exchange.respond(response.status, headers, response.body or b"")
                if ok:
                    self._cache_reported(job, response.body or b"")
                attempt.finish(ok)
                if job.count_output:
                    job.output_tokens = completion_tokens(response.body) if ok else 0
                return response.status
            self.fleet.first_token(job.key)
            stream = self._follow_migrations(upstream.first, upstream.chunks, job, [])
            try:
                exchange.start_stream(response.status, headers)
                async for chunk in stream:
                    await exchange.write_chunk(chunk)
                exchange.end_stream()
            except UpstreamError as exc:
                log.warning(
                    "request %s: stream from %s broke: %s",
                    job.key, attempt.instance.instance_id, exc,
                )  # fmt: skip
                attempt.fail()
                return "upstream_broke"
            finally:
                response.close()
                await stream.aclose()  # closes a resumed upstream too: the instance aborts
            attempt.finish(ok)
            return response.status

    async def stream(
        self, exchange: Exchange, job: Job, attempt: Attempt, upstream: Upstream
    ) -> int | str:
        """Relay a stream, continuing it on other instances while its instance is lost."""
        if attempt.instance.spec.kvherd_agent:
            ledger = StreamLedger()
        else:
            ledger = StreamLedger.from_vllm(
                job.request.body, job.request.chat, job.request.tokenizer.decode
            )
        self.fleet.stream_opened(job.key)  # in flight for the fleet across its attempts
        try:
            status = await self._stream(exchange, job, attempt, upstream, ledger)
        finally:
            self.fleet.stream_closed(job.key)
        if job.count_output:
            job.output_tokens = ledger.output_tokens()
        return status

    async def _stream(
        self,
        exchange: Exchange,
        job: Job,
        attempt: Attempt,
        upstream: Upstream,
        ledger: StreamLedger,
    ) -> int | str:
        response = upstream.response
        status = response.status
        exchange.start_stream(status, self._headers(response, job, attempt.instance))
        self.fleet.first_token(job.key)
        continuations = 0
        while True:
            cut = None  # the proxy's own migration of this (vLLM) stream, when one broke it
            with attempt:
                moved_to: list[str] = []  # the destinations this stream followed (migrations)
                stream = self._follow_migrations(upstream.first, upstream.chunks, job, moved_to)
                cuttable = not attempt.instance.spec.kvherd_agent and continuable_on_vllm(
                    job.request.body
                )
                if cuttable:
                    self.cuts.register(job.key, upstream.response)
                try:
                    await self._pump(stream, ledger, exchange, upstream.response, attempt)
                except UpstreamError as exc:
                    cut = self.cuts.taken(job.key) if cuttable else None
                    if cut is None:
                        self._lost(job, attempt, moved_to)
                        log.warning(
                            "request %s: stream from %s broke: %s",
                            job.key, attempt.instance.instance_id, exc,
                        )  # fmt: skip
                        attempt.fail(exc)
                else:
                    self._cache_reported(job, ledger.last_events())
                    attempt.finish()
                    exchange.end_stream()
                    return status
                finally:
                    if cuttable:
                        self.cuts.unregister(job.key)
                    upstream.response.close()
                    await stream.aclose()  # closes a resumed upstream too: the instance aborts
            if ledger.finished:  # only the end was lost
                if cut is not None:
                    self.cuts.settle(cut, job.key, opened=False, finished=True)
                self.metrics.continuation("finished")
                await exchange.write_chunk(ledger.closing_frames())
                exchange.end_stream()
                return status
            opened = None
            continued = ledger.continuation(job.request.body)
            if cut is not None and cut.dst is not None:
                source = attempt.instance.spec.pull_address
                if continued is not None:
                    opened = await self.continue_stream(job, continued, cut.dst, source)
                self.cuts.settle(cut, job.key, opened is not None)
                if opened is not None:
                    self.metrics.continuation("migrated")
                    attempt, upstream = opened
                    continue
            if continued is None:  # not continuable exactly: no attempt would change that
                self.metrics.continuation("unsupported")
            while (
                continued is not None and opened is None and continuations < self.max_continuations
            ):
                continuations += 1
                opened = await self.continue_stream(job, continued)
            if opened is None:
                self.metrics.continuation("gave_up")
                await exchange.write_chunk(error_frame("the instance serving this stream was lost"))
                exchange.end_stream()
                return "upstream_broke"
            self.metrics.continuation("continued")
            attempt, upstream = opened

    def _cache_reported(self, job: Job, data: bytes) -> None:
        """Hand the engine's own ``cached_tokens`` (when its answer names them) to the fleet's
        cache-truth check."""
        cached = cached_tokens_in(data)
        if cached is not None:
            self.fleet.cache_reported(job.key, job.request.model or "", cached)

    def _lost(self, job: Job, attempt: Attempt, moved_to: list[str]) -> None:
        """A stream that migrated broke at its destination: that is the instance lost, and the
        one it left handed it over cleanly (a candidate to continue on)."""
        lost = self.instance_at(moved_to[-1]) if moved_to else None
        if lost is not None and lost is not attempt.instance:
            job.tried.discard(attempt.instance.instance_id)
            job.tried.add(lost.instance_id)
            attempt.follow(lost)

    async def _pump(
        self,
        stream: AsyncIterator[bytes],
        ledger: StreamLedger,
        exchange: Exchange,
        response: UpstreamResponse,
        attempt: Attempt,
    ) -> None:
        """Relay `stream` to the client through `ledger`; raises `UpstreamError` if it breaks."""
        deadlines = self.deadlines
        instance_id = attempt.instance.instance_id
        last = 0.0
        async for data in stream:
            out = ledger.feed(data)
            if out:
                await exchange.write_chunk(out)
            now = time.monotonic()
            if last:
                deadlines.observe_gap(instance_id, now - last)
            last = now
            response.read_timeout = deadlines.inter_chunk(instance_id)
        if not ledger.complete():
            raise UpstreamError("the stream ended before its [DONE]")

    async def _follow_migrations(
        self, first: bytes, chunks: AsyncIterator[bytes] | None, job: Job, moved_to: list[str]
    ) -> AsyncGenerator[bytes, None]:
        """The upstream stream's bytes, continued at the destination each time the request
        migrates (each destination's URL appended to `moved_to`); the agents' migration notices
        are consumed here, never relayed."""
        resumed: UpstreamResponse | None = None
        try:
            while True:
                out, pending, notice = _split(first)
                if out:
                    yield out
                if not notice and chunks is not None:
                    async for chunk in chunks:
                        out, pending, notice = _split(pending + chunk if pending else chunk)
                        if out:
                            yield out
                        if notice:
                            break
                if not notice:
                    if pending:
                        yield pending
                    return
                if chunks is not None:
                    async for chunk in chunks:  # the notice's rest, up to the end of the stream
                        notice += chunk
                if resumed is not None:
                    resumed.close()
                with job.trace.span("kvherd.migration") as span:
                    resumed = await self._resume(
                        notice, job.request_id, moved_to, job.trace.headers(span)
                    )
                    span.set_attribute("kvherd.migrated_to", moved_to[-1])
                if self.fleet.migration is not None:
                    self.fleet.migration.metrics.reattached.inc()
                first, chunks = b"", resumed.iter_body()
        finally:
            if resumed is not None:
                resumed.close()

    def instance_at(self, url: str) -> FleetInstance | None:
        return next((i for i in self.fleet.instances.values() if i.url.rstrip("/") == url), None)

    async def _resume(
        self,
        notice: bytes,
        request_id: bytes,
        moved_to: list[str],
        traced: Sequence[tuple[bytes, bytes]] = (),  # the migration span's traceparent
    ) -> UpstreamResponse:
        """Open the destination's continuation of a migrated request's stream."""
        try:
            moved = wire.parse_migration_notice(notice)
            dst = str(moved["migrated_to"]).rstrip("/")
            rid = str(moved["request_id"])
            resume = orjson.dumps(moved["resume"])
        except (ValueError, KeyError, TypeError) as exc:
            raise UpstreamError(f"malformed migration notice: {exc}") from exc
        if self.instance_at(dst) is None:
            raise UpstreamError(f"request migrated to {dst}, which is not a fleet instance")
        moved_to.append(dst)
        headers = [
            (b"content-type", b"application/json"),
            (b"x-request-id", request_id),
            (b"x-kvherd-reattach", b"1"),
            (b"x-kvherd-token-ids", b"1"),  # the token ledger, as the stream went out
            *traced,
        ]
        if self.fleet_token:
            headers.append((b"authorization", b"Bearer " + self.fleet_token.encode()))
        path = f"/kvherd/v1/requests/{quote(rid, safe='')}/resume".encode()
        response = await self.pool.send(dst, b"POST", path, headers, resume)
        if response.status != 200 or not response.streaming:
            response.close()
            raise UpstreamError(f"{dst} did not resume {rid}: HTTP {response.status}")
        return response
