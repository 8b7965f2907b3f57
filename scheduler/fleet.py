"""The proxy's fleet: the pure scheduler core wrapped with membership, health and background I/O.

Contract:
- `Fleet` owns one `ClusterState` + `Router` (the same objects the simulator drives) and feeds them
  from the outside world: KV events (`KVEventSubscriber`), load (`LoadPoller`), health
  (`OutlierDetector` + `ActiveProber`), and the request path's lifecycle calls.
- Membership: `add_instance(spec)` (static ``--instance`` or admin registration; re-adding resyncs
  the instance's prefix view), `remove_instance`, `set_draining`, `heartbeat`. Registered instances
  that stop heartbeating for `heartbeat_timeout_s` are removed; static ones are not.
- Block size: one per model (hashes only match between equal block sizes). Unless pinned
  (``model_block_sizes``: ``--block-size MODEL=N``; ``block_size``: ``--block-size N``, every
  model), the first block size an instance of a model reports (``block_size=`` on its spec, its
  registration, its ``/kvherd/v1/state``, vLLM's ``vllm:cache_config_info``, or its KV events'
  ``block_size``) settles it for the base models it serves (adapters hash as their parent); the
  first any instance reports also settles the fleet's default (`block_size`: requests naming no
  model, instances whose models are unknown). Each instance is indexed at its model's size
  (re-read from its events when that settles). An instance that declares another size than its
  model's when it registers is refused (`FleetError` 400, saying both sizes); one found to
  differ later is reported once (a WARNING, ``kvherd_block_size_mismatch{instance}``, the admin
  field ``block_size_mismatch``) and routed with the approximate index. `block_size_of_model`
  is the request path's one lookup.
- KV events: `subscriber` follows each instance's stream (connecting, or binding for an engine
  that connects its PUB: ``kv_events_bind``; or the shared bound endpoint ``kv_events_bind`` of
  the settings, attributed by ``kv_topic``). When the stream says part of the instance's history
  is lost (replay buffer rolled, no replay socket) it is counted (``kvherd_kv_history_lost``) and
  the instance is routed with the approximate index from then on, until it re-joins. A stream
  silent for ``kv_silence_warn_s`` after traffic is counted (``kvherd_kv_events_silent``).
- Request ids: `new_key(client_request_id)` gives each request the fleet's own id, unique among
  every proxy process's requests (a random per-process prefix and a counter); it is the router's
  key and the id the agents see, so a client's ``X-Request-Id`` can neither collide with another
  request's (another tenant's) nor tell whether one is in flight. `request_key(id)` maps a client's
  id of a request in flight back to its key (the first holder of a reused id keeps it), for
  operators who know only the client's id; the alias table is bounded. A request is in flight
  (`in_flight`) while the router places it or while the relay holds its stream open
  (`stream_opened` .. `stream_closed`): between two attempts (continued after a cut or a lost
  instance) it is unplaced, and `placement(key, timeout_s)` waits for its next dispatch.
- Request path (synchronous, no I/O): `dispatch` -> (instance, matched blocks), then exactly one of
  `request_finished` / `request_failed` per dispatch, with `first_token` in between for streams.
  `inflight` (`scheduler.core.inflight.InflightLedger`) accounts them: an instance is saturated
  while `max_inflight_per_instance` requests are in flight on it; `dispatch` raises
  `NoCapacityError(saturated=True)` when only saturated instances could take the request,
  `saturated=False` when nothing dispatchable (and untried) is left. Listeners (`subscribe`, a
  `FleetListener`) hear `capacity_freed` whenever room may have come free (the proxy's
  admission queue waits on it) and `instance_lost` when an instance is ejected or removed.
  `request_migrated(key, dst)` moves a running request's charges and in-flight count to `dst`
  (a committed live migration); it then finishes there, whichever instance the proxy reports.
- Health (`scheduler.fleet_health.FleetHealth`): `failure_threshold` consecutive failures eject an
  instance (not dispatchable, counted in ``kvherd_ejections_total``); after the ejection time the
  next active probe is its half-open trial. A comeback resubscribes its KV events (it may have
  restarted).
  Its listeners hear `instance_lost` (the proxy fails over the requests in flight there at once).
- P/D disaggregation: an instance's role is its spec's (``--instance URL,role=...``, a
  registration's ``role``) or else the one it reports. While some instance only prefills or only
  decodes, `dispatch` pairs each request through the P/D policy (`pd_policy_spec`, default
  ``kvherd``): it returns the prefill instance, and `handoff_target(key)` the decode instance the
  prefill instance hands the request to after its first token (None: no handoff). The handoff's
  commit moves the request's accounting like any live migration (`request_migrated`).
- Models (`scheduler.core.model_index.ModelIndex`, `models`): each instance's model cards come
  from its spec (what ``/v1/models`` said when it was probed, or its registration's ``model``),
  then from `ModelPoller` every ``models_interval_s``, unless the operator pinned them
  (`set_models`, the admin API). `dispatch(..., only=, block_size=)` routes among the instances
  serving the request's model, its chain hashed at the model's block size; `served_adapter`
  records an adapter the proxy loaded on an instance; `describe_models` each model's block size,
  instances and prefix hits.
- Policies: `set_policy(spec, params)` switches the dispatch policy at run time, loading only what
  the operator's `PolicyAllowList` admits (built-in names, entry points, allow-listed modules, the
  policy directory); a spec that is refused or does not load raises `FleetError(400)` and the old
  policy stays. The start-up `policy_spec` is the operator's own and loads unrestricted.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import time
from collections import OrderedDict
from collections.abc import Callable, Collection, Coroutine, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol
from urllib.parse import urlsplit

import zmq

from kvherd.fleet_token import auth_headers
from policies.registry import (
    PolicyAllowList,
    PolicyLoadError,
    load_dispatch_policy,
    load_pd_policy,
)
from policies.views import NoInstanceError, RequestView
from scheduler.core.cache_truth import CacheTruth
from scheduler.core.cluster_state import ClusterState
from scheduler.core.inflight import InflightLedger
from scheduler.core.load_report import LoadReport
from scheduler.core.model_index import ModelCard, ModelIndex
from scheduler.core.outliers import Health
from scheduler.core.prefix_pull import PullAction, PullPeer, PullSettings, pull_peer
from scheduler.core.prompt_book import PromptBook
from scheduler.core.router import Routed, Router
from scheduler.core.slow_start import SlowStart, SlowStartSettings
from scheduler.core.ttft_model import TERMS
from scheduler.fleet_health import FleetHealth
from scheduler.kv_subscriber import KVEventSubscriber
from scheduler.load_poller import LoadPoller
from scheduler.metrics import ProxyMetrics
from scheduler.model_poller import ModelPoller

if TYPE_CHECKING:
    from scheduler.migration_driver import MigrationDriver

log = logging.getLogger("kvherd.fleet")

# Client request ids remembered for `Fleet.request_key` (the oldest are forgotten first).
MAX_REQUEST_ALIASES = 65_536


class FleetError(Exception):
    """A membership or policy change the fleet refuses (HTTP status + message)."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param


class FleetListener(Protocol):
    """What the fleet reports to the request path (`Fleet.subscribe`)."""

    def capacity_freed(self) -> None:
        """A request finished or moved, or an instance joined or recovered: room may be free."""

    def instance_lost(self, instance_id: str, url: str) -> None:
        """The instance was ejected or removed: its requests in flight must fail over."""


class NoCapacityError(Exception):
    def __init__(self, saturated: bool) -> None:
        super().__init__("every instance is saturated" if saturated else "no instance available")
        self.saturated = saturated


@dataclass(slots=True)
class InstanceSpec:
    instance_id: str
    url: str
    kv_events_endpoint: str | None = None
    replay_endpoint: str | None = None
    model: str | None = None
    block_size: int | None = None
    registered: bool = False  # through the admin API (heartbeats expected) vs static
    kv_events_bind: bool = False  # bind kv_events_endpoint (the engine connects its PUB)
    kv_topic: str | None = None  # its messages on the shared bound endpoint carry this topic
    kvherd_agent: bool = True  # hashes blocks exactly like kvherd (engine hashes are trusted)
    max_model_len: int | None = None  # from its /v1/models; the proxy refuses longer requests
    role: str | None = None  # P/D role override ("prefill", "decode", "mixed"); None: as reported
    max_num_seqs: int | None = None  # batch slots, when the engine does not report them (vLLM)
    pull_address: str | None = None  # a kvherd agent's block server (prefix pulls from it)
    runtime_lora: bool = False  # a kvherd agent that loads LoRA adapters on demand
    models: list[ModelCard] | None = None  # its /v1/models cards (None: only `model`, if known)
    models_pinned: bool = False  # the operator's list: not polled


@dataclass(slots=True)
class FleetInstance:
    instance_id: str
    url: str
    spec: InstanceSpec
    last_heartbeat: float = 0.0
    served: int = 0
    failures: int = 0
    block_size: int | None = None  # the instance's own, once known
    leaving: bool = False  # its agent said it is shutting down (SIGTERM)
    block_size_mismatch: dict[str, Any] | None = None
    kv_fallback: str | None = None  # why it is routed with the approximate index despite events


@dataclass(slots=True)
class FleetSettings:
    block_size: int | None = None  # every model's (None: learned from each model's instances)
    model_block_sizes: dict[str, int] = field(default_factory=dict)  # pinned per base model
    max_inflight_per_instance: int = 256
    failure_threshold: int = 3
    base_ejection_s: float = 5.0
    max_ejection_s: float = 120.0
    health_interval_s: float = 2.0
    health_timeout_s: float = 2.0
    load_interval_s: float = 0.25
    heartbeat_timeout_s: float = 10.0
    kv_events: bool = True  # subscribe to instances' KV events when they offer them
    approx_ttl_s: float = 120.0
    replay_timeout_s: float = 2.0
    kv_events_bind: str | None = None  # a SUB endpoint engines connect to (attributed by topic)
    kv_silence_warn_s: float = 30.0
    fleet_token: str | None = None  # sent to the agents' control routes (the state snapshot)
    prefix_pull: PullSettings | None = None  # pull long prefixes between agents (None: off)
    models_interval_s: float = 2.0  # how often each instance's /v1/models is read again
    handover: bool = True  # a leaving agent's prefixes are pulled by survivors (`handover`)
    slow_start_s: float = 0.0  # a launched instance's traffic ramps over this long (0: at once)


class Fleet:
    def __init__(
        self,
        policy_spec: str,
        settings: FleetSettings,
        metrics: ProxyMetrics,
        policy_params: dict[str, Any] | None = None,
        clock: Callable[[], float] = time.monotonic,
        policy_allow: PolicyAllowList | None = None,
        pd_policy_spec: str = "kvherd",
        lag_owed: Callable[[float], float] | None = None,
    ) -> None:
        self.settings = settings
        self.policy_allow = policy_allow or PolicyAllowList()
        self.metrics = metrics
        self.clock = clock
        self.block_size_pinned = settings.block_size is not None  # the default is settled
        self._pin_all = settings.block_size is not None
        self.model_block_sizes: dict[str, int] = dict(settings.model_block_sizes)
        self.cluster = ClusterState(
            block_size=settings.block_size or 16, approx_ttl_s=settings.approx_ttl_s
        )
        self.policy_spec = policy_spec
        self.policy_params = dict(policy_params or {})
        try:
            policy = load_dispatch_policy(policy_spec, **self.policy_params)
            pd_policy = load_pd_policy(pd_policy_spec)
        except PolicyLoadError as exc:
            raise FleetError(400, str(exc), "policy") from exc
        self.pd_policy_spec = pd_policy_spec
        self.router = Router(
            self.cluster, policy, pd_policy, pull=settings.prefix_pull, peers=self._pull_peer,
            slow_start=SlowStart(SlowStartSettings(window_s=settings.slow_start_s)),
        )  # fmt: skip
        self._handoffs: dict[str, str] = {}  # routing key -> its decode instance (P/D)
        self.truth = CacheTruth()  # engines' reported hits against the event index's claims
        self.prompts = PromptBook()  # tokens behind what vLLM servers cache (`scheduler.handover`)
        metrics.cache_truth = self.truth
        metrics.ttft_model = self.cluster.ttft
        self.last_routed: Routed | None = None  # the last dispatch's decision (for traces)
        self._pulls: dict[str, tuple[str, int]] = {}  # routing key -> (holder's address, blocks)
        self.instances: dict[str, FleetInstance] = {}
        self.inflight = InflightLedger(settings.max_inflight_per_instance)
        self._listeners: list[FleetListener] = []
        self.subscriber = KVEventSubscriber(
            self.cluster,
            settings.replay_timeout_s,
            observer=self,
            silence_warn_s=settings.kv_silence_warn_s,
            clock=clock,
        )
        self.poller = LoadPoller(
            self._urls,
            self._on_report,
            self._instance_block_size,
            settings.load_interval_s,
            headers=auth_headers(settings.fleet_token),
            on_failure=metrics.load_poll_failed,
        )
        self.models = ModelIndex()
        self.model_poller = ModelPoller(
            self._model_targets,
            self._on_models,
            settings.models_interval_s,
            headers=auth_headers(settings.fleet_token),
        )
        self.health = FleetHealth(
            lambda: self.cluster,
            self._urls,
            metrics,
            self._health_changed,
            clock,
            failure_threshold=settings.failure_threshold,
            base_ejection_s=settings.base_ejection_s,
            max_ejection_s=settings.max_ejection_s,
            health_interval_s=settings.health_interval_s,
            health_timeout_s=settings.health_timeout_s,
            lag_owed=lag_owed,
        )
        self._reaper: asyncio.Task[None] | None = None
        self._key_prefix = os.urandom(6).hex()
        self._key_counter = itertools.count(1)
        self._aliases: OrderedDict[str, str] = OrderedDict()  # client request id -> key
        # Streams the relay holds open, across attempts -> waiters for their next dispatch.
        self._streams: dict[str, list[asyncio.Future[None]]] = {}
        # Live migration (``--migration-policy``); None when the policy is "none".
        self.migration: MigrationDriver | None = None
        self.migration_spec = "none"

    @property
    def block_size(self) -> int:
        """The fleet's default block size (requests naming no model, models not yet known)."""
        return self.cluster.block_size

    def block_size_of_model(self, base: str | None) -> int:
        """The block size requests for base model `base` (an adapter's parent) hash with."""
        if base is None:
            return self.cluster.block_size
        return self.model_block_sizes.get(base, self.cluster.block_size)

    def _instance_block_size(self, instance_id: str) -> int:
        cluster = self.cluster
        return cluster.get(instance_id).block_size if instance_id in cluster else cluster.block_size

    # -- lifecycle ---------------------------------------------------------------------------
    async def start(self) -> None:
        if self.settings.kv_events_bind is not None:
            try:
                bound = await self.subscriber.bind_shared(self.settings.kv_events_bind)
            except zmq.ZMQError as exc:
                raise FleetError(
                    400, f"cannot bind --kv-events-bind {self.settings.kv_events_bind}: {exc}"
                ) from exc
            log.info("KV events from connecting engines on %s (attributed by topic)", bound)
        self.subscriber.start()
        self.poller.start()
        self.model_poller.start()
        self.health.prober.start()
        self._reaper = asyncio.create_task(self._reap(), name="kvherd-heartbeat-reaper")

    async def stop(self) -> None:
        if self._reaper is not None:
            self._reaper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reaper
        await self.poller.stop()
        await self.model_poller.stop()
        await self.health.prober.stop()
        await self.subscriber.close()

    async def _reap(self) -> None:
        while True:
            await asyncio.sleep(max(0.5, self.settings.heartbeat_timeout_s / 4))
            deadline = self.clock() - self.settings.heartbeat_timeout_s
            for inst in list(self.instances.values()):
                if inst.spec.registered and inst.last_heartbeat < deadline:
                    log.warning("instance %s missed its heartbeats; removing", inst.instance_id)
                    await self.remove_instance(inst.instance_id)

    # -- membership --------------------------------------------------------------------------
    def _urls(self) -> dict[str, str]:
        return {i: inst.url for i, inst in self.instances.items()}

    def _expected_block_size(self, spec: InstanceSpec) -> int | None:
        """The block size `spec`'s blocks must hold: its model's (None: not settled yet)."""
        bases = _base_models(spec)
        for base in bases:
            size = self.model_block_sizes.get(base)
            if size is not None:
                return size
        if bases and not self._pin_all:
            return None
        return self.cluster.block_size if self.block_size_pinned else None

    def _hashed_block_size(self, spec: InstanceSpec) -> int:
        """The block size `spec`'s events are indexed at (its model's, else the default)."""
        expected = self._expected_block_size(spec)
        return self.cluster.block_size if expected is None else expected

    def _whose(self, spec: InstanceSpec) -> str:
        bases = [b for b in _base_models(spec) if b in self.model_block_sizes]
        return f"model {bases[0]!r}" if bases else "the fleet"

    def _learn_block_size(self, spec: InstanceSpec, block_size: int, source: str) -> bool:
        """Settle the block size of `spec`'s models, and the default, where not yet settled;
        True when one changed."""
        changed = False
        if not self.block_size_pinned:
            self.block_size_pinned = True
            log.info("fleet block size %d, from %s", block_size, source)
            changed = block_size != self.cluster.block_size
            self.cluster.block_size = block_size
        if self._pin_all:
            return changed
        for base in _base_models(spec):
            if base not in self.model_block_sizes:
                self.model_block_sizes[base] = block_size
                log.info("model %s: block size %d, from %s", base, block_size, source)
                changed = True
        return changed

    def _adopt_block_size(self, spec: InstanceSpec) -> bool:
        """Check a joining instance's declared block size against its model's (refused when it
        differs) and settle what it settles; True when a block size changed."""
        if spec.block_size is None:
            return False
        expected = self._expected_block_size(spec)
        if expected is not None and spec.block_size != expected:
            raise FleetError(
                400,
                f"instance {spec.instance_id} has block size {spec.block_size} but "
                f"{self._whose(spec)} hashes with {expected}: kvherd routes one block size per "
                f"model (start the engine with --block-size {expected}, or serve it under "
                "another model name)",
                "block_size",
            )
        return self._learn_block_size(spec, spec.block_size, f"instance {spec.instance_id}")

    def _retune(self) -> None:
        """Index every instance at its model's block size (after one settled): an instance whose
        size changed forgets its blocks and replays its KV events at the new size."""
        for instance_id, inst in self.instances.items():
            if instance_id not in self.cluster:
                continue
            size = self._hashed_block_size(inst.spec)
            if self.cluster.get(instance_id).block_size == size:
                continue
            resync = self.cluster.set_block_size(instance_id, size)
            if resync is not None and self._has_events(inst.spec):
                _spawn(self._subscribe(inst.spec))

    def _has_events(self, spec: InstanceSpec) -> bool:
        return self.settings.kv_events and (
            spec.kv_events_endpoint is not None or spec.kv_topic is not None
        )

    async def _join_core(self, spec: InstanceSpec) -> bool:
        """Register `spec` with the cluster core and (re)subscribe its KV events."""
        has_events = self._has_events(spec)
        self.cluster.add_instance(
            spec.instance_id,
            has_kv_events=has_events,
            trust_engine_hashes=spec.kvherd_agent,
            role=spec.role,
            batch_slots=spec.max_num_seqs or 0,
            block_size=self._hashed_block_size(spec),
            host=urlsplit(spec.url).hostname,
        )
        if has_events:
            await self._subscribe(spec)
        else:
            await self.subscriber.remove(spec.instance_id)
        return has_events

    async def _subscribe(self, spec: InstanceSpec) -> None:
        try:
            await self.subscriber.add(
                spec.instance_id,
                spec.kv_events_endpoint,
                spec.replay_endpoint,
                bind=spec.kv_events_bind,
                topic=spec.kv_topic,
            )
        except (zmq.ZMQError, ValueError) as exc:
            raise FleetError(
                400, f"instance {spec.instance_id}: cannot follow its KV events: {exc}"
            ) from exc

    async def add_instance(self, spec: InstanceSpec) -> bool:
        """Add or re-add an instance; True when it is new."""
        settled = self._adopt_block_size(spec)
        existing = self.instances.get(spec.instance_id)
        if existing is not None and existing.url != spec.url:
            self.metrics.forget_instance(spec.instance_id)
        inst = FleetInstance(
            spec.instance_id,
            spec.url,
            spec,
            last_heartbeat=self.clock(),
            block_size=spec.block_size,
        )
        if existing is not None:
            inst.served, inst.failures = existing.served, existing.failures
        self.instances[spec.instance_id] = inst
        self.models.set_models(spec.instance_id, _cards(spec))
        self.health.add(spec.instance_id)
        try:
            has_events = await self._join_core(spec)
        except FleetError:
            await self.remove_instance(spec.instance_id)
            raise
        self.cluster.set_healthy(spec.instance_id, True)
        if settled:
            self._retune()  # instances waiting for the default (or this model's size) follow
        log.info(
            "instance %s at %s %s (%s)",
            spec.instance_id,
            spec.url,
            "re-added" if existing else "added",
            "KV events" if has_events else "approximate prefix index",
        )
        self._capacity_freed()
        return existing is None

    async def remove_instance(self, instance_id: str) -> bool:
        inst = self.instances.pop(instance_id, None)
        if inst is None:
            return False
        await self.subscriber.remove(instance_id)
        self.models.remove_instance(instance_id)
        self.router.forget_instance(instance_id)
        self.truth.remove_instance(instance_id)
        self.health.remove(instance_id)
        self.poller.forget(instance_id)
        self.metrics.forget_instance(instance_id)
        log.info("instance %s removed", instance_id)
        self._lost(instance_id, inst.url)
        return True

    def heartbeat(self, instance_id: str, leaving: bool = False) -> bool:
        """Record a registered agent's heartbeat; `leaving`: it is draining to shut down."""
        inst = self.instances.get(instance_id)
        if inst is None:
            return False
        inst.last_heartbeat = self.clock()
        inst.leaving = inst.leaving or leaving
        if leaving and not self.cluster.get(instance_id).draining:
            log.info("instance %s is shutting down: draining it", instance_id)
            self.cluster.set_draining(instance_id, True)
        return True

    def set_draining(self, instance_id: str, draining: bool) -> None:
        if instance_id not in self.instances:
            raise FleetError(404, f"unknown instance {instance_id!r}")
        self.cluster.set_draining(instance_id, draining)

    def set_policy(self, spec: str, params: dict[str, Any]) -> None:
        try:
            policy = self.policy_allow.load_dispatch_policy(spec, params)
        except (PolicyLoadError, TypeError, ValueError) as exc:
            raise FleetError(400, f"cannot load policy {spec!r}: {exc}", "policy") from exc
        self.router.set_policy(policy)
        self.policy_spec, self.policy_params = spec, dict(params)
        log.info("dispatch policy switched to %s", spec)

    # -- models ------------------------------------------------------------------------------
    def _model_targets(self) -> dict[str, str]:
        return {i: inst.url for i, inst in self.instances.items() if not inst.spec.models_pinned}

    def _on_models(self, instance_id: str, cards: list[ModelCard]) -> None:
        inst = self.instances.get(instance_id)
        if inst is None or inst.spec.models_pinned:
            return
        inst.spec.models = cards
        if self.models.set_models(instance_id, cards):
            log.info("instance %s serves %s", instance_id, [card["id"] for card in cards])
            self._models_changed(inst)

    def _models_changed(self, inst: FleetInstance) -> None:
        """An instance's model list changed: check and settle its block size for them."""
        if inst.block_size is not None:
            self._observe_block_size(inst.instance_id, inst.block_size, "its model list")
        self._retune()

    def set_models(self, instance_id: str, cards: list[ModelCard] | None) -> None:
        """The operator's model list for an instance (None: learn it from the instance again)."""
        inst = self.instances.get(instance_id)
        if inst is None:
            raise FleetError(404, f"unknown instance {instance_id!r}")
        inst.spec.models_pinned = cards is not None
        if cards is not None:
            inst.spec.models = cards
            if self.models.set_models(instance_id, cards):
                self._models_changed(inst)

    def served_adapter(self, instance_id: str, adapter: str, path: str, parent: str | None) -> None:
        """`instance_id` loaded `adapter` (from `path`) at the proxy's request: route it there."""
        inst = self.instances.get(instance_id)
        if inst is None:
            return
        known = list(_cards(inst.spec) or [])
        if parent is None:  # the instance's base model
            parent = next((card["id"] for card in known if not card.get("parent")), None)
        if all(card["id"] != adapter for card in known):
            known.append({"id": adapter, "object": "model", "root": path, "parent": parent})
        inst.spec.models = known
        if self.models.set_models(instance_id, known):
            self._models_changed(inst)

    # -- load and health inputs --------------------------------------------------------------
    def _on_report(self, instance_id: str, report: LoadReport) -> None:
        if instance_id in self.cluster:
            self.cluster.apply_report(instance_id, report, self.clock())
        if report.block_size is not None:
            self._observe_block_size(instance_id, report.block_size, "its load report")

    # -- what the KV event streams report (the subscriber's observer protocol) --------------
    def kv_block_size_seen(self, instance_id: str, block_size: int) -> None:
        self._observe_block_size(instance_id, block_size, "its KV events")

    def kv_history_lost(self, instance_id: str, detail: str) -> None:
        self.metrics.kv_history_lost(instance_id)
        self._approximate(instance_id, detail)

    def kv_events_silent(self, instance_id: str, silent_s: float) -> None:
        self.metrics.kv_events_silent(instance_id)

    def _observe_block_size(self, instance_id: str, block_size: int, source: str) -> None:
        inst = self.instances.get(instance_id)
        if inst is None:
            return
        if inst.block_size is None:
            inst.block_size = block_size
        expected = self._expected_block_size(inst.spec)
        if expected is None or block_size == expected:
            if self._learn_block_size(inst.spec, block_size, f"instance {instance_id} ({source})"):
                self._retune()
            return
        if inst.block_size_mismatch is not None:
            return
        inst.block_size_mismatch = {
            "instance_block_size": block_size,
            "fleet_block_size": expected,
            "source": source,
        }
        log.warning(
            "instance %s has block size %d (%s) but %s hashes with %d: its KV events "
            "cannot be used and it is routed with the approximate index (start it with "
            "--block-size %d, or serve it under another model name)",
            instance_id,
            block_size,
            source,
            self._whose(inst.spec),
            expected,
            expected,
        )
        self.metrics.block_size_mismatch(instance_id, block_size)
        self._approximate(instance_id, f"block size {block_size} differs from its model's")

    def _approximate(self, instance_id: str, reason: str) -> None:
        """Route the instance with the approximate index (full chains, full TTL) from now on."""
        inst = self.instances.get(instance_id)
        if inst is None or inst.kv_fallback is not None or instance_id not in self.cluster:
            return
        inst.kv_fallback = reason
        state = self.cluster.get(instance_id)
        state.has_kv_events = False  # routed chains go to the approximate index whole
        self.cluster.approx_index.add_instance(instance_id)  # with the approximate TTL
        self.cluster.touch(instance_id)

    def _health_changed(self, instance_id: str, change: Health) -> None:
        """An ejection fails over its requests; a recovery resubscribes and frees capacity."""
        if change is Health.EJECTED:
            self._lost(instance_id, self.instances[instance_id].url)
        else:
            spec = self.instances[instance_id].spec
            if self._has_events(spec):
                # It may have restarted with an empty cache: rebuild its prefix view.
                task = asyncio.get_running_loop().create_task(self._subscribe(spec))
                task.add_done_callback(lambda t: t.exception())
            self._capacity_freed()

    # -- what the fleet tells its listeners (the proxy) --------------------------------------
    def subscribe(self, listener: FleetListener) -> None:
        self._listeners.append(listener)

    def _capacity_freed(self) -> None:
        for listener in self._listeners:
            listener.capacity_freed()

    def _lost(self, instance_id: str, url: str) -> None:
        for listener in self._listeners:
            listener.instance_lost(instance_id, url)

    # -- request path ------------------------------------------------------------------------
    def new_key(self, client_request_id: str) -> str:
        """The fleet's own id for a new request (see the module contract)."""
        key = f"{self._key_prefix}-{next(self._key_counter):x}"
        aliases = self._aliases
        held = aliases.get(client_request_id)
        if held is None or not self.in_flight(held):
            aliases[client_request_id] = key
            aliases.move_to_end(client_request_id)
            if len(aliases) > MAX_REQUEST_ALIASES:
                aliases.popitem(last=False)
        return key

    def request_key(self, request_id: str) -> str:
        """The key of a request in flight named by its key or by its client's X-Request-Id."""
        if self.in_flight(request_id):
            return request_id
        return self._aliases.get(request_id, request_id)

    def in_flight(self, key: str) -> bool:
        """Placed on an instance, or its stream is open (see the module contract)."""
        return key in self._streams or self.router.instance_of(key) is not None

    def stream_opened(self, key: str) -> None:
        """The relay relays `key`'s stream (its attempts may end and be continued)."""
        self._streams.setdefault(key, [])

    def stream_closed(self, key: str) -> None:
        """`key`'s stream has ended, for the client too."""
        for waiter in self._streams.pop(key, ()):
            if not waiter.done():
                waiter.set_result(None)

    async def placement(self, key: str, timeout_s: float) -> str | None:
        """The instance `key` runs on; while its stream is open between two attempts, after up
        to `timeout_s` of waiting for its next dispatch. None: not placed (unknown, ended, or
        still between attempts)."""
        where = self.router.instance_of(key)
        waiters = self._streams.get(key)
        if where is not None or waiters is None:
            return where
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        waiters.append(waiter)
        try:
            async with asyncio.timeout(timeout_s):
                await waiter
        except TimeoutError:
            waiters.remove(waiter)
        return self.router.instance_of(key)

    def dispatch(
        self,
        key: str,
        num_tokens: int,
        block_hashes: Sequence[int],
        *,
        tenant: str | None = None,
        max_tokens: int | None = None,
        exclude: Collection[str] = (),
        only: frozenset[str] | None = None,
        adapter: str | None = None,
        block_size: int | None = None,
        slo_ttft_s: float | None = None,
    ) -> tuple[FleetInstance, int]:
        saturated = self.inflight.saturated
        if saturated:
            skip: Collection[str] = saturated.union(exclude)
        else:
            skip = exclude
        try:
            routed = self.router.route(
                key,
                now=self.clock(),
                num_tokens=num_tokens,
                block_hashes=block_hashes,
                tenant=tenant,
                max_tokens=max_tokens,
                exclude=skip,
                only=only,
                adapter=adapter,
                block_size=block_size,
                slo_ttft_s=slo_ttft_s,
            )
        except NoInstanceError:
            # Worth waiting only if an instance that may still be tried is merely full.
            busy = any(
                i not in exclude
                and (only is None or i in only)
                and self.cluster.get(i).healthy
                and not self.cluster.get(i).draining
                for i in saturated
            )
            raise NoCapacityError(saturated=busy) from None
        inst = self.instances[routed.instance_id]
        self.last_routed = routed
        waiters = self._streams.get(key)
        if waiters:  # a stream continued: orders waiting for its placement go on
            for waiter in waiters:
                if not waiter.done():
                    waiter.set_result(None)
            waiters.clear()
        if routed.decode_id is not None:
            self._handoffs[key] = routed.decode_id
        elif routed.claimed_blocks is not None:
            size = block_size or self.cluster.block_size
            self.truth.expect(key, inst.instance_id, routed.claimed_blocks * size, size)
        if routed.tier_blocks:
            self.metrics.tier_hits(routed.tier_blocks)
        pull = routed.pull
        if pull is not None and pull.action is PullAction.PULL:  # counted once sent (`pull_for`)
            assert pull.source is not None  # (the rule's sources have a block server)
            address = self.instances[pull.source].spec.pull_address
            assert address is not None
            self._pulls[key] = (address, pull.first_block + pull.num_blocks)
        elif pull is not None:
            self.metrics.pull_decided(pull.action.value)
        if len(block_hashes) > routed.matched_blocks:  # the engine will store blocks: events due
            self.subscriber.note_traffic(inst.instance_id)
        self.inflight.attach(inst.instance_id, key)
        self.metrics.set_inflight(inst.instance_id, self.inflight.count(inst.instance_id))
        return inst, routed.matched_blocks

    def pull_for(self, key: str) -> tuple[str, int] | None:
        """The prefix pull the router chose for `key`: (the holder's block server, the prompt
        blocks it holds), once; None when it runs on what its instance holds. The caller sends
        it: only then does it count as a pull decision."""
        pull = self._pulls.pop(key, None)
        if pull is not None:
            self.metrics.pull_decided(PullAction.PULL.value)
        return pull

    def _pull_peer(self, instance_id: str) -> PullPeer:
        """What `instance_id` can do in a prefix pull (the pull rule's `peers`)."""
        inst = self.instances.get(instance_id)
        if inst is None:
            return pull_peer(True, None)
        return pull_peer(inst.spec.kvherd_agent, inst.spec.pull_address)

    def choose_instance(
        self,
        num_tokens: int,
        block_hashes: Sequence[int],
        only: frozenset[str],
        adapter: str,
        block_size: int | None = None,
    ) -> FleetInstance:
        """The instance the dispatch policy would pick among `only` for such a request, with
        nothing charged (`NoCapacityError` when none of them is dispatchable)."""
        request = RequestView(
            "", num_tokens, tuple(block_hashes), block_size or self.cluster.block_size,
            adapter=adapter,
        )  # fmt: skip
        try:
            decision = self.router.choose(request, self.clock(), only)
        except NoInstanceError:
            raise NoCapacityError(saturated=False) from None
        return self.instances[decision.instance_id]

    def handoff_target(self, key: str) -> FleetInstance | None:
        """The decode instance `key` is handed to after its first token (P/D), if any."""
        decode_id = self._handoffs.get(key)
        return None if decode_id is None else self.instances.get(decode_id)

    def ramp(self, instance_id: str) -> None:
        """`instance_id` joined a serving fleet: its traffic ramps up (`scheduler.core.slow_start`,
        with ``--slow-start``); a fleet's first instance does not ramp."""
        if any(other != instance_id for other in self.instances):
            self.router.slow_start.joined(instance_id, self.clock())

    def handoff_failed(self, key: str) -> None:
        """`key`'s P/D handoff fell back: it decodes where it was prefilled."""
        self.router.on_handoff_failed(key)

    def first_token(self, key: str) -> None:
        self.router.on_first_token(key, self.clock())

    def request_migrated(self, key: str, dst: str) -> None:
        """A live migration committed: `key` now runs on instance `dst`."""
        self.router.on_migrated(key, dst, self.clock())
        if dst not in self.instances:
            return
        src = self.inflight.move(key, dst)
        if src is None:
            return
        self.metrics.set_inflight(src, self.inflight.count(src))
        self.metrics.set_inflight(dst, self.inflight.count(dst))
        self._capacity_freed()

    def cache_reported(self, key: str, model: str, cached_tokens: int) -> None:
        """The engine serving `key` reported `cached_tokens` prompt tokens cached: checked against
        what its events claimed; an instance that stops (or starts again) hitting what they say is
        routed by the approximate index (or its events again)."""
        turn = self.truth.check(self.cluster, key, model, cached_tokens)
        if turn is None:
            return
        if turn.diverging:
            log.warning(
                "instance %s: the engine recomputed %d of the %d prompt tokens its KV events "
                "said were cached over its last %d checked requests (%.0f%%): routed with the "
                "approximate index until they agree again",
                turn.instance_id, turn.missing_tokens, turn.claimed_tokens, turn.checks,
                100 * turn.divergence,
            )  # fmt: skip
        else:
            log.info(
                "instance %s: the engine hits what its KV events say again (%.0f%% missing over "
                "%d requests): routed with its events",
                turn.instance_id, 100 * turn.divergence, turn.checks,
            )  # fmt: skip

    def _release(self, key: str) -> None:
        self.truth.forget(key)
        self._handoffs.pop(key, None)
        self._pulls.pop(key, None)
        self.router.on_finish(key, self.clock())
        where = self.inflight.release(key)  # differs from the dispatch's after a migration
        if where is not None:
            self.metrics.set_inflight(where, self.inflight.count(where))
        self._capacity_freed()

    def request_finished(self, key: str, inst: FleetInstance, ok: bool = True) -> None:
        self._release(key)
        current = self.instances.get(inst.instance_id)
        if current is None:
            return
        current.served += 1
        if ok:
            self.health.succeeded(inst.instance_id)

    def request_failed(self, key: str, inst: FleetInstance) -> None:
        self._release(key)
        current = self.instances.get(inst.instance_id)
        if current is None:
            return
        current.failures += 1
        self.health.failed(inst.instance_id)

    # -- introspection -----------------------------------------------------------------------
    def max_model_len(self) -> int | None:
        """The longest context some instance takes; None unless every instance said."""
        longest = 0
        for inst in self.instances.values():
            limit = inst.spec.max_model_len
            if limit is None:
                return None
            longest = max(longest, limit)
        return longest or None

    def model_cards(self) -> list[ModelCard]:
        """Every model and adapter the fleet serves, as vLLM's ``/v1/models`` lists them."""
        return self.models.cards()

    def num_dispatchable(self) -> int:
        return sum(
            1
            for i in self.instances
            if self.cluster.get(i).healthy and not self.cluster.get(i).draining
        )

    def roles(self) -> dict[str, str]:
        """Each instance's P/D role."""
        cluster = self.cluster
        return {i: cluster.get(i).view().role for i in self.instances if i in cluster}

    def state_counts(self) -> dict[str, int]:
        counts = {"healthy": 0, "ejected": 0, "half_open": 0, "draining": 0}
        now = self.clock()
        for i in self.instances:
            state = self.health.state(i, now)
            counts[str(state)] += 1
            if self.cluster.get(i).draining:
                counts["draining"] += 1
        return counts

    def describe_one(self, instance_id: str) -> dict[str, Any]:
        inst = self.instances.get(instance_id)
        if inst is None:
            raise FleetError(404, f"unknown instance {instance_id!r}")
        state = self.cluster.get(instance_id)
        view = state.view()
        spec = inst.spec
        kv: dict[str, Any] | None = None
        if instance_id in self.cluster.prefix_index:
            tiers = self.cluster.prefix_index.tier_counts(instance_id)
            kv = {
                "endpoint": spec.kv_events_endpoint,
                "bind": spec.kv_events_bind,
                "topic": spec.kv_topic,
                "replay_endpoint": spec.replay_endpoint,
                "fallback": inst.kv_fallback,
                "trusted": self.cluster.index_trusted(instance_id),
                "divergence": self.truth.divergence(instance_id),
                "indexed_blocks": tiers["GPU"],
                "indexed_blocks_by_tier": tiers,
                "stream": self.subscriber.stats(instance_id),
            }
        return {
            "instance_id": instance_id,
            "url": inst.url,
            "model": spec.model,
            "models": self.models.models_of(instance_id),
            "models_pinned": spec.models_pinned,
            "block_size": inst.block_size,
            "fleet_block_size": state.block_size,  # what its model's requests hash with
            "block_size_mismatch": inst.block_size_mismatch,
            "registered": spec.registered,
            "pull_address": spec.pull_address,
            "role": view.role,
            "health": str(self.health.state(instance_id, self.clock())),
            "draining": state.draining,
            "inflight": self.inflight.count(instance_id),
            "peer_inflight": state.peer.inflight,  # what other router replicas say
            "served": inst.served,
            "failures": inst.failures,
            "load": {
                "num_running": view.num_running,
                "num_waiting": view.num_waiting,
                "kv_usage": view.kv_usage,
                "free_blocks": view.free_blocks,
                "capacity_blocks": view.capacity,
                "freeness": None if view.freeness == float("inf") else view.freeness,
                "reported": state.report_time is not None,
            },
            "tiers": [  # what the instance reports holding per KV tier (kvherd agents)
                {
                    "medium": t.medium,
                    "num_blocks": t.num_blocks,
                    "capacity_blocks": t.capacity_blocks,
                }
                for t in state.report.tiers or ()
            ],
            "kv_events": kv,
            "ttft_model": self._ttft_model(instance_id),
        }

    def _ttft_model(self, instance_id: str) -> dict[str, Any]:
        """The learned TTFT model of `instance_id` (`scheduler.core.ttft_model`), for the admin API."""
        model = self.cluster.ttft
        quality = model.quality(instance_id)
        weights = model.coefficients(instance_id)
        return {
            "samples": quality.samples,
            "r2": quality.r2,
            "error_ratio": quality.error_ratio,
            "own_fit": model.fitted(instance_id) is not None,  # else the fleet's predicts
            "weights_s": None if weights is None else dict(zip(TERMS, weights, strict=True)),
        }

    def describe(self) -> list[dict[str, Any]]:
        return [self.describe_one(i) for i in self.instances]

    def describe_models(self) -> list[dict[str, Any]]:
        """Each model the fleet serves: its block size, the instances serving it, and the
        requests, prompt blocks and hit blocks routed for it, and the requests that queued."""
        figures = self.metrics.model_figures()
        described = []
        for card in self.models.cards():
            model, parent = card["id"], card.get("parent")
            only = self.models.route(model)
            requests, prompt_blocks, hit_blocks, queued = figures.get(model, (0, 0, 0, 0))
            described.append(
                {
                    "id": model,
                    "parent": parent,
                    "block_size": self.block_size_of_model(parent or model),
                    "instances": sorted(self.instances if only is None else only),
                    "requests": requests,
                    "prompt_blocks": prompt_blocks,
                    "hit_blocks": hit_blocks,
                    "queued": queued,
                }
            )
        return described

    def policy_info(self) -> dict[str, Any]:
        info: dict[str, Any] = {
            "policy": self.policy_spec,
            "name": getattr(self.router.policy, "name", self.policy_spec),
            "parameters": self.policy_params,
            "migration_policy": self.migration_spec,
            "pd_policy": self.pd_policy_spec,
        }
        if self.migration is not None:
            stats = self.migration.loop.stats
            info["migration"] = {
                "in_flight": len(self.migration.loop.in_flight),
                "issued": stats.issued,
                "succeeded": stats.succeeded,
                "failed": stats.failed,
                "timed_out": stats.timed_out,
                "rejected": stats.rejected,
            }
        return info


def _spawn(work: Coroutine[Any, Any, None]) -> None:
    """Run `work` beside the caller (a resubscription after a block size settled)."""
    task = asyncio.get_running_loop().create_task(work)
    task.add_done_callback(lambda t: t.cancelled() or t.exception())


def _base_models(spec: InstanceSpec) -> list[str]:
    """The base models an instance serves, as its cards say (an adapter counts as its parent)."""
    bases: list[str] = []
    for card in _cards(spec) or ():
        base = card.get("parent") or card["id"]
        if base not in bases:
            bases.append(base)
    return bases


def _cards(spec: InstanceSpec) -> list[ModelCard] | None:
    """What `spec` is known to serve (None: nothing known, it may be sent any model)."""
    if spec.models is not None:
        return spec.models
    if spec.model is None:
        return None
    return [{"id": spec.model, "object": "model", "owned_by": "kvherd", "parent": None}]
