"""The agent's HTTP API: OpenAI-compatible endpoints plus what the kvherd scheduler reads.

Contract (`create_app(agent)` returns the FastAPI app):
- ``POST /v1/completions`` (prompt as text or token ids), ``POST /v1/chat/completions``,
  ``GET /v1/models`` (the model, then its LoRA adapters with vLLM's ``parent`` and ``root``; a
  request whose ``model`` names an adapter runs with it): OpenAI/vLLM JSON and SSE
  (``data: {json}\\n\\n`` frames ending with ``data: [DONE]\\n\\n``;
  ``stream_options.include_usage`` adds a final usage chunk). As in vLLM, a streamed output that
  carries tokens is a chunk even while its text is empty (tokens that do not complete a character
  yet), so clients time the first token, not the first character.
- ``X-Request-Id`` is the engine request id when given (else a fresh one) and is echoed on every
  response. A client that disconnects, streamed or not, aborts its request, freeing its blocks.
- Every error is the OpenAI error object: 400 for any invalid body (FastAPI's 422 is replaced, in
  the OpenAPI schema too), 404 for an unknown model or route, 413 for a body over
  `kvherd.wire.MAX_BODY_BYTES`, 503 while draining, 500 if the engine died.
- ``GET /health`` (200 ok, 503 draining, 500 engine dead), ``GET /version``, ``GET /metrics``
  (Prometheus, vLLM names), ``GET /kvherd/v1/state`` (see `state.snapshot`;
  ``?block_hashes=true`` adds the cached block hashes; ``?check_integrity=true`` adds
  ``"integrity": "ok"`` or the block manager's failed invariant, a debugging aid for tests),
  ``GET /kvherd/v1/prefixes?max_blocks=N`` (`BlockManager.cached_prefixes`: what a scale-in
  hands over, ``{"model", "block_size", "prefixes": [{"block_hashes", "token_ids"}]}``).
- What peer routers (sglang-router, vllm-router) and vLLM clients probe: ``/server_info``,
  ``/model_info``, ``/tokenize``, ``/detokenize``, ``/v1/(chat/)completions/render`` (`compat_routes`).
- With a fleet token (``create_app(..., fleet_token=...)``) every ``/kvherd/v1/*`` route answers
  401 without ``Authorization: Bearer FLEET_TOKEN`` (`control_auth`).
- Proxy reattachment: a streamed request sent with ``X-Kvherd-Reattach: 1`` that migrates away
  ends its SSE (without ``[DONE]``) with the notice ``data: {"kvherd": {"migrated_to": URL,
  "request_id": ID, "resume": {...}}}``; ``POST URL/kvherd/v1/requests/{id}/resume`` with the
  ``resume`` object as body continues the very same OpenAI stream there from the next token
  (``resume.from``; ``?wait=`` seconds for the request to arrive, default 5, else 404), its
  token ledger included when the source's stream had one (``resume.token_ledger``), and may
  end with a notice again. Clients without the header are relayed by
  the source instead, through this same route (`relay.follow`).
- Token ledger (``X-Kvherd-Token-Ids: 1``, `kvherd.wire`): streamed frames carry comment lines
  with their token ids and the first one the continuation state (resume object, sampling seed).
- Continuation of a request whose instance was lost: the original streamed body plus
  ``kvherd_continuation`` (`protocol.Continuation`) recomputes prompt + output here and streams
  the rest of the very same OpenAI stream (same id, token index, usage), bit-identical for greedy
  and seeded sampling (`LLMEngine.continue_request`). A continuation for a request this agent
  already runs (migrated in, its source lost between the commit and the notice) follows it from
  the client's tokens, as ``/resume`` does.
- P/D disaggregation: a generation request with ``X-Kvherd-Handoff: URL`` reserves on the
  decode instance at URL as it is admitted and is handed to it after its first token
  (`instance_agent.pd_handoff`; 401 without the fleet token when the agent has one); `Agent.role`
  (``prefill``, ``decode``, ``mixed``) is reported in the state snapshot.
- Prefix pull: ``X-Kvherd-Pull: tcp://HOST:PORT blocks=N`` (401 without the fleet token when
  the agent has one, as the handoff header) loads the prompt's leading blocks
  from that agent's block server before the request is added (`instance_agent.prefix_pull`; a
  failed pull recomputes); ``X-Kvherd-Pull-Outcome`` says what landed. The state snapshot names
  this agent's own block server (``pull_address``).
- `Agent` holds what the routes share: the engine loop, metrics, identity, and the draining flag.
  `Agent.drain` stops accepting work and waits for open requests to finish (or aborts them after
  a timeout).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import signal
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, MutableMapping, Sequence
from dataclasses import dataclass, field
from types import FrameType
from typing import TYPE_CHECKING, Any

import uvicorn
from fastapi import APIRouter, FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from instance_agent import pd_handoff, protocol
from instance_agent.compat_routes import create_compat_router, resolve_model
from instance_agent.control_auth import FleetTokenMiddleware
from instance_agent.engine.core.request import (
    REQUEST_ID_IN_USE,
    InvalidRequestError,
    SamplingParams,
)
from instance_agent.engine_loop import (
    EngineDeadError,
    EngineLoop,
    RequestAborted,
    RequestMigrated,
    RequestStream,
)
from instance_agent.metrics import AgentMetrics
from instance_agent.prefix_pull import PrefixPulls, Pulled
from instance_agent.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
)
from instance_agent.registration import Registrar
from instance_agent.state import snapshot
from kvherd import __version__, wire
from kvherd.kv_pull import PULL_HEADER, PULL_OUTCOME_HEADER, PullAsk
from kvherd.wire import OpenAIError, bad_request

if TYPE_CHECKING:
    from instance_agent.engine.llm_engine import LLMEngine

log = logging.getLogger(__name__)

_REQUEST_ID_RE = re.compile(r"^[\x21-\x7e]{1,256}$")  # printable ASCII, no spaces
MAX_EXPORTED_BLOCKS = 1 << 16  # the most blocks one /kvherd/v1/prefixes answer lists
# How long a continuation of a request migrated here waits for its first output here.
_FOLLOW_CONTINUED_WAIT_S = 2.0


@dataclass
class Agent:
    engine_loop: EngineLoop
    metrics: AgentMetrics
    instance_id: str
    served_model_name: str
    model_root: str
    registrar: Registrar | None = None
    draining: bool = False
    created: int = field(default_factory=protocol.now)
    role: str = "mixed"  # P/D disaggregation: "prefill", "decode" or "mixed"
    handoffs: pd_handoff.PDHandoffs | None = None  # hands requests to their decode instance
    pulls: PrefixPulls | None = None  # serves cached blocks to other agents, pulls prefixes
    runtime_lora: bool = False  # serves /v1/load_lora_adapter (`lora_routes`)

    @property
    def engine(self) -> LLMEngine:
        return self.engine_loop.engine

    async def cached_prefixes(self, max_blocks: int) -> dict[str, Any]:
        """The engine's cached prefixes, hottest first (`BlockManager.cached_prefixes`)."""

        def read(engine: LLMEngine) -> list[tuple[list[int], bytes]]:
            return engine.block_manager.cached_prefixes(max_blocks)

        found = await self.engine_loop.call(read)
        prefixes = [
            {"block_hashes": hashes, "token_ids": memoryview(tokens).cast("I").tolist()}
            for hashes, tokens in found
        ]
        block_size = self.engine.block_manager.block_size
        return {"model": self.served_model_name, "block_size": block_size, "prefixes": prefixes}

    async def state(
        self, include_block_hashes: bool = False, check_integrity: bool = False
    ) -> dict[str, Any]:
        loop = self.engine_loop
        draining = self.draining

        def read(engine: LLMEngine) -> dict[str, Any]:
            state = snapshot(
                engine.scheduler,
                engine.block_manager,
                instance_id=self.instance_id,
                model=self.served_model_name,
                draining=draining,
                step_latency=loop.step_latency,
                last_kv_event_seq=loop.last_kv_event_seq,
                include_block_hashes=include_block_hashes,
                role=self.role,
                tiers=engine.tier_usage(),
            )
            state["pull_address"] = None if self.pulls is None else self.pulls.address
            # Every adapter it serves is resident, each in a slot of its own; no slot at all
            # when it can hold none (none given, none loadable).
            state["active_adapters"] = sorted(engine.lora_adapters)
            can_hold = self.runtime_lora or engine.lora_adapters
            state["lora_slots"] = engine.loras.capacity if can_hold else 0
            state["runtime_lora"] = self.runtime_lora
            if check_integrity:
                try:
                    engine.block_manager.check_integrity()
                    state["integrity"] = "ok"
                    # Who holds blocks (requests, migration reservations): a leak shows here.
                    state["block_owners"] = engine.block_manager.owners()
                except AssertionError as exc:
                    state["integrity"] = f"broken: {exc}"
            return state

        return await loop.call(read)

    async def drain(self, timeout: float | None) -> None:
        """Refuse new requests and wait for the open ones; abort what is left after `timeout`."""
        self.draining = True
        log.info("draining: %d open requests", self.engine_loop.num_open_requests)
        if self.registrar is not None:
            # The scheduler learns it now, stops routing here and migrates our requests away.
            await self.registrar.announce()
        try:
            await asyncio.wait_for(self.engine_loop.wait_idle(), timeout)
        except TimeoutError:
            log.warning("drain timeout: aborting %d requests", self.engine_loop.num_open_requests)
            self.engine_loop.abort_all()
            await self.engine_loop.wait_idle()
        if self.registrar is not None:  # its cache leaves with it unless survivors pull it
            await self.registrar.hand_over()


def _error_response(exc: OpenAIError, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status, headers=headers)


class BodyLimitMiddleware:
    """Refuse bodies over `limit` bytes with 413 before they are buffered (ASGI middleware)."""

    def __init__(self, app: Callable[..., Awaitable[None]], limit: int) -> None:
        self.app = app
        self.limit = limit

    async def __call__(
        self,
        scope: MutableMapping[str, Any],
        receive: Callable[[], Awaitable[MutableMapping[str, Any]]],
        send: Callable[[MutableMapping[str, Any]], Awaitable[None]],
    ) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        for name, value in scope.get("headers", ()):
            if name == b"content-length" and value.isdigit() and int(value) > self.limit:
                await self._refuse(send)
                return
        received = 0
        started = False

        async def limited_receive() -> MutableMapping[str, Any]:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.limit:
                    raise _BodyTooLarge
            return message

        async def tracking_send(message: MutableMapping[str, Any]) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, limited_receive, tracking_send)
        except _BodyTooLarge:
            if not started:
                await self._refuse(send)

    async def _refuse(self, send: Callable[[MutableMapping[str, Any]], Awaitable[None]]) -> None:
        error = OpenAIError(
            413, f"request body exceeds {self.limit} bytes", code="request_too_large"
        )
        response = _error_response(error)
        await send(
            {
                "type": "http.response.start",
                "status": 413,
                "headers": [(k.encode(), v.encode()) for k, v in response.headers.items()],
            }
        )
        await send({"type": "http.response.body", "body": response.body})


class _BodyTooLarge(Exception):
    pass


async def _wait_for_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def create_app(
    agent: Agent, routers: Sequence[APIRouter] = (), fleet_token: str | None = None
) -> FastAPI:
    """The agent's app; `routers` add endpoints (e.g. migration) that share `app.state.agent`;
    `fleet_token` guards ``/kvherd/v1/*``."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        agent.engine_loop.start()
        if agent.registrar is not None:
            agent.registrar.start()
        try:
            yield
        finally:
            if agent.registrar is not None:
                await agent.registrar.close()
            await asyncio.to_thread(agent.engine_loop.stop)

    app = FastAPI(title="kvherd instance agent", lifespan=lifespan)
    app.state.agent = agent
    error_schema = {
        "description": "OpenAI error object",
        "content": {
            "application/json": {
                "schema": {
                    "type": "object",
                    "properties": {
                        "error": {
                            "type": "object",
                            "properties": {
                                "message": {"type": "string"},
                                "type": {"type": "string"},
                                "param": {"type": ["string", "null"]},
                                "code": {"type": ["string", "null"]},
                            },
                        }
                    },
                }
            }
        },
    }

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version="1", routes=app.routes)
            for path_item in schema.get("paths", {}).values():
                for operation in path_item.values():
                    responses = operation.get("responses", {})
                    if responses.pop("422", None) is not None:
                        responses["400"] = error_schema
            components = schema.get("components", {}).get("schemas", {})
            components.pop("HTTPValidationError", None)
            components.pop("ValidationError", None)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        return _error_response(protocol.error_from_validation(exc.errors()))

    @app.exception_handler(OpenAIError)
    async def on_openai_error(request: Request, exc: OpenAIError) -> JSONResponse:
        return _error_response(exc)

    @app.exception_handler(InvalidRequestError)
    async def on_invalid_request(request: Request, exc: InvalidRequestError) -> JSONResponse:
        return _error_response(protocol.from_invalid_request(exc))

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return _error_response(OpenAIError(exc.status_code, str(exc.detail), type=kind))

    @app.exception_handler(Exception)
    async def on_unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s", request.url.path)
        return _error_response(OpenAIError(500, f"internal error: {exc!r}", type="server_error"))

    app.add_middleware(BodyLimitMiddleware, limit=wire.MAX_BODY_BYTES)
    if fleet_token:
        app.add_middleware(FleetTokenMiddleware, token=fleet_token)

    @app.get("/health")
    async def health() -> JSONResponse:
        if agent.engine_loop.dead is not None:
            return JSONResponse({"status": "engine_dead"}, status_code=500)
        if agent.draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        def card(name: str, root: str, parent: str | None) -> dict[str, Any]:
            return {
                "id": name,
                "object": "model",
                "created": agent.created,
                "owned_by": "kvherd",
                "root": root,
                "parent": parent,
                "max_model_len": agent.engine.max_model_len,
            }

        base = agent.served_model_name
        adapters = list(agent.engine.lora_adapters.values())  # loads change it on the engine thread
        cards = [card(base, agent.model_root, None)]
        return {"object": "list", "data": cards + [card(a.name, a.path, base) for a in adapters]}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(agent.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/kvherd/v1/state")
    async def state(block_hashes: bool = False, check_integrity: bool = False) -> dict[str, Any]:
        return await agent.state(include_block_hashes=block_hashes, check_integrity=check_integrity)

    @app.get("/kvherd/v1/prefixes")
    async def prefixes(
        max_blocks: int = Query(4096, ge=1, le=MAX_EXPORTED_BLOCKS),
    ) -> dict[str, Any]:
        return await agent.cached_prefixes(max_blocks)

    @app.post("/v1/completions", response_model=None)
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await _generate(agent, body, request)

    @app.post("/v1/chat/completions", response_model=None)
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await _generate(agent, body, request)

    @app.post("/kvherd/v1/requests/{request_id}/resume", response_model=None)
    async def resume_request(request_id: str, request: Request, wait: float = 5.0) -> Response:
        _check_wait(wait)
        try:
            body = json.loads(await request.body())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise bad_request(f"request body is not valid JSON: {exc}") from None
        meta, fmt = _resumed(body, _wants_ledger(request))
        stream = await _follow(agent, request_id, wait)
        stream.reattach = request.headers.get("x-kvherd-reattach") == "1"
        return StreamingResponse(
            _sse(stream, meta, fmt),
            media_type="text/event-stream",
            headers={"X-Request-Id": request_id},
        )

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": __version__}

    app.include_router(create_compat_router(agent))
    for router in routers:
        app.include_router(router)
    return app


def _request_id(request: Request) -> str:
    given = request.headers.get("x-request-id")
    if given is None:
        return uuid.uuid4().hex
    if not _REQUEST_ID_RE.match(given):
        raise bad_request(
            "X-Request-Id must be 1-256 printable ASCII characters without spaces",
            param="X-Request-Id",
        )
    return given


def _pull_ask(request: Request) -> PullAsk | None:
    given = request.headers.get(PULL_HEADER)
    if given is None:
        return None
    try:
        return PullAsk.parse(given)
    except ValueError as exc:
        raise bad_request(str(exc), param=PULL_HEADER) from None


def _needs_fleet_token(header: str) -> OpenAIError:
    return OpenAIError(
        401,
        f"{header} needs the fleet token (Authorization: Bearer FLEET_TOKEN)",
        type="authentication_error",
        code="invalid_fleet_token",
    )


def _wants_ledger(request: Request) -> bool:
    return request.headers.get(wire.TOKEN_IDS_HEADER) == "1"


async def _generate(
    agent: Agent, body: CompletionRequest | ChatCompletionRequest, request: Request
) -> Response:
    request_id = _request_id(request)
    headers = {"X-Request-Id": request_id}
    handoff_dst = request.headers.get(pd_handoff.HANDOFF_HEADER)
    presented = request.headers.get("authorization")
    if handoff_dst and (agent.handoffs is None or not agent.handoffs.authorized(presented)):
        agent.metrics.untrusted("handoff_header")
        return _error_response(_needs_fleet_token(pd_handoff.HANDOFF_HEADER), headers)
    if (
        PULL_HEADER in request.headers
        and agent.pulls is not None
        and not agent.pulls.authorized(presented)
    ):
        agent.metrics.untrusted("pull_header")
        return _error_response(_needs_fleet_token(PULL_HEADER), headers)
    tracing = agent.engine_loop.tracing
    if tracing is not None:
        traceparent = request.headers.get("traceparent")
        tracing.begin(request_id, traceparent, request.headers.get("tracestate"))
    try:
        if body.kvherd_continuation is not None and not body.stream:
            raise bad_request("only a streamed request can be continued", "kvherd_continuation")
        hold = bool(handoff_dst) and agent.handoffs is not None and agent.handoffs.holds_first_token
        stream, meta = await _submit(agent, body, request_id, hold, _pull_ask(request))
        if meta.pulled is not None:
            headers[PULL_OUTCOME_HEADER] = meta.pulled.header()
    except OpenAIError as exc:
        refused: OpenAIError | None = exc
    except InvalidRequestError as exc:
        followed = await _follow_continued(agent, body, request_id, exc)
        refused = protocol.from_invalid_request(exc) if followed is None else None
        if followed is not None:
            stream, meta = followed
    except EngineDeadError as exc:
        refused = OpenAIError(500, str(exc), type="server_error")
    else:
        refused = None
    if refused is not None:
        if tracing is not None:
            tracing.forget(request_id)
        return _error_response(refused, headers)
    handoff = None
    if handoff_dst and agent.handoffs is not None:
        handoff = agent.handoffs.start(stream, handoff_dst, *meta.admitted)
    if body.stream:
        stream.reattach = request.headers.get("x-kvherd-reattach") == "1"
        fmt = _Format.of(body, _wants_ledger(request))
        frames = _sse(stream, meta, fmt)
        if handoff is not None and fmt.ledger:
            frames = pd_handoff.annotate(frames, handoff)
        return StreamingResponse(frames, media_type="text/event-stream", headers=headers)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    collector = asyncio.ensure_future(_collect(stream))
    try:
        await asyncio.wait({watcher, collector}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not collector.done():
            collector.cancel()
            stream.close()
    if collector.cancelled():
        return Response(status_code=499, headers=headers)  # nobody is listening any more
    try:
        text, token_ids, finish_reason, cached = collector.result()
    except RequestAborted as exc:
        return _error_response(OpenAIError(503, str(exc), type="server_error"), headers)
    except EngineDeadError as exc:
        return _error_response(OpenAIError(500, str(exc), type="server_error"), headers)
    if handoff is not None:
        headers[pd_handoff.HANDOFF_HEADER] = pd_handoff.header_value(handoff)
    usage = protocol.usage(meta.prompt_len, len(token_ids), cached)
    build = protocol.chat_response if meta.chat else protocol.completion_response
    ids = token_ids if body.return_token_ids else None
    prompt_ids = meta.prompt_ids if body.return_token_ids else None
    payload = build(
        meta.response_id, meta.created, meta.model, text, finish_reason, usage, ids, prompt_ids
    )
    return JSONResponse(payload, headers=headers)


@dataclass(slots=True)
class _Format:
    """What the client asked of its stream (travels with a migrated stream)."""

    want_ids: bool
    continuous_usage: bool
    include_usage: bool
    ledger: bool = False  # token-ledger comment lines for the proxy (`kvherd.wire`)

    @classmethod
    def of(cls, body: CompletionRequest | ChatCompletionRequest, ledger: bool) -> _Format:
        continuous = bool(body.stream_options and body.stream_options.continuous_usage_stats)
        return cls(bool(body.return_token_ids), continuous, bool(body.include_usage), ledger)


@dataclass(slots=True)
class _Meta:
    response_id: str
    created: int
    model: str
    chat: bool
    prompt_len: int
    prompt_ids: list[int]
    start: int = 0  # output tokens the client already has (a resumed or continued stream)
    opening: bool = True  # the stream starts here (a chat stream's role chunk goes out here)
    sampling_seed: int | None = None  # known when the request started here
    # As admitted here: its tokens, their full-block hashes and its LoRA adapter (a P/D handoff
    # reserves for them, at a destination that serves the adapter).
    admitted: tuple[int, tuple[int, ...], str | None] = (0, (), None)
    pulled: Pulled | None = None  # the prefix pull that ran before it was added


async def _submit(
    agent: Agent,
    body: CompletionRequest | ChatCompletionRequest,
    request_id: str,
    hold: bool = False,
    pull: PullAsk | None = None,
) -> tuple[RequestStream, _Meta]:
    """Open the request's stream; `hold`: suspend it at its first token (a P/D handoff out of a
    prefill-only agent, `pd_handoff`), set in the very engine command that adds it; `pull`:
    load its prefix from another agent first (`prefix_pull`; a failed pull recomputes)."""
    if agent.draining:
        raise OpenAIError(
            503, "the instance is draining and accepts no new requests", type="server_error"
        )
    lora_name = resolve_model(agent, body.model)
    protocol.check_supported(body)
    engine = agent.engine
    tokenizer = engine.tokenizer
    max_model_len: int = engine.max_model_len
    chat = isinstance(body, ChatCompletionRequest)
    # The proxy's routing tokens and /tokenize's answer are these very ids (`kvherd.chat_render`).
    prompt_ids = protocol.prompt_token_ids(body, tokenizer, engine.model_config.vocab_size)
    default_max_tokens = protocol.default_max_tokens(body, len(prompt_ids), max_model_len)
    params: SamplingParams = protocol.to_sampling_params(body, default_max_tokens)
    continuation = body.kvherd_continuation
    seeds: list[int] = []
    admitted: list[tuple[int, tuple[int, ...], str | None]] = []

    pulled: Pulled | None = None

    def start(engine: LLMEngine) -> None:
        if continuation is None:
            try:
                request = engine.add_request(
                    request_id, prompt_ids, params, priority=body.priority,
                    cache_salt=body.cache_salt, lora_name=lora_name,
                )  # fmt: skip
            finally:  # it holds its hits now (or was refused): the pull's carrier lets go
                if pulled is not None:
                    pulled.release(engine)
        else:
            request = engine.continue_request(
                request_id,
                prompt_ids,
                continuation.output_token_ids,
                params,
                sampling_seed=continuation.sampling_seed,
                emitted_text=continuation.emitted_text,
                priority=body.priority,
                cache_salt=body.cache_salt,
                lora_name=lora_name,
            )
        seeds.append(request.sampling_seed)
        admitted.append((request.num_tokens, tuple(request.block_hashes), request.lora_name))
        if hold:
            engine.scheduler.hold_at_first_token(request_id)

    model = lora_name or agent.served_model_name  # what the responses name
    if continuation is None:
        prefix = "chatcmpl-" if chat else "cmpl-"
        meta = _Meta(prefix + request_id, protocol.now(), model, chat,
                     len(prompt_ids), prompt_ids)  # fmt: skip
    else:
        meta, _ = _resumed(continuation.resume, False)
        if meta.start != len(continuation.output_token_ids) or meta.chat != chat:
            raise bad_request(
                "resume.from must count output_token_ids and resume.chat match the route",
                "kvherd_continuation",
            )
        meta.prompt_len, meta.model = len(prompt_ids), model
    if pull is not None and agent.pulls is not None and continuation is None:
        pulled = meta.pulled = await agent.pulls.pull(
            request_id, prompt_ids, body.cache_salt, pull, lora_name
        )
        agent.metrics.pulled(pulled.outcome, pulled.num_bytes, pulled.seconds)
    stream = await agent.engine_loop.open(request_id, start)
    meta.sampling_seed, meta.admitted = seeds[0], admitted[0]
    return stream, meta


async def _collect(stream: RequestStream) -> tuple[str, list[int], str | None, int]:
    parts: list[str] = []
    token_ids: list[int] = []
    finish_reason: str | None = None
    cached = 0
    async for output in stream:
        parts.append(output.text_delta)
        token_ids.extend(output.new_token_ids)
        cached = output.num_cached_tokens
        if output.finished:
            finish_reason = output.finish_reason
    return "".join(parts), token_ids, finish_reason, cached


def _resume_object(meta: _Meta, fmt: _Format, index: int) -> dict[str, Any]:
    """How to continue `meta`'s stream from output token `index` (the migration notice's)."""
    return {
        "from": index,
        "id": meta.response_id,
        "created": meta.created,
        "model": meta.model,
        "chat": meta.chat,
        "prompt_tokens": meta.prompt_len,
        "return_token_ids": fmt.want_ids,
        "continuous_usage_stats": fmt.continuous_usage,
        "include_usage": fmt.include_usage,
        "token_ledger": fmt.ledger,
    }


async def _sse(stream: RequestStream, meta: _Meta, fmt: _Format) -> AsyncIterator[bytes]:
    """The OpenAI stream of `stream`'s outputs from output token `meta.start` on."""
    want_ids, continuous_usage = fmt.want_ids, fmt.continuous_usage
    cached = 0
    rid, created, model = meta.response_id, meta.created, meta.model
    index = meta.start
    ledger = fmt.ledger
    # The ledger's first line: how to continue this stream if this instance is lost.
    preamble = b""
    if ledger and meta.sampling_seed is not None:
        continuation = {
            "resume": _resume_object(meta, fmt, index),
            "sampling_seed": meta.sampling_seed,
        }
        preamble = wire.ledger_line(continuation)
    done = True
    try:
        if meta.chat and meta.opening:
            first = protocol.chat_chunk(
                rid, created, model, {"role": "assistant", "content": ""}, None,
                [] if want_ids else None, 0,
            )  # fmt: skip
            if want_ids:
                first["choices"][0]["prompt_token_ids"] = meta.prompt_ids
            yield preamble + wire.sse(first)
            preamble = b""
        # Outputs that queued up while this stream waited for the event loop go out in one write.
        async for outputs in stream.batches():
            frames = []
            for output in outputs:
                cached = output.num_cached_tokens
                new_ids = list(output.new_token_ids)
                finish = output.finish_reason if output.finished else None
                text = output.text_delta
                # Like vLLM: a chunk per output that carries tokens, even when they do not
                # complete a character yet (empty text), so a client times the first token.
                if text or finish is not None or new_ids:
                    ids = new_ids if want_ids else None
                    if meta.chat:
                        delta = {"content": text} if text else {}
                        chunk = protocol.chat_chunk(rid, created, model, delta, finish, ids, index)
                    else:
                        chunk = protocol.completion_chunk(
                            rid, created, model, text, finish, ids, index
                        )
                        if want_ids and index == 0:
                            chunk["choices"][0]["prompt_token_ids"] = meta.prompt_ids
                    if continuous_usage:
                        chunk["usage"] = protocol.usage(
                            meta.prompt_len, index + len(new_ids), output.num_cached_tokens
                        )
                    if ledger and new_ids:
                        frames.append(wire.ledger_line({"index": index, "token_ids": new_ids}))
                    frames.append(wire.sse(chunk))
                index += len(new_ids)
            if frames:
                yield preamble + b"".join(frames)
                preamble = b""
        if fmt.include_usage:
            usage = protocol.usage(meta.prompt_len, index, cached)
            yield wire.sse(protocol.usage_chunk(rid, created, model, meta.chat, usage))
    except RequestMigrated as moved:
        # The client (the proxy) continues this very stream at the destination: no [DONE].
        done = False
        resume = _resume_object(meta, fmt, index)
        yield wire.migration_notice(moved.dst_url, stream.request_id, resume)
    except (RequestAborted, EngineDeadError) as exc:
        kind = "server_error"
        status = 503 if isinstance(exc, RequestAborted) else 500
        yield wire.sse(OpenAIError(status, str(exc), type=kind).body())
    finally:
        stream.close()
    if done:
        yield wire.SSE_DONE


def _check_wait(wait: float) -> None:
    if not 0 <= wait <= 60:
        raise bad_request("wait must be between 0 and 60 seconds", param="wait")


async def _follow(agent: Agent, request_id: str, wait: float) -> RequestStream:
    """The stream of a request waiting here for a follower (migrated in, or resumed)."""
    stream = await agent.engine_loop.attach(request_id, timeout=wait)
    if stream is None:
        raise OpenAIError(
            404,
            f"no request {request_id!r} is waiting for a follower here",
            param="request_id",
            code="request_not_found",
        )
    return stream


async def _follow_continued(
    agent: Agent,
    body: CompletionRequest | ChatCompletionRequest,
    request_id: str,
    refusal: InvalidRequestError,
) -> tuple[RequestStream, _Meta] | None:
    """A continuation for a request already here: it migrated in and its source was lost before
    pointing the client here (between the commit and the notice). Request ids are the proxy's
    own, so it is that very request: the continuation follows it from the tokens the client has,
    as ``/resume`` would. None when `refusal` is another refusal or nobody waits to be followed."""
    continuation = body.kvherd_continuation
    if continuation is None or refusal.code != REQUEST_ID_IN_USE:
        return None
    try:
        meta, _ = _resumed(continuation.resume, False)
    except OpenAIError:
        return None
    if meta.chat != isinstance(body, ChatCompletionRequest):
        return None
    stream = await agent.engine_loop.attach(request_id, timeout=_FOLLOW_CONTINUED_WAIT_S)
    if stream is None:
        return None
    meta.start = len(continuation.output_token_ids)
    meta.sampling_seed = continuation.sampling_seed
    return stream, meta


def _resumed(body: Any, ledger: bool) -> tuple[_Meta, _Format]:
    """The stream to continue, from a migration notice's ``resume`` object (400 if malformed)."""
    if not isinstance(body, dict):
        raise bad_request("body must be a migration notice's resume object")

    def field(name: str, kind: type, default: Any = None) -> Any:
        value = body.get(name, default)
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise bad_request(f"'{name}' must be of type {kind.__name__}", param=name)
        return value

    start = field("from", int)
    if start < 0:
        raise bad_request("'from' must be >= 0", param="from")
    meta = _Meta(
        response_id=field("id", str),
        created=field("created", int),
        model=field("model", str),
        chat=field("chat", bool),
        prompt_len=field("prompt_tokens", int),
        prompt_ids=[],  # only the first chunk carries them, and it went out at the source
        start=start,
        opening=False,
    )
    fmt = _Format(
        field("return_token_ids", bool),
        field("continuous_usage_stats", bool),
        field("include_usage", bool),
        # The stream's ledger goes on whoever resumes it: a relay that continues the stream
        # elsewhere if this instance is lost needs every token's ids, not just the source's.
        # (Absent from a relay's resume object, which asks for the ledger by header.)
        field("token_ledger", bool, False) or ledger,
    )
    return meta, fmt


class DrainingServer(uvicorn.Server):
    """uvicorn's server with SIGTERM turned into a drain (`Agent.drain`) instead of a hard stop."""

    def __init__(self, config: uvicorn.Config, agent: Agent, drain_timeout: float | None) -> None:
        super().__init__(config)
        self.agent = agent
        self.drain_timeout = drain_timeout
        self._drain_task: asyncio.Future[None] | None = None

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if sig == signal.SIGTERM and self._drain_task is None and not self.should_exit:
            # Signal handlers run on the main thread between bytecodes, and that thread also runs
            # the event loop: schedule the drain instead of awaiting here. Not recording the signal
            # keeps uvicorn from re-raising it at exit, so a drained agent exits 0.
            asyncio.get_event_loop().call_soon_threadsafe(self._start_drain)
            return
        super().handle_exit(sig, frame)

    def _start_drain(self) -> None:
        async def drain() -> None:
            await self.agent.drain(self.drain_timeout)
            log.info("drained; shutting down")
            self.should_exit = True

        if self._drain_task is None:
            self._drain_task = asyncio.ensure_future(drain())
