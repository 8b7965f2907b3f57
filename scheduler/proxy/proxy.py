"""The OpenAI-compatible reverse proxy (``kvherd serve``): route each request where it is cheapest.

Contract:
- Endpoints: ``POST /v1/completions`` and ``POST /v1/chat/completions`` (routed, forwarded, relayed;
  served straight from `scheduler.proxy.http_front`, other methods get 405),
  ``GET /v1/models`` (the fleet's models), ``GET /metrics`` (`scheduler.proxy.metrics`),
  ``GET /health`` (200 while at least one instance is dispatchable, else 503) through FastAPI.
- Per request: authenticate (`scheduler.core.tenancy`), parse the body, render the chat template and
  tokenize with the fleet tokenizer, hash full blocks with the tenant's salt, ask the scheduler core
  for an instance, forward the body unchanged except ``cache_salt`` (set to the tenant's salt when
  tenancy is on), and relay the response: JSON in one piece, SSE chunk by chunk as it arrives.
- ``X-Request-Id`` is taken from the client (or generated) and echoed back; instances get the
  fleet's own id for the request (`Fleet.new_key`), which is also its routing key.
  Which instance served is never revealed (the upstream ``server`` header is dropped) unless
  ``expose_instance`` is set, which adds ``X-Kvherd-Instance``.
- Failures: a connect error, a broken connection before the response head, a head timeout, a 5xx
  from the instance, or a stream that breaks before its first chunk is retried on another instance
  (never one already tried) while nothing has been sent to the client (the response head is held
  back until the first chunk), up to ``max_attempts`` in all; then the client gets a 502/504 error
  object.
- Continuation: after the first byte, a stream whose instance dies, hangs (no chunk within the
  inter-chunk deadline), resets or sends an error frame goes on elsewhere
  (`scheduler.proxy.continuation`): streamed requests go out with ``X-Kvherd-Token-Ids: 1`` (the
  agents' token ledger, stripped before relaying), and the proxy sends the original body plus
  ``kvherd_continuation`` (tokens and text the client has, sampling seed, resume object) to another
  kvherd agent, which recomputes and streams the rest of the same stream: no token lost or
  repeated, usage counting the original prompt and every generated token, bit-identical for
  greedy and seeded sampling. Streams to vLLM instances go out with ``return_token_ids`` (the
  ids the client did not ask for are relayed as vLLM's ``null``) and continue on another vLLM
  instance as a ``/v1/completions`` request for the prompt's token ids + the tokens sent, re-framed
  as the original stream (chat chunks for chat): exact for greedy decoding, unseeded sampling
  continues, seeded sampling and what else a continuation cannot reproduce ends with the error
  frame (`scheduler.proxy.continuation`). At most ``max_continuations`` attempts; then the
  client gets an OpenAI error frame and ``[DONE]``. Outcomes are counted in
  ``kvherd_continuations_total``.
- Deadlines (`scheduler.core.deadlines`): a streamed request's response head and first chunk must
  come within the instance's first-byte deadline, later chunks within its inter-chunk deadline;
  time the proxy's own loop was late is never counted (`scheduler.proxy.loop_lag`), and a connect
  timeout while that loop is saturated is no evidence against the instance. When an instance is
  ejected or removed, every request in flight there fails over at once (`UpstreamPool.abort`):
  retried when it had not started, continued when it had.
- Live migration: streamed requests go out with ``X-Kvherd-Reattach: 1``. When one migrates, its
  agent ends the stream with a notice frame ``data: {"kvherd": {"migrated_to": URL, "request_id",
  "resume"}}`` (never relayed); the proxy then POSTs ``resume`` to
  ``URL/kvherd/v1/requests/{id}/resume`` (a fleet instance only) and relays that stream from the
  next token on, as often as the request moves. Non-streamed requests are relayed by the source.
- P/D disaggregation (`scheduler.proxy.pd`): a request the fleet pairs with a decode instance
  goes to its prefill instance with ``X-Kvherd-Handoff: URL``; that agent streams the first token
  and hands the request over by live migration, which the reattachment above follows.
- Admission by expected wait (`scheduler.core.admission`): a new request is refused, before its
  body is even parsed, when the requests waiting ahead of it (the admission queue plus the
  instances' own queues) would take the fleet longer than the allowed wait to start, at the
  rate the fleet was measured to complete requests while busy (short of a measurement, at
  most one request per the busy time since its last completion): 429, ``Retry-After`` (whole
  seconds) and an OpenAI error object (``code: queue_wait``). The allowed wait is
  ``max_queue_wait_s`` for a burst and ``standing_queue_wait_s`` once the queue has not emptied
  for that long: so a flood leaves at most that much work queued, and normal service returns
  within about that long (plus a request's own time) of its end.
  An instance is saturated when the proxy has ``max_inflight_per_instance`` requests in flight on
  it (`scheduler.fleet.FleetSettings`). When every dispatchable instance is saturated a request
  waits in a FIFO admission queue of at most ``queue_size`` entries for up to
  ``queue_timeout_s``; past either bound it gets 429 (with ``Retry-After``) too. With no
  dispatchable instance at all it gets 503. Retries and continuations of admitted requests are
  never refused by the expected wait.
- Bounded work per request on the loop: bodies over `kvherd.wire.MAX_BODY_BYTES` (the agents' limit,
  `kvherd.wire`) are refused unread; a prompt longer than every instance's ``max_model_len`` (read
  from their ``/v1/models`` at start-up; unchecked while some instance did not say) gets vLLM's
  400 (``code: context_length_exceeded``) before it is hashed; bodies over
  `OFF_LOOP_BODY_BYTES` are parsed and tokenized, and prompts over `OFF_LOOP_TOKENS` hashed, in
  worker threads (two at a time), off the event loop.
- Bad input (not JSON, a Content-Type other than JSON, not an object, missing or mistyped
  prompt/messages, token ids past 2**32 - 1, an oversized body) gets 400 with ``{"error":
  {"message", "type", "param", "code"}}``, an unknown route 404 with the same object; nothing a
  client sends crashes the proxy. Validation beyond what routing needs is the instance's (its 400
  is relayed as is).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import time
from collections import deque
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote

import orjson
from fastapi import FastAPI
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvherd import wire
from kvherd.block_hash import block_hash_chain
from kvherd.tokenizer import Tokenizer
from kvherd.wire import OpenAIError
from scheduler.core.admission import Admission, AdmissionSettings, waiting_at
from scheduler.core.deadlines import Deadlines, DeadlineSettings
from scheduler.core.tenancy import Tenant, TenantRegistry
from scheduler.fleet import Fleet, FleetInstance, NoCapacityError
from scheduler.proxy import pd
from scheduler.proxy.continuation import Continued, StreamLedger, error_frame, with_token_ids
from scheduler.proxy.forwarding import (
    UpstreamConnectTimeout,
    UpstreamError,
    UpstreamPool,
    UpstreamResponse,
    UpstreamTimeout,
)
from scheduler.proxy.http_front import Exchange, FrontServer
from scheduler.proxy.loop_lag import LoopLag
from scheduler.proxy.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from scheduler.proxy.metrics import ProxyMetrics
from scheduler.proxy.routing_tokens import prompt_token_ids

log = logging.getLogger("kvherd.proxy")

_NOTICE = wire.NOTICE_PREFIX


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


# Bodies and prompts past these sizes are parsed, tokenized and hashed in a worker thread (at most
# `_OFF_LOOP_WORKERS` at once), so a few huge prompts cannot stall every other request on the loop.
OFF_LOOP_BODY_BYTES = 64 * 1024
OFF_LOOP_TOKENS = 16 * 1024
_OFF_LOOP_WORKERS = 2
# Client headers worth passing on; the body is always sent as JSON (it was parsed as JSON here).
_FORWARD_HEADERS = frozenset({b"accept", b"user-agent", b"openai-organization"})


@dataclass(slots=True)
class ProxyConfig:
    max_attempts: int = 3
    queue_size: int = 1024
    queue_timeout_s: float = 30.0
    connect_timeout_s: float = 2.0
    request_timeout_s: float = 600.0  # until the response head (whole request when not streamed)
    stream_idle_timeout_s: float = 300.0  # between streamed chunks
    expose_instance: bool = False
    max_body_bytes: int = wire.MAX_BODY_BYTES  # the agents' own: never forward what they refuse
    max_continuations: int = 2  # attempts to continue one stream whose instance was lost
    deadlines: DeadlineSettings = field(default_factory=DeadlineSettings)
    fleet_token: str | None = None  # the agents' control routes (resume) require it
    admission: AdmissionSettings = field(default_factory=AdmissionSettings)
    max_connections: int = 4096  # client connections the front server holds at once


class Refused(OpenAIError):
    """A 429 from admission: the error object plus when to come back (``Retry-After``)."""

    def __init__(self, message: str, code: str, retry_after_s: int) -> None:
        super().__init__(429, message, type="rate_limit_error", code=code)
        self.retry_after_s = retry_after_s


# How long the instances' queue lengths (from their views) are reused for admission decisions:
# they change by load reports, far more slowly than requests arrive.
_WAITING_TTL_S = 0.02


def _error_json(exc: OpenAIError) -> bytes:
    """The error object as the bytes the proxy sends (orjson: this is on the request path)."""
    return orjson.dumps(exc.body())


@dataclass(slots=True)
class _Admission:
    """FIFO of requests waiting for an instance to have room; woken as requests finish."""

    waiters: deque[asyncio.Future[None]] = field(default_factory=deque)

    def wake_one(self) -> None:
        while self.waiters:
            waiter = self.waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return


class Proxy:
    """The request path: one instance per ``kvherd serve`` process."""

    def __init__(
        self,
        fleet: Fleet,
        tokenizer: Tokenizer,
        tenants: TenantRegistry,
        config: ProxyConfig,
        metrics: ProxyMetrics,
    ) -> None:
        self.fleet = fleet
        self.tokenizer = tokenizer
        self.tenants = tenants
        self.config = config
        self.metrics = metrics
        self.lag = LoopLag()
        self.deadlines = Deadlines(config.deadlines)
        self.pool = UpstreamPool(
            connect_timeout=config.connect_timeout_s,
            head_timeout=config.request_timeout_s,
            read_timeout=config.stream_idle_timeout_s,
            lag=self.lag,
        )
        self._admission = _Admission()
        self.admission = Admission(config.admission)
        self._off_loop = asyncio.Semaphore(_OFF_LOOP_WORKERS)
        self._waiting = 0  # requests queued on the instances themselves, as of `_waiting_at`
        self._waiting_at = -1.0
        # Generated request ids: a random per-process prefix and a counter (cheaper than uuid4).
        self._id_prefix = os.urandom(6).hex().encode()
        self._id_counter = itertools.count(1)
        fleet.on_capacity = self._on_capacity
        fleet.on_lost = self._instance_lost
        fleet.prober.lag_owed = self.lag.owed  # a probe's timeout excludes the loop's lag too

    def _on_capacity(self) -> None:
        self._admission.wake_one()
        now = time.monotonic()
        self.admission.observe(now, self.fleet.completed, self._ahead(now))

    def _ahead(self, now: float) -> int:
        """Requests waiting to start: the admission queue and the instances' own queues."""
        if now - self._waiting_at > _WAITING_TTL_S:
            cluster = self.fleet.cluster
            waiting = 0
            for i in self.fleet.instances:
                if i in cluster:
                    waiting += waiting_at(cluster.get(i).view())
            self._waiting = waiting
            self._waiting_at = now
        return len(self._admission.waiters) + self._waiting

    def _check_wait(self) -> None:
        """Refuse a new request that would wait longer than the fleet allows (429)."""
        now = time.monotonic()
        ahead = self._ahead(now)
        self.admission.observe(now, self.fleet.completed, ahead)
        refused = self.admission.refusal(ahead)
        if refused is not None:
            self.metrics.rejected("queue_wait")
            raise Refused(
                f"the fleet is overloaded: a request would wait about "
                f"{refused.expected_wait_s:.1f}s to start (at most "
                f"{refused.limit_s:g}s allowed)",
                "queue_wait",
                refused.retry_after_s,
            )

    def _instance_lost(self, instance_id: str, url: str) -> None:
        failed = self.pool.abort(url, f"instance {instance_id} was ejected or removed")
        self.deadlines.forget(instance_id)
        if failed:
            log.warning("instance %s lost: failing over %d requests", instance_id, failed)

    def _failed(self, key: str, instance: FleetInstance, exc: UpstreamError) -> None:
        """Count a failed attempt against `instance`, unless the proxy's own lag caused it."""
        if isinstance(exc, UpstreamConnectTimeout) and self.lag.saturated():
            self.fleet.request_finished(key, instance, ok=False)
        else:
            self.fleet.request_failed(key, instance)

    # -- endpoints (`scheduler.proxy.http_front` handlers) --------------------------------------------
    async def completions(self, exchange: Exchange) -> None:
        await self._generate(exchange, b"/v1/completions", chat=False)

    async def chat_completions(self, exchange: Exchange) -> None:
        await self._generate(exchange, b"/v1/chat/completions", chat=True)

    # -- the request path -------------------------------------------------------------------------
    async def _generate(self, exchange: Exchange, path: bytes, chat: bool) -> None:
        request_id = b""
        auth: bytes | None = None
        json_body = True  # no Content-Type is read as JSON, as the agent (FastAPI) reads it
        forward: list[tuple[bytes, bytes]] = [(b"content-type", b"application/json")]
        for name, value in exchange.headers:
            if name == b"x-request-id":
                request_id = value[:128]
            elif name == b"authorization":
                auth = value
            elif name == b"content-type":
                json_body = _is_json_media_type(value)
            elif name in _FORWARD_HEADERS:
                forward.append((name, value))
        if not request_id:
            request_id = b"%s-%x" % (self._id_prefix, next(self._id_counter))
        status: int | str
        try:
            if exchange.method != b"POST":
                raise OpenAIError(405, "only POST is allowed here", code="method_not_allowed")
            tenant = self._authenticate(auth)
            if exchange.too_large:
                raise OpenAIError(
                    400,
                    f"request body exceeds {self.config.max_body_bytes} bytes",
                    code="too_large",
                )
            if not json_body:
                raise OpenAIError(
                    400,
                    "the body must be JSON (Content-Type: application/json)",
                    param="Content-Type",
                    code="unsupported_media_type",
                )
            self._check_wait()
            status = await self._serve(exchange, path, chat, request_id, tenant, forward)
        except OpenAIError as exc:
            status = exc.status
            _respond_error(exchange, exc, request_id)
        except asyncio.CancelledError:
            if not exchange.gone:
                raise  # the server is shutting down
            # The client went away; the upstream request was closed on the way out.
            task = asyncio.current_task()
            if task is not None:
                task.uncancel()
            status = "client_closed"
        except Exception:
            # A bug must cost one request, not the proxy; the client still gets an error object
            # (or, when the response had started, a closed connection).
            log.exception("request %s failed", request_id.decode("latin-1"))
            status = 500
            if not exchange.started:
                error = OpenAIError(500, "internal proxy error", type="server_error")
                _respond_error(exchange, error, request_id)
        self.metrics.request_done(status)

    def _authenticate(self, auth: bytes | None) -> Tenant | None:
        if not self.tenants.enabled:
            return None
        tenant = self.tenants.authenticate(auth)
        if tenant is None:
            raise OpenAIError(
                401,
                "invalid or missing API key",
                type="authentication_error",
                code="invalid_api_key",
            )
        return tenant

    async def _serve(
        self,
        exchange: Exchange,
        path: bytes,
        chat: bool,
        request_id: bytes,
        tenant: Tenant | None,
        headers: list[tuple[bytes, bytes]],
    ) -> int | str:
        started = time.perf_counter()
        raw = exchange.body
        if len(raw) > OFF_LOOP_BODY_BYTES:
            async with self._off_loop:
                body, token_ids = await asyncio.to_thread(self._parse, raw, chat)
        else:
            body, token_ids = self._parse(raw, chat)
        if tenant is not None:
            salt: str | None = tenant.cache_salt
            if body.get("cache_salt") != salt:
                body["cache_salt"] = salt
                raw = orjson.dumps(body)
        else:
            client_salt = body.get("cache_salt")
            if client_salt is not None and not isinstance(client_salt, str):
                raise OpenAIError(400, "'cache_salt' must be a string", param="cache_salt")
            salt = client_salt or None
        max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
        self._check_context(len(token_ids), max_tokens, chat)
        if len(token_ids) > OFF_LOOP_TOKENS:
            async with self._off_loop:
                block_hashes = await asyncio.to_thread(
                    block_hash_chain, token_ids, self.fleet.block_size, salt
                )
        else:
            block_hashes = block_hash_chain(token_ids, self.fleet.block_size, salt)
        self.metrics.prompt_blocks.observe(len(block_hashes))
        rid = request_id.decode("latin-1")
        key = self.fleet.new_key(rid)
        headers.append((b"x-request-id", key.encode()))
        streamed = body.get("stream") is True
        if streamed:
            headers.append((b"x-kvherd-reattach", b"1"))
            headers.append((b"x-kvherd-token-ids", b"1"))
        tried: set[str] = set()
        last_error: UpstreamError | None = None
        last_status: UpstreamResponse | None = None
        vllm_raw: bytes | None = None  # the body asking vLLM for its token ids (continuation)
        for attempt in range(self.config.max_attempts):
            instance = await self._admit(
                key, len(token_ids), block_hashes, tenant, max_tokens, tried, started
            )
            if instance is None:
                break
            if attempt:
                self.metrics.retries.inc()
            tried.add(instance.instance_id)
            first_byte = self._first_byte_deadline(instance) if streamed else None
            decode = self._handoff_target(key, max_tokens)
            if decode is None:
                sent = headers
            else:
                sent = [*headers, *pd.handoff_headers(decode.url, self.config.fleet_token)]
            payload = raw
            if streamed and not instance.spec.kvherd_agent:
                if vllm_raw is None:
                    asked = with_token_ids(body)
                    vllm_raw = raw if asked is None else orjson.dumps(asked)
                payload = vllm_raw
            try:
                response = await self.pool.send(
                    instance.url, b"POST", path, sent, payload, head_timeout=first_byte
                )
            except UpstreamError as exc:
                self._failed(key, instance, exc)
                last_error = exc
                log.warning("request %s: %s", rid, exc)
                continue
            except BaseException:
                self.fleet.request_finished(key, instance)
                raise
            if response.status >= 500:
                self.fleet.request_failed(key, instance)
                last_status = response
                response.close()
                continue
            chunks: AsyncIterator[bytes] | None = None
            first = b""
            if response.streaming:
                # Nothing reaches the client before the first chunk: an instance that dies during
                # prefill (after sending its stream headers) is still retried elsewhere.
                if first_byte is not None:
                    response.read_timeout = first_byte
                chunks = response.iter_body()
                if decode is not None:
                    chunks = pd.watch(chunks, self.fleet, self.metrics, key, decode.instance_id)
                try:
                    first = await anext(chunks, b"")
                except UpstreamError as exc:
                    self.fleet.request_failed(key, instance)
                    last_error = exc
                    log.warning("request %s: %s", rid, exc)
                    continue
                except BaseException:
                    response.close()
                    self.fleet.request_finished(key, instance)
                    raise
                if response.status == 200:
                    job = _Job(path, headers, body, len(token_ids), block_hashes, tenant,
                               max_tokens, tried, started)  # fmt: skip
                    return await self._relay_stream(
                        exchange, response, instance, key, request_id, chunks, first, job
                    )
            elif decode is not None:
                pd.take_outcome(response, self.fleet, self.metrics, key, decode.instance_id)
            return await self._relay(exchange, response, instance, key, request_id, chunks, first)
        if last_status is not None and last_status.body is not None:
            exchange.respond(last_status.status, _json_headers(request_id), last_status.body)
            return last_status.status
        if isinstance(last_error, UpstreamTimeout):
            raise OpenAIError(504, f"instance timed out: {last_error}", type="timeout_error")
        if last_error is not None or tried:
            raise OpenAIError(502, "no instance could serve the request", type="server_error")
        raise OpenAIError(503, "no instance is available", type="server_error")

    def _handoff_target(self, key: str, max_tokens: Any) -> FleetInstance | None:
        """The decode instance to hand `key` to after its first token (P/D), if any: none for a
        request that ends with its first token."""
        decode = self.fleet.handoff_target(key)
        if decode is None or (isinstance(max_tokens, int) and max_tokens <= 1):
            return None
        return decode

    def _parse(self, raw: bytes, chat: bool) -> tuple[dict[str, Any], list[int]]:
        """The body as JSON and the token ids it routes by (`OpenAIError` when it cannot be)."""
        try:
            body = orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            raise OpenAIError(
                400, f"request body is not valid JSON: {exc}", code="invalid_json"
            ) from exc
        if not isinstance(body, dict):
            raise OpenAIError(400, "request body must be a JSON object")
        return body, prompt_token_ids(body, chat, self.tokenizer)

    def _max_model_len(self) -> int | None:
        """The longest context some instance takes; None unless every instance said."""
        longest = 0
        for inst in self.fleet.instances.values():
            limit = inst.spec.max_model_len
            if limit is None:
                return None
            longest = max(longest, limit)
        return longest or None

    def _check_context(self, num_tokens: int, max_tokens: Any, chat: bool) -> None:
        """400, as vLLM words it, for a request no instance's context can hold."""
        limit = self._max_model_len()
        if limit is None:
            return
        budget = max_tokens if type(max_tokens) is int and max_tokens > 0 else 0
        if num_tokens + max(budget, 1) <= limit:
            return
        where = "messages" if chat else "prompt"
        if budget:
            detail = (
                f"you requested {num_tokens + budget} tokens ({num_tokens} in the {where}, "
                f"{budget} in the completion). Please reduce the length of the {where} or "
                "completion."
            )
        else:
            detail = (
                f"your {where} has {num_tokens} tokens. Please reduce the length of the {where}."
            )
        raise OpenAIError(
            400,
            f"This model's maximum context length is {limit} tokens. However, {detail}",
            param=where,
            code="context_length_exceeded",
        )

    async def _admit(
        self,
        key: str,
        num_tokens: int,
        block_hashes: list[int],
        tenant: Tenant | None,
        max_tokens: Any,
        tried: set[str],
        started: float,
    ) -> FleetInstance | None:
        """Choose an instance, waiting in the admission queue while every instance is saturated."""
        deadline: float | None = None
        while True:
            try:
                instance, matched = self.fleet.dispatch(
                    key,
                    num_tokens,
                    block_hashes,
                    tenant=None if tenant is None else tenant.name,
                    max_tokens=max_tokens if isinstance(max_tokens, int) else None,
                    exclude=tried,
                )
            except NoCapacityError as exc:
                if not exc.saturated:
                    return None  # nothing dispatchable (or everything already tried)
            else:
                if not tried:
                    if deadline is None:  # time spent queueing is not decision time
                        self.metrics.decision_seconds.observe(time.perf_counter() - started)
                    self.metrics.matched_blocks.observe(matched)
                return instance
            admission = self._admission
            if len(admission.waiters) >= self.config.queue_size:
                self.metrics.rejected("queue_full")
                raise Refused(
                    "every instance is saturated and the admission queue is full",
                    "queue_full",
                    self._retry_after(),
                )
            loop = asyncio.get_running_loop()
            if deadline is None:
                deadline = loop.time() + self.config.queue_timeout_s
            waiter: asyncio.Future[None] = loop.create_future()
            admission.waiters.append(waiter)
            self.metrics.queue_depth.set(len(admission.waiters))
            try:
                async with asyncio.timeout_at(deadline):
                    await waiter
            except TimeoutError:
                self.metrics.rejected("queue_timeout")
                raise Refused(
                    f"no instance had room within {self.config.queue_timeout_s}s",
                    "queue_timeout",
                    self._retry_after(),
                ) from None
            finally:
                with contextlib.suppress(ValueError):
                    admission.waiters.remove(waiter)
                self.metrics.queue_depth.set(len(admission.waiters))

    def _retry_after(self) -> int:
        """Whole seconds until the queue ahead is expected to have drained (at least 1)."""
        wait = self.admission.expected_wait(self._ahead(time.monotonic()))
        cap = self.config.admission.max_retry_after_s
        if wait is None or wait < 1:
            return 1
        return cap if wait >= cap else int(wait) + 1

    async def _relay(
        self,
        exchange: Exchange,
        response: UpstreamResponse,
        instance: FleetInstance,
        key: str,
        request_id: bytes,
        chunks: AsyncIterator[bytes] | None,
        first: bytes,
    ) -> int | str:
        headers = [h for h in response.headers if h[0] != b"x-request-id"]
        headers.append((b"x-request-id", request_id))
        if self.config.expose_instance:
            headers.append((b"x-kvherd-instance", instance.instance_id.encode()))
        ok = response.status < 400
        if chunks is None:
            try:
                exchange.respond(response.status, headers, response.body or b"")
            finally:
                self.fleet.request_finished(key, instance, ok=ok)
            return response.status
        self.fleet.first_token(key)
        stream = self._follow_migrations(first, chunks, request_id, [])
        try:
            exchange.start_stream(response.status, headers)
            async for chunk in stream:
                await exchange.write_chunk(chunk)
            exchange.end_stream()
        except UpstreamError as exc:
            log.warning("request %s: stream from %s broke: %s", key, instance.instance_id, exc)
            self.fleet.request_failed(key, instance)
            return "upstream_broke"
        except BaseException:
            response.close()
            await stream.aclose()  # closes a resumed upstream too: the instance aborts
            self.fleet.request_finished(key, instance, ok=ok)
            raise
        self.fleet.request_finished(key, instance, ok=ok)
        return response.status

    def _first_byte_deadline(self, instance: FleetInstance) -> float:
        waiting = self.fleet.cluster.get(instance.instance_id).report.num_waiting
        return self.deadlines.first_byte(instance.instance_id, waiting or 0)

    async def _relay_stream(
        self,
        exchange: Exchange,
        response: UpstreamResponse,
        instance: FleetInstance,
        key: str,
        request_id: bytes,
        chunks: AsyncIterator[bytes],
        first: bytes,
        job: _Job,
    ) -> int | str:
        """Relay a stream, continuing it on other instances while its instance is lost."""
        headers = [h for h in response.headers if h[0] != b"x-request-id"]
        headers.append((b"x-request-id", request_id))
        if self.config.expose_instance:
            headers.append((b"x-kvherd-instance", instance.instance_id.encode()))
        self.fleet.first_token(key)
        if instance.spec.kvherd_agent:
            ledger = StreamLedger()
        else:
            chat = job.path == b"/v1/chat/completions"
            ledger = StreamLedger.from_vllm(job.body, chat, self.tokenizer.decode)
        exchange.start_stream(response.status, headers)
        attempts = 0
        while True:
            moved_to: list[str] = []  # the destinations this stream followed (migrations)
            stream = self._follow_migrations(first, chunks, request_id, moved_to)
            try:
                await self._pump(stream, ledger, exchange, response, instance.instance_id)
            except UpstreamError as exc:
                response.close()
                await stream.aclose()
                # A stream that migrated broke at its destination: that is the instance lost,
                # and the one it left handed it over cleanly (a candidate to continue on).
                lost = self._instance_at(moved_to[-1]) if moved_to else None
                if lost is not None and lost is not instance:
                    job.tried.discard(instance.instance_id)
                    job.tried.add(lost.instance_id)
                    instance = lost
                log.warning("request %s: stream from %s broke: %s", key, instance.instance_id, exc)
                self._failed(key, instance, exc)
            except BaseException:
                response.close()
                await stream.aclose()  # closes a resumed upstream too: the instance aborts
                self.fleet.request_finished(key, instance)
                raise
            else:
                self.fleet.request_finished(key, instance)
                exchange.end_stream()
                return response.status
            if ledger.finished:  # only the end was lost
                self.metrics.continuation("finished")
                await exchange.write_chunk(ledger.closing_frames())
                exchange.end_stream()
                return response.status
            opened = None
            continued = ledger.continuation(job.body)
            if continued is None:  # not continuable exactly: no attempt would change that
                self.metrics.continuation("unsupported")
            limit = self.config.max_continuations
            while continued is not None and opened is None and attempts < limit:
                attempts += 1
                opened = await self._continue(continued, job, key)
            if opened is None:
                self.metrics.continuation("gave_up")
                await exchange.write_chunk(error_frame("the instance serving this stream was lost"))
                exchange.end_stream()
                return "upstream_broke"
            self.metrics.continuation("continued")
            instance, response, chunks, first = opened

    async def _pump(
        self,
        stream: AsyncIterator[bytes],
        ledger: StreamLedger,
        exchange: Exchange,
        response: UpstreamResponse,
        instance_id: str,
    ) -> None:
        """Relay `stream` to the client through `ledger`; raises `UpstreamError` if it breaks."""
        deadlines = self.deadlines
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

    async def _continue(
        self, continued: Continued, job: _Job, key: str
    ) -> tuple[FleetInstance, UpstreamResponse, AsyncIterator[bytes], bytes] | None:
        """One attempt to open the rest of the stream (`continued`) on another instance of its
        kind (a kvherd agent for an agent's stream, vLLM for vLLM's)."""
        done = continued.done
        exclude = job.tried | {
            i
            for i, inst in self.fleet.instances.items()
            if inst.spec.kvherd_agent != continued.on_agent
        }
        max_tokens = job.max_tokens - done if isinstance(job.max_tokens, int) else None
        try:
            instance = await self._admit(
                key, job.num_tokens + done, job.block_hashes, job.tenant, max_tokens, exclude,
                job.started,
            )  # fmt: skip
        except OpenAIError:
            instance = None
        if instance is None:
            self.metrics.continuation("failed")
            return None
        job.tried.add(instance.instance_id)
        first_byte = self._first_byte_deadline(instance)
        try:
            body = orjson.dumps(continued.body)
            path = continued.path or job.path
            response = await self.pool.send(
                instance.url, b"POST", path, job.headers, body, first_byte
            )
            if response.status != 200 or not response.streaming:
                response.close()
                raise UpstreamError(f"continuation refused: HTTP {response.status}")
            response.read_timeout = first_byte
            chunks = response.iter_body()
            first = await anext(chunks, b"")
        except UpstreamError as exc:
            log.warning("request %s: continuation on %s failed: %s", key, instance.instance_id, exc)
            self._failed(key, instance, exc)
            self.metrics.continuation("failed")
            return None
        except BaseException:
            self.fleet.request_finished(key, instance)
            raise
        log.info("request %s continues on %s after %d tokens", key, instance.instance_id, done)
        self.fleet.first_token(key)
        return instance, response, chunks, first

    async def _follow_migrations(
        self, first: bytes, chunks: AsyncIterator[bytes], request_id: bytes, moved_to: list[str]
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
                if not notice:
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
                async for chunk in chunks:  # the notice's rest, up to the end of the stream
                    notice += chunk
                if resumed is not None:
                    resumed.close()
                resumed = await self._resume(notice, request_id, moved_to)
                if self.fleet.migration is not None:
                    self.fleet.migration.metrics.reattached.inc()
                first, chunks = b"", resumed.iter_body()
        finally:
            if resumed is not None:
                resumed.close()

    def _instance_at(self, url: str) -> FleetInstance | None:
        return next((i for i in self.fleet.instances.values() if i.url.rstrip("/") == url), None)

    async def _resume(
        self, notice: bytes, request_id: bytes, moved_to: list[str]
    ) -> UpstreamResponse:
        """Open the destination's continuation of a migrated request's stream."""
        try:
            moved = wire.parse_migration_notice(notice)
            dst = str(moved["migrated_to"]).rstrip("/")
            rid = str(moved["request_id"])
            resume = orjson.dumps(moved["resume"])
        except (ValueError, KeyError, TypeError) as exc:
            raise UpstreamError(f"malformed migration notice: {exc}") from exc
        if self._instance_at(dst) is None:
            raise UpstreamError(f"request migrated to {dst}, which is not a fleet instance")
        moved_to.append(dst)
        headers = [
            (b"content-type", b"application/json"),
            (b"x-request-id", request_id),
            (b"x-kvherd-reattach", b"1"),
        ]
        if self.config.fleet_token:
            headers.append((b"authorization", b"Bearer " + self.config.fleet_token.encode()))
        path = f"/kvherd/v1/requests/{quote(rid, safe='')}/resume".encode()
        response = await self.pool.send(dst, b"POST", path, headers, resume)
        if response.status != 200 or not response.streaming:
            response.close()
            raise UpstreamError(f"{dst} did not resume {rid}: HTTP {response.status}")
        return response


@dataclass(slots=True)
class _Job:
    """What continuing a stream elsewhere needs of its original request."""

    path: bytes
    headers: list[tuple[bytes, bytes]]
    body: dict[str, Any]
    num_tokens: int
    block_hashes: list[int]
    tenant: Tenant | None
    max_tokens: Any
    tried: set[str]
    started: float


def _is_json_media_type(content_type: bytes) -> bool:
    """``application/json`` or ``application/*+json``, parameters aside (FastAPI's rule)."""
    media = content_type.split(b";", 1)[0].strip().lower()
    return media == b"application/json" or (
        media.startswith(b"application/") and media.endswith(b"+json")
    )


def _json_headers(request_id: bytes) -> list[tuple[bytes, bytes]]:
    return [(b"content-type", b"application/json"), (b"x-request-id", request_id)]


def _respond_error(exchange: Exchange, exc: OpenAIError, request_id: bytes) -> None:
    headers = _json_headers(request_id)
    if exc.status == 405:
        headers.append((b"allow", b"POST"))
    elif isinstance(exc, Refused):
        headers.append((b"retry-after", b"%d" % exc.retry_after_s))
    exchange.respond(exc.status, headers, _error_json(exc))


def build_front(proxy: Proxy) -> FrontServer:
    """What ``kvherd serve`` serves on its client port: the two generation routes straight from
    the HTTP server (FastAPI's routing and ASGI cycle cost as much CPU as a routing decision),
    the rest through FastAPI."""
    return FrontServer(
        {b"/v1/completions": proxy.completions, b"/v1/chat/completions": proxy.chat_completions},
        build_app(proxy),
        proxy.config.max_body_bytes,
        max_connections=proxy.config.max_connections,
    )


def build_app(proxy: Proxy) -> FastAPI:
    """The proxy's FastAPI app for the client port's control routes."""
    app = FastAPI(title="kvherd proxy", docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Any, exc: StarletteHTTPException) -> Response:
        # Unknown routes and methods get the OpenAI error object too, not FastAPI's {"detail"}.
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        error = OpenAIError(exc.status_code, str(exc.detail), type=kind)
        return Response(
            _error_json(error),
            status_code=exc.status_code,
            headers=exc.headers,
            media_type="application/json",
        )

    @app.get("/v1/models")
    async def models() -> Response:
        data = [
            {"id": name, "object": "model", "created": 0, "owned_by": "kvherd"}
            for name in proxy.fleet.models()
        ]
        return Response(
            orjson.dumps({"object": "list", "data": data}), media_type="application/json"
        )

    @app.get("/health")
    async def health() -> Response:
        if proxy.fleet.num_dispatchable() > 0:
            return Response(b"", status_code=200)
        return Response(
            _error_json(OpenAIError(503, "no dispatchable instance", type="server_error")),
            status_code=503,
            media_type="application/json",
        )

    @app.get("/metrics")
    async def metrics() -> Response:
        proxy.metrics.set_instance_states(proxy.fleet.state_counts())
        proxy.metrics.set_instance_roles(proxy.fleet.roles())
        return Response(proxy.metrics.render(), media_type=METRICS_CONTENT_TYPE)

    return app
