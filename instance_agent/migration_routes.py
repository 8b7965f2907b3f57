"""The agent's live-migration endpoints and the glue between `LLMEngine` and `migration`.

Contract:
- `EngineMigrationAdapter` makes an `LLMEngine` a `migration.core.protocol.MigratableEngine`. Its
  methods run on the engine thread only (through `EngineLoop.call`).
- `MigrationService` owns this agent's transport hub, its incoming-reservation table and the
  outgoing-migration limit (one in and one out at a time by default, like Llumnix). Its calls to
  other agents (migration stages, stream relay) carry the fleet token when there is one.
- Client streams: on the destination the engine loop runs the adopted request without a client
  and buffers its outputs for a follower (`EngineLoop.attach`); on the source, right after a
  commit, the request's open client stream is handed off (`EngineLoop.hand_off`) to
  `relay.follow`, a client of the destination's ``/resume`` (the proxy's protocol), from the
  released state, so the client gets every token exactly once; a stream whose client reattaches
  itself (the proxy) is ended with a migration notice instead (`EngineLoop.redirect`). With no
  open stream (the client left) the destination's copy is resumed and hung up on at once, which
  aborts it there.
- `create_migration_router(service)` serves, under ``/kvherd/v1``:
  ``POST /migrate {"request_id", "dst"}`` on the source: runs the migration and returns its
  `MigrationOutcome` (200 whether it committed or aborted; the body says which and why);
  ``POST /migration/reserve``, ``/migration/commit``, ``/migration/abort`` on the destination
  (the source agent calls them). Bad bodies get 400 with the OpenAI error object.
  The router's lifespan expires reservations of silent sources and frees everything at shutdown.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

import httpx
import torch
from fastapi import APIRouter, FastAPI, Request
from prometheus_client import CollectorRegistry, Counter, Histogram

from instance_agent import relay
from instance_agent.prefix_pull import kv_views
from kvherd.fleet_token import auth_headers
from kvherd.wire import OpenAIError, bad_request
from migration.core.protocol import (
    AbortReason,
    AbortRequest,
    CommitRequest,
    MessageError,
    MigratableEngine,
    MigrateOrder,
    MigrationOutcome,
    MigrationStatus,
    RequestState,
    ReserveRequest,
)
from migration.core.reservations import ReservationTable
from migration.core.stages import StageConfig
from migration.destination import MigrationDestination
from migration.http_link import HttpDestination
from migration.source import PrefillOpening, migrate_out
from migration.transport import TransportHub

if TYPE_CHECKING:
    from instance_agent.engine.llm_engine import LLMEngine
    from instance_agent.engine_loop import EngineLoop

T = TypeVar("T")
M = TypeVar("M")


class EngineMigrationAdapter:
    """`LLMEngine` seen through `MigratableEngine` (engine thread only)."""

    def __init__(self, engine: LLMEngine, served_model: str | None = None) -> None:
        self.engine = engine
        self._served_model = served_model
        cache = engine.runner.kv_cache
        self._bytes_per_block = cache[:, :, 0].numel() * cache.element_size()

    @property
    def block_size(self) -> int:
        return int(self.engine.config.block_size)

    @property
    def served_model(self) -> str | None:
        return self._served_model

    def kv_bytes_per_block(self) -> int:
        return self._bytes_per_block

    # -- source role -----------------------------------------------------------------------------
    def request_phase(self, request_id: str) -> str | None:
        request = self.engine.scheduler.requests.get(request_id)
        return None if request is None else request.migration_phase

    def request_blocks(self, request_id: str) -> tuple[list[int], int]:
        return self.engine.request_blocks(request_id)

    def request_block_hashes(self, request_id: str) -> list[int]:
        return list(self.engine.scheduler.requests[request_id].block_hashes)

    def request_lora(self, request_id: str) -> str | None:
        request = self.engine.scheduler.requests.get(request_id)
        return None if request is None else request.lora_name

    def suspend(self, request_id: str) -> None:
        self.engine.suspend(request_id)

    def resume(self, request_id: str) -> None:
        self.engine.resume(request_id)

    def export_request_state(self, request_id: str) -> dict[str, Any]:
        return self.engine.export_request_state(request_id)

    def release_migrated(self, request_id: str) -> None:
        self.engine.release_migrated(request_id)

    def kv_block_views(self) -> list[torch.Tensor]:
        return kv_views(self.engine)

    # -- destination role ------------------------------------------------------------------------
    def serves_lora(self, name: str) -> bool:
        return name in self.engine.lora_adapters

    def share_cached_prefix(self, owner_id: str, block_hashes: Sequence[int]) -> list[int]:
        block_manager = self.engine.block_manager
        hits = block_manager.lookup_cached_prefix(block_hashes)
        block_manager.share_cached_blocks(owner_id, hits)
        return hits

    def reserve_blocks(self, owner_id: str, num_blocks: int) -> list[int] | None:
        return self.engine.reserve_blocks(owner_id, num_blocks)

    def free_reservation(self, owner_id: str) -> None:
        self.engine.free_reservation(owner_id)

    def adopt_request(self, state: dict[str, Any], block_ids: Sequence[int], owner_id: str) -> Any:
        return self.engine.adopt_request(state, block_ids, owner_id)


@dataclass(slots=True)
class MigrationSettings:
    max_outgoing: int = 1  # concurrent migrations out of this instance
    max_incoming: int = 1  # concurrent migrations into this instance
    reservation_timeout_s: float = 30.0  # a silent source's reservation is freed after this
    transfer_timeout_s: float = 10.0  # every KV send/receive and rendezvous
    control_timeout_s: float = 30.0  # every control message to a destination
    stages: StageConfig = field(default_factory=StageConfig)


class MigrationMetrics:
    """Prometheus series for migrations out of this agent (on the agent's registry)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.migrations = Counter(
            "kvherd:migrations_out",
            "Migrations out of this instance, by outcome (committed or the abort reason).",
            ["outcome"],
            registry=registry,
        )
        self.bytes = Counter(
            "kvherd:migration_kv_bytes",
            "KV bytes of migrated requests: sent, or skipped (shared from the destination's cache).",
            ["kind"],
            registry=registry,
        )
        self.downtime = Histogram(
            "kvherd:migration_downtime_seconds",
            "Time a committed migration kept its request suspended.",
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0),
            registry=registry,
        )

    def record(self, outcome: MigrationOutcome) -> None:
        committed = outcome.status is MigrationStatus.COMMITTED
        label = "committed" if committed or outcome.reason is None else outcome.reason.value
        self.migrations.labels(label).inc()
        self.bytes.labels("sent").inc(outcome.bytes_sent)
        if committed:
            self.bytes.labels("skipped").inc(outcome.bytes_skipped)
            self.downtime.observe(outcome.downtime_s)


class MigrationService:
    """This agent's migration state: source driver, destination endpoints, transport."""

    def __init__(
        self,
        engine_loop: EngineLoop,
        instance_id: str,
        transport_host: str = "127.0.0.1",
        settings: MigrationSettings | None = None,
        on_released: Callable[[str, str, int], None] | None = None,
        fleet_token: str | None = None,
        served_model: str | None = None,
    ) -> None:
        """`on_released(request_id, dst_url, next_token_index)` runs on the engine thread as a
        committed request leaves (an observer: the client stream is handed off after it)."""
        self.settings = settings or MigrationSettings()
        self.engine_loop = engine_loop
        self.on_released = on_released
        self.adapter = EngineMigrationAdapter(engine_loop.engine, served_model)
        self.hub = TransportHub(transport_host, timeout_s=self.settings.transfer_timeout_s)
        # Our identity as a transport peer: a restarted agent must not reuse a stale pair group.
        self.src_name = f"{instance_id}#{self.hub.incarnation}"
        self.destination = MigrationDestination(
            self.call,
            self.hub,
            ReservationTable(self.settings.max_incoming, self.settings.reservation_timeout_s),
            self.adapter.block_size,
            self.adapter.kv_bytes_per_block(),
            model=served_model,
        )
        self._outgoing: set[str] = set()
        self._http = httpx.AsyncClient(
            timeout=self.settings.control_timeout_s, headers=auth_headers(fleet_token)
        )
        self.outcomes: dict[str, int] = {}  # "committed" or an abort reason -> count
        self.metrics = (
            MigrationMetrics(engine_loop.metrics.registry) if engine_loop.metrics else None
        )

    def migrating(self, request_id: str) -> bool:
        """Is a migration of this request out of here running?"""
        return request_id in self._outgoing

    async def call(self, fn: Callable[[MigratableEngine], T]) -> T:
        adapter = self.adapter
        return await self.engine_loop.call(lambda _engine: fn(adapter))

    async def migrate(
        self,
        order: MigrateOrder,
        stages: StageConfig | None = None,
        max_outgoing: int | None = None,
        opening: PrefillOpening | None = None,
        before_final: Callable[[], Awaitable[None]] | None = None,
    ) -> MigrationOutcome:
        """Run one migration out; `stages` and `max_outgoing` default to the settings' (a P/D
        handoff brings its own: `migration.core.handoff`, and opens it before the prefill:
        `opening`, `before_final`, see `migration.source`)."""
        limit = self.settings.max_outgoing if max_outgoing is None else max_outgoing
        if order.request_id in self._outgoing or len(self._outgoing) >= limit:
            outcome = MigrationOutcome(
                migration_id="",
                request_id=order.request_id,
                status=MigrationStatus.ABORTED,
                reason=AbortReason.BUSY,
                detail=f"{len(self._outgoing)} migration(s) out already running",
            )
        else:
            self._outgoing.add(order.request_id)
            released: list[RequestState] = []
            try:
                link = HttpDestination(order.dst, self._http)
                outcome = await migrate_out(
                    self.call,
                    self.hub,
                    link,
                    order.request_id,
                    self.src_name,
                    self.settings.stages if stages is None else stages,
                    self._released_hook(order.dst, released),
                    opening,
                    before_final,
                )
            finally:
                self._outgoing.discard(order.request_id)
            if outcome.status is MigrationStatus.COMMITTED:
                await self._hand_off(order, released[0])
        key = outcome.reason.value if outcome.reason else outcome.status.value
        self.outcomes[key] = self.outcomes.get(key, 0) + 1
        if self.metrics is not None:
            self.metrics.record(outcome)
        return outcome

    async def _hand_off(self, order: MigrateOrder, state: RequestState) -> None:
        """Continue the client's stream from the destination, or end the orphaned copy there."""
        rid = order.request_id
        start, num_prompt = len(state.output_token_ids), len(state.prompt_token_ids)
        try:
            stream = self.engine_loop.stream_of(rid)
            if stream is not None and stream.reattach:
                self.engine_loop.redirect(rid, order.dst)  # the proxy reattaches there itself
            else:
                outputs = relay.follow(
                    self._http,
                    order.dst,
                    rid,
                    start=start,
                    num_prompt_tokens=num_prompt,
                    num_cached_tokens=max(state.num_cached_tokens, 0),
                )
                self.engine_loop.hand_off(rid, outputs)
        except KeyError:
            # The client left while the request moved: nobody will follow it on the
            # destination, so resume it there and hang up at once (closing aborts it there)
            # instead of letting it run until the destination's detached-stream TTL.
            with contextlib.suppress(httpx.HTTPError):
                url = f"{order.dst.rstrip('/')}/kvherd/v1/requests/{rid}/resume"
                resume = relay.resume_object(rid, start, num_prompt)
                async with self._http.stream("POST", url, json=resume, params={"wait": 5}):
                    pass

    def _released_hook(
        self, dst: str, released: list[RequestState]
    ) -> Callable[[RequestState], None]:
        """Keeps the released state (the hand-off continues from it) and tells `on_released`."""
        hook = self.on_released

        def on_released(state: RequestState) -> None:
            released.append(state)
            if hook is not None:
                hook(state.request_id, dst, len(state.output_token_ids))

        return on_released

    async def close(self) -> None:
        await self.destination.close()
        await self._http.aclose()
        self.hub.close()


def create_migration_router(service: MigrationService) -> APIRouter:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        expiry = asyncio.create_task(service.destination.run_expiry())
        try:
            yield
        finally:
            expiry.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await expiry
            await service.close()

    router = APIRouter(prefix="/kvherd/v1", lifespan=lifespan)

    @router.post("/migrate")
    async def migrate(request: Request) -> dict[str, Any]:
        order = await _parse(request, MigrateOrder.from_json)
        outcome = await service.migrate(order)
        return outcome.to_json()

    @router.post("/migration/reserve")
    async def reserve(request: Request) -> dict[str, Any]:
        msg = await _parse(request, ReserveRequest.from_json)
        return (await service.destination.reserve(msg)).to_json()

    @router.post("/migration/commit")
    async def commit(request: Request) -> dict[str, Any]:
        msg = await _parse(request, CommitRequest.from_json)
        return (await service.destination.commit(msg)).to_json()

    @router.post("/migration/abort")
    async def abort(request: Request) -> dict[str, Any]:
        msg = await _parse(request, AbortRequest.from_json)
        return (await service.destination.abort(msg)).to_json()

    return router


async def _parse(request: Request, parse: Callable[[Any], M]) -> M:
    try:
        data = json.loads(await request.body())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise bad_request(f"request body is not valid JSON: {e}") from None
    try:
        return parse(data)
    except MessageError as e:
        raise OpenAIError(400, e.message, param=e.param) from None
