"""The OpenAI-compatible reverse proxy (``kvherd serve``): each request through its parts, in order.

Contract (the whole story, with every failure path: `scheduler/proxy/README.md`):
- ``POST /v1/completions`` and ``/v1/chat/completions`` are served straight from
  `scheduler.proxy.http_front` (other methods 405); ``GET /v1/models``, ``/metrics`` and ``/health``
  (200 while some instance is dispatchable, else 503) through FastAPI.
- A request passes once through each part: its headers and tenant (401 for a bad API key), admission
  (`admission_gate`: 429 with ``Retry-After``), its body read into a `routed_request.RoutedRequest`
  (400 with the OpenAI error object), then attempts (`attempt`), the first and the retries on
  another instance while nothing reached the client (``max_attempts`` in all; then 502/504, or 503
  with no instance at all), the one that answers relayed by `relay` (JSON, or SSE following
  migrations and continuing a lost stream through `Proxy.continue_stream`).
- Models: a request goes only to the instances serving its ``model`` (`routed_request`: 404 as
  vLLM for a model nobody serves); an adapter nobody serves yet is loaded first where
  ``--lora-load-on-demand`` allows it (`lora_loader`). ``GET /v1/models`` lists the fleet's models
  and adapters as vLLM does (base models, then adapters with their ``parent``).
- The proxy is the fleet's listener: freed capacity wakes the admission queue; a lost instance
  fails over every request in flight there at once. A bug costs one request (a 500 error object).
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import logging
import os
import time
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import orjson
from fastapi import FastAPI
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvherd import wire
from kvherd.kv_pull import PULL_HEADER, PULL_OUTCOME_HEADER, PullAsk, parse_outcome
from kvherd.wire import OpenAIError
from scheduler.core.admission import AdmissionSettings
from scheduler.core.admission_queue import QueueSettings
from scheduler.core.deadlines import Deadlines, DeadlineSettings
from scheduler.core.door import DoorSettings
from scheduler.core.tenancy import Tenant, TenantRegistry
from scheduler.fleet import Fleet, FleetInstance
from scheduler.forwarding import UpstreamError, UpstreamPool, UpstreamTimeout
from scheduler.loop_lag import LoopLag
from scheduler.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from scheduler.metrics import ProxyMetrics
from scheduler.proxy import pd
from scheduler.proxy.admission_gate import AdmissionGate, Refused
from scheduler.proxy.attempt import Attempt, Upstream, UpstreamStatus
from scheduler.proxy.continuation import Continued, with_token_ids
from scheduler.proxy.door_gate import DoorGate
from scheduler.proxy.http_front import Exchange, FrontServer
from scheduler.proxy.lora_loader import LoraLoader
from scheduler.proxy.model_tokenizers import ModelTokenizers
from scheduler.proxy.rate_gate import Lease, RateGate
from scheduler.proxy.relay import Job, Relay
from scheduler.proxy.routed_request import (
    RequestReader,
    RoutedRequest,
    parse_priority_header,
    parse_slo_header,
    resolve_priority,
)
from scheduler.proxy.untraced import UNTRACED, Trace

if TYPE_CHECKING:
    from scheduler.proxy.tracing import Tracing

_PULL_OUTCOME = PULL_OUTCOME_HEADER.encode()

log = logging.getLogger("kvherd.proxy")

# Client headers worth passing on; the body is always sent as JSON (it was parsed as JSON here).
_FORWARD_HEADERS = frozenset({b"accept", b"user-agent", b"openai-organization"})


@dataclass(slots=True)
class ProxyConfig:
    max_attempts: int = 3
    queue: QueueSettings = field(default_factory=QueueSettings)
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
    door: DoorSettings | None = None  # None: no door (``kvherd serve --door``)


class Proxy:
    """The request path: one instance per ``kvherd serve`` process."""

    def __init__(
        self,
        fleet: Fleet,
        tokenizers: ModelTokenizers,
        tenants: TenantRegistry,
        config: ProxyConfig,
        metrics: ProxyMetrics,
        lag: LoopLag | None = None,
        lora: LoraLoader | None = None,
        tracing: Tracing | None = None,
    ) -> None:
        self.fleet = fleet
        self.tracing = tracing  # None: off (`scheduler.proxy.tracing`)
        self.lora = lora
        self.tokenizers = tokenizers
        self.tenants = tenants
        self.config = config
        self.metrics = metrics
        self.lag = lag or LoopLag()
        self.deadlines = Deadlines(config.deadlines)
        self.pool = UpstreamPool(
            connect_timeout=config.connect_timeout_s,
            head_timeout=config.request_timeout_s,
            read_timeout=config.stream_idle_timeout_s,
            lag=self.lag,
        )
        loadable = {} if lora is None else {m.name: m.base for m in lora.modules.values()}
        self.reader = RequestReader(fleet, tokenizers, loadable)
        self.admission = AdmissionGate(
            fleet, config.admission, config.queue, metrics, tenants.weight
        )
        self.limits = RateGate(tenants, metrics)
        self.door = DoorGate(tenants, self.admission, metrics, config.door)
        self.relay = Relay(
            fleet, self.pool, self.deadlines, metrics, self.continue_stream,
            max_continuations=config.max_continuations,
            expose_instance=config.expose_instance,
            fleet_token=config.fleet_token,
        )  # fmt: skip
        # Generated request ids: a random per-process prefix and a counter (cheaper than uuid4).
        self._id_prefix = os.urandom(6).hex().encode()
        self._id_counter = itertools.count(1)
        fleet.subscribe(self)

    # -- the fleet's listener (`scheduler.fleet.FleetListener`) --------------------------------
    def capacity_freed(self) -> None:
        self.admission.capacity_freed()

    def instance_lost(self, instance_id: str, url: str) -> None:
        self.admission.instance_lost()
        failed = self.pool.abort(url, f"instance {instance_id} was ejected or removed")
        self.deadlines.forget(instance_id)
        if failed:
            log.warning("instance %s lost: failing over %d requests", instance_id, failed)

    # -- endpoints (`scheduler.proxy.http_front` handlers) --------------------------------------------
    async def completions(self, exchange: Exchange) -> None:
        await self._generate(exchange, b"/v1/completions", chat=False)

    async def chat_completions(self, exchange: Exchange) -> None:
        await self._generate(exchange, b"/v1/chat/completions", chat=True)

    # -- the request path -------------------------------------------------------------------------
    async def _generate(self, exchange: Exchange, path: bytes, chat: bool) -> None:
        request_id = b""
        auth: bytes | None = None
        priority: bytes | None = None
        slo: bytes | None = None
        tenant_name: str | None = None
        klass = 0
        admitted = False  # by `admission.check`: `admission.finished` when it ends
        lease: Lease | None = None  # a limited tenant's: settled or given back when it ends
        traceparent: bytes | None = None
        tracestate: bytes | None = None
        json_body = True  # no Content-Type is read as JSON, as the agent (FastAPI) reads it
        forward: list[tuple[bytes, bytes]] = [(b"content-type", b"application/json")]
        for name, value in exchange.headers:
            if name == b"x-request-id":
                request_id = value[:128]
            elif name == b"authorization":
                auth = value
            elif name == b"x-kvherd-priority":
                priority = value
            elif name == b"x-kvherd-slo-ttft-ms":
                slo = value
            elif name == b"content-type":
                json_body = _is_json_media_type(value)
            elif name in _FORWARD_HEADERS:
                forward.append((name, value))
            elif name == b"traceparent":
                traceparent = value
            elif name == b"tracestate":
                tracestate = value
        if not request_id:
            request_id = b"%s-%x" % (self._id_prefix, next(self._id_counter))
        trace: Trace = UNTRACED
        if self.tracing is not None:  # the attempts send their own traceparent
            trace = self.tracing.request(path, request_id, traceparent, tracestate)
        elif traceparent is not None:  # off: the client's trace goes on to the instances
            forward.append((b"traceparent", traceparent))
            if tracestate is not None:
                forward.append((b"tracestate", tracestate))
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
            asked = None if priority is None else parse_priority_header(priority)
            slo_ttft_s = None if slo is None else parse_slo_header(slo)
            tenant_name = None if tenant is None else tenant.name
            klass = resolve_priority(asked, tenant)
            with trace.span("kvherd.admission", **{"kvherd.priority": klass}) as span:
                if tenant_name is not None:
                    span.set_attribute("kvherd.tenant", tenant_name)
                lease = self.limits.admit(tenant_name)
                self.admission.check(tenant_name, klass)
            admitted = True
            self.door.admitted(tenant_name, klass)
            started = time.perf_counter()
            request = await self.reader.read(exchange.body, path, chat, tenant, asked)
            if "kv_transfer_params" in request.body:
                request = self._kv_transfer_params_checked(request)
            if lease is not None:
                lease.reserve(request.num_tokens, request.max_new_tokens)
            if request.lora_load is not None and self.lora is not None:
                request = await self.lora.ensure(request)
            status = await self._serve(
                exchange, request, request_id, forward, started, lease, trace, slo_ttft_s
            )
        except OpenAIError as exc:
            status = exc.status
            if lease is not None:  # the proxy's own answer: nothing of it was served
                lease.give_back()
            if isinstance(exc, Refused):
                self.door.refused(tenant_name, klass, exc)
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
        if admitted:
            self.admission.finished(tenant_name)
        if lease is not None:
            lease.settle(None)  # a no-op when settled by `_serve` or given back
        trace.end(status)
        self.metrics.request_done(status)

    def _kv_transfer_params_checked(self, request: RoutedRequest) -> RoutedRequest:
        """`request` without the client's ``kv_transfer_params`` unless its tenant may send them
        (``kv_transfer_params=allow``): they make vLLM's KV connector load KV from the peer they
        name. The proxy's own pull asks are added later (`_with_vllm_pull`)."""
        if request.tenant is not None and request.tenant.options.kv_transfer_params:
            return request
        self.metrics.kv_transfer_params_stripped.inc()
        body = {k: v for k, v in request.body.items() if k != "kv_transfer_params"}
        return replace(request, body=body, raw=orjson.dumps(body))

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
        request: RoutedRequest,
        request_id: bytes,
        headers: list[tuple[bytes, bytes]],
        started: float,
        lease: Lease | None = None,
        trace: Trace = UNTRACED,
        slo_ttft_s: float | None = None,
    ) -> int | str:
        """The first attempt and the retries, until one instance answers; a limited tenant's
        `lease` settled with the output tokens counted when the answer was relayed."""
        self.metrics.prompt_blocks.observe(len(request.block_hashes))
        key = self.fleet.new_key(request_id.decode("latin-1"))
        headers.append((b"x-request-id", key.encode()))
        if request.streamed:
            headers.append((b"x-kvherd-reattach", b"1"))
            headers.append((b"x-kvherd-token-ids", b"1"))
        job = Job(
            key, request_id, request, headers, set(), started, trace=trace, slo_ttft_s=slo_ttft_s
        )
        if lease is not None:
            job.reply_headers = lease.headers()
            job.count_output = True
        last_error: UpstreamError | None = None
        last_status: UpstreamStatus | None = None  # a 5xx, relayed if no instance answers
        vllm_raw: bytes | None = None  # the body asking vLLM for its token ids (continuation)
        for attempt_no in range(self.config.max_attempts):
            attempt = await self._dispatch(job, request.num_tokens, request.max_new_tokens)
            if attempt is None:
                break
            if attempt_no:
                self.metrics.retries.inc()
            instance = attempt.instance
            first_byte = self._first_byte_deadline(instance) if request.streamed else None
            decode = self._handoff_target(key, request.max_tokens)
            sent = headers
            watch = None
            handoff = None  # an agent's handoff of this attempt to `decode`
            vllm_decode = None  # a vLLM decode instance this vLLM prefill hands the request to
            if decode is not None and not instance.spec.kvherd_agent:
                vllm_decode, decode = decode, None
            elif decode is not None:
                sent = [*headers, *pd.handoff_headers(decode.url, self.config.fleet_token)]
                handoff = pd.HandoffOutcome(self.fleet, self.metrics, key, decode.instance_id)
                watch = functools.partial(pd.watch, handoff=handoff)

            payload = request.raw
            if request.streamed and not instance.spec.kvherd_agent:
                if vllm_raw is None:
                    asked = with_token_ids(request.body)
                    vllm_raw = request.raw if asked is None else orjson.dumps(asked)
                payload = vllm_raw
            pull = self.fleet.pull_for(key)
            if pull is not None and instance.spec.kvherd_agent:  # blocks land before prefill
                sent = [*sent, (PULL_HEADER.encode(), PullAsk(*pull).header().encode())]
                if self.config.fleet_token and decode is None:  # a handoff sent it already
                    sent.append((b"authorization", b"Bearer " + self.config.fleet_token.encode()))
            elif pull is not None:  # a vLLM with kvherd's connector: asked in the body
                address, num_blocks = pull
                payload = _with_vllm_pull(payload, address, num_blocks * request.block_size)
            with trace.span(
                "kvherd.attempt",
                **{"kvherd.attempt": attempt_no, "kvherd.instance": instance.instance_id},
            ) as span:
                if decode is not None:
                    span.add_event("kvherd.handoff", {"kvherd.decode": decode.instance_id})
                sent = [*sent, *trace.headers(span)]
                outcome = await self._attempt(
                    exchange, job, attempt, sent, payload, first_byte, watch, pull, handoff,
                    vllm_decode,
                )  # fmt: skip
                trace.outcome(span, outcome)
            if isinstance(outcome, UpstreamStatus):
                last_status = outcome
                continue
            if isinstance(outcome, UpstreamError):
                last_error = outcome
                log.warning("request %s: %s", key, outcome)
                continue
            if lease is not None:
                lease.settle(job.output_tokens)
            return outcome
        if last_status is not None and last_status.response.body is not None:
            status, body = last_status.response.status, last_status.response.body
            if lease is not None:  # no instance served it
                lease.give_back()
            exchange.respond(status, _json_headers(request_id), body)
            return status
        if isinstance(last_error, UpstreamTimeout):
            raise OpenAIError(504, f"instance timed out: {last_error}", type="timeout_error")
        if last_error is not None or last_status is not None or job.tried:
            raise OpenAIError(502, "no instance could serve the request", type="server_error")
        raise OpenAIError(503, "no instance is available", type="server_error")

    async def _attempt(
        self,
        exchange: Exchange,
        job: Job,
        attempt: Attempt,
        sent: list[tuple[bytes, bytes]],
        payload: bytes,
        first_byte: float | None,
        watch: Any,
        pull: tuple[str, int] | None,
        handoff: pd.HandoffOutcome | None,
        vllm_decode: FleetInstance | None,
    ) -> int | str | UpstreamError:
        """One attempt opened and, when it answers, relayed: the status relayed, or the error
        to retry after (`UpstreamStatus` for a 5xx). With `vllm_decode`, the prefill runs here
        first and the request then goes to that vLLM decode instance (`_prefill_on_vllm`)."""
        try:
            if vllm_decode is not None:
                source = await self._prefill_on_vllm(job, attempt, vllm_decode)
                if source is not None:
                    payload = _with_vllm_pull(payload, source, None)
                    if job.request.streamed:
                        first_byte = self._first_byte_deadline(attempt.instance)
            upstream = await attempt.open(
                self.pool, job.request.path, sent, payload, first_byte, watch
            )
        except UpstreamError as exc:  # UpstreamStatus too
            return exc
        if pull is not None:
            self._note_pull(upstream.response.headers)
        if upstream.chunks is not None and upstream.response.status == 200:
            return await self.relay.stream(exchange, job, attempt, upstream)
        if handoff is not None and upstream.chunks is None:
            pd.take_outcome(upstream.response, handoff)
        return await self.relay.plain(exchange, job, attempt, upstream)

    async def _dispatch(
        self,
        job: Job,
        num_tokens: int,
        max_tokens: int | None,
        exclude: set[str] | None = None,
        only: frozenset[str] | None = None,
    ) -> Attempt | None:
        """An attempt on the instance the fleet chooses (among `only`, when given, else those
        serving the request's model; waiting for room in the admission queue), or None when no
        instance is left to try."""
        request = job.request
        dispatching = self.admission.dispatch(
            job.key,
            num_tokens,
            request.block_hashes,
            None if request.tenant is None else request.tenant.name,
            max_tokens,
            job.tried if exclude is None else exclude,
            request.priority,
            request.only if only is None else only,
            request.adapter,
            request.block_size,
            job.slo_ttft_s,
        )
        with job.trace.span("kvherd.route", **{"kvherd.prompt_tokens": num_tokens}) as span:
            chosen = await dispatching
            if chosen is not None:
                job.trace.route(span, chosen, self.fleet.last_routed)
        if chosen is None:
            return None
        instance, matched, queued = chosen
        spec = instance.spec
        fleet = self.fleet
        if (
            spec.pull_address
            and not spec.kvherd_agent
            and not request.keyed
            and fleet.settings.handover
        ):
            fleet.prompts.note(request.block_hashes, request.token_ids, request.block_size)
        if not job.tried:
            if not queued:  # time spent queueing is not decision time
                self.metrics.decision_seconds.observe(time.perf_counter() - job.started)
            self.metrics.matched_blocks.observe(matched)
            self.metrics.model_routed(
                request.model or "", len(request.block_hashes), matched, queued
            )
        job.tried.add(instance.instance_id)
        return Attempt(self.fleet, self.lag, job.key, instance)

    async def continue_stream(
        self, job: Job, continued: Continued, on: str | None = None, pull_from: str | None = None
    ) -> tuple[Attempt, Upstream] | None:
        """One attempt to open the rest of the stream (`continued`) on another instance of its
        kind (a kvherd agent for an agent's stream, vLLM for vLLM's), or on instance `on` (a
        migration: `scheduler.proxy.stream_cuts`), whose kvherd connector pulls the stream's
        full blocks from `pull_from` first."""
        done = continued.done
        exclude = {
            i
            for i, inst in self.fleet.instances.items()
            if inst.spec.kvherd_agent != continued.on_agent
        }
        only = None
        if on is None:
            exclude |= job.tried
        else:
            allowed = job.request.only
            only = frozenset({on}) if allowed is None or on in allowed else frozenset()
        max_tokens = job.request.max_tokens
        left = max_tokens - done if isinstance(max_tokens, int) else None
        with job.trace.span("kvherd.continuation", **{"kvherd.tokens_done": done}) as span:
            opened = await self._continue(
                job, continued, exclude, left, only, pull_from, job.trace.headers(span)
            )
            span.set_attribute("kvherd.continued", opened is not None)
            if opened is not None:
                span.set_attribute("kvherd.instance", opened[0].instance.instance_id)
            return opened

    async def _continue(
        self,
        job: Job,
        continued: Continued,
        exclude: set[str],
        left: int | None,
        only: frozenset[str] | None,
        pull_from: str | None,
        traced: list[tuple[bytes, bytes]] | None = None,
    ) -> tuple[Attempt, Upstream] | None:
        done = continued.done
        try:
            attempt = await self._dispatch(job, job.request.num_tokens + done, left, exclude, only)
        except OpenAIError:
            attempt = None
        if attempt is None:
            self.metrics.continuation("failed")
            return None
        instance = attempt.instance
        first_byte = self._first_byte_deadline(instance)
        body = orjson.dumps(continued.body)
        if pull_from is not None:
            body = _with_vllm_pull(body, pull_from, None)
        path = continued.path or job.request.path
        try:
            sent = job.headers if traced is None else [*job.headers, *traced]
            upstream = await attempt.open(self.pool, path, sent, body, first_byte)
            if upstream.response.status != 200 or upstream.chunks is None:
                upstream.response.close()
                error = UpstreamError(f"continuation refused: HTTP {upstream.response.status}")
                attempt.fail(error)
                raise error
        except UpstreamError as exc:
            log.warning(
                "request %s: continuation on %s failed: %s", job.key, instance.instance_id, exc
            )
            self.metrics.continuation("failed")
            return None
        log.info("request %s continues on %s after %d tokens", job.key, instance.instance_id, done)
        self.fleet.first_token(job.key)
        return attempt, upstream

    def _first_byte_deadline(self, instance: FleetInstance) -> float:
        waiting = self.fleet.cluster.get(instance.instance_id).report.num_waiting
        return self.deadlines.first_byte(instance.instance_id, waiting or 0)

    async def _prefill_on_vllm(
        self, job: Job, attempt: Attempt, decode: FleetInstance
    ) -> str | None:
        """P/D between two vLLM servers running kvherd's connector (`scheduler.proxy.pd`): the
        prefill here, then the attempt follows the request to `decode`; the prefill instance's
        block server to pull from, or None (it decodes here: no block server, or the prefill was
        refused). Raises `UpstreamError` when the prefill instance failed (the caller retries)."""
        prefill = attempt.instance
        address = prefill.spec.pull_address
        handoff = pd.HandoffOutcome(self.fleet, self.metrics, job.key, decode.instance_id)
        if address is None or decode.spec.kvherd_agent:
            handoff.fell_back()
            return None
        started = time.perf_counter()
        body = pd.prefill_only(job.request.body)
        upstream = await attempt.open(self.pool, job.request.path, job.headers, body)
        upstream.response.close()
        if upstream.response.status != 200:  # the request itself is refused: say so from here
            handoff.fell_back()
            return None
        handoff.moved()
        attempt.follow(decode)
        job.tried.add(decode.instance_id)
        log.debug("request %s prefilled on %s in %.3fs", job.key, prefill.instance_id,
                  time.perf_counter() - started)  # fmt: skip
        return address

    def _note_pull(self, headers: list[tuple[bytes, bytes]]) -> None:
        """The chosen agent's `PULL_OUTCOME_HEADER`, into the proxy's metrics."""
        for name, value in headers:
            if name == _PULL_OUTCOME:
                told = parse_outcome(value.decode("latin-1"))
                if told is not None:
                    self.metrics.pulled(told.outcome, told.num_bytes, told.seconds)
                return

    def _handoff_target(self, key: str, max_tokens: Any) -> FleetInstance | None:
        """The decode instance to hand `key` to after its first token (P/D), if any: none for a
        request that ends with its first token."""
        decode = self.fleet.handoff_target(key)
        if decode is None or (isinstance(max_tokens, int) and max_tokens <= 1):
            return None
        return decode


def _with_vllm_pull(payload: bytes, address: str, tokens: int | None) -> bytes:
    """`payload` asking vLLM's kvherd connector to pull the prompt's first `tokens` (None: every
    full block) from `address` first (whatever else the client put in ``kv_transfer_params`` is
    kept)."""
    body = orjson.loads(payload)
    params = body.get("kv_transfer_params")
    pull: dict[str, Any] = {"from": address}
    if tokens is not None:
        pull["tokens"] = tokens
    ask = {"kvherd_pull": pull}
    body["kv_transfer_params"] = {**params, **ask} if isinstance(params, dict) else ask
    return orjson.dumps(body)


def _is_json_media_type(content_type: bytes) -> bool:
    """``application/json`` or ``application/*+json``, parameters aside (FastAPI's rule)."""
    media = content_type.split(b";", 1)[0].strip().lower()
    return media == b"application/json" or (
        media.startswith(b"application/") and media.endswith(b"+json")
    )


def _error_json(exc: OpenAIError) -> bytes:
    """The error object as the bytes the proxy sends (orjson: this is on the request path)."""
    return orjson.dumps(exc.body())


def _json_headers(request_id: bytes) -> list[tuple[bytes, bytes]]:
    return [(b"content-type", b"application/json"), (b"x-request-id", request_id)]


def _respond_error(exchange: Exchange, exc: OpenAIError, request_id: bytes) -> None:
    headers = _json_headers(request_id)
    if exc.status == 405:
        headers.append((b"allow", b"POST"))
    elif isinstance(exc, Refused):
        if exc.retry_after_s is not None:
            headers.append((b"retry-after", b"%d" % exc.retry_after_s))
        headers += exc.headers
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
        door=None if proxy.config.door is None else proxy.door.refusal,
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
            {"object": "model", "created": 0, "owned_by": "kvherd", "parent": None, **card}
            for card in proxy.fleet.model_cards()
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
