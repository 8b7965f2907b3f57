"""A simulated fleet: trace arrivals -> global scheduler + policy -> simulated instances.

Contract:
- `SimCluster.run(trace)` replays every trace request on a virtual clock. Arrival -> the engine
  `Request` (synthesised prompt, its block-hash chain) -> the dispatch policy chooses an instance from
  the router's view -> the instance's batch scheduler runs it step by step -> metrics.
- The global scheduler is production's own pure core: `scheduler.core.cluster_state.ClusterState` (load
  state, precise prefix index) and `scheduler.core.router.Router` (view -> policy -> optimistic charge).
  It sees the fleet as the proxy does: load reports (the agent's state snapshot as a `LoadReport`)
  taken every `report_interval_s` reach it `report_delay_s` later, KV events reach the prefix index
  `kv_event_delay_s` after the step that emitted them (applied lazily, in due order, before the
  next read: a routing decision or a migration plan), and between reports the router charges its
  own dispatches.
- Migrations (`migration_policy` other than `none`): `scheduler.core.migration_loop.MigrationLoop` asks
  the migration policy every `migration_interval_s`; each accepted order runs Llumnix's multi-stage
  copy through the agents' own sessions (`migration.core.session`: the same checks in the same
  order, the destination's steps from `migration.core.destination`, the request state crossing as
  `Request.to_state()`), stage transfer time = bytes / `migration_bandwidth` +
  `migration_stage_latency_s`; the request keeps decoding during live stages and is suspended only
  for the stop-and-copy stage (between engine steps, never mid-step), then adopted by the
  destination from its serialized state.
- The host (`host`, `simulator.host_model.HostModel`): each request reaches its engine its
  request-path time after the router's decision (`HostModel.request_overhead`: the HTTP path, the
  other busy instances at its arrival, how long the whole fleet has been idle then, 0 while any
  instance runs a step, and its draw from the path's spread, seeded by `seed` and tied to its
  place in the trace so every policy's run sees the same path times; a total below zero is no
  delay), and each engine step is stretched by `HostModel.step_stretch` of the other instances
  busy at its start. A host that times steps by the fleet (`times_steps_by_fleet`) turns decode
  fast-forward off: every step is timed against the fleet as it is when the step starts.
  `InstanceConfig.step_overhead_s` adds the serving loop's per-step cost.
- Decode fast-forward (`fast_forward`, on by default): while no migration is in flight, an
  instance whose next steps are guaranteed pure decode applies all of those that end before the
  next barrier event (arrival, admission, migration tick; a load report too under a migration
  policy, which reads running requests) at once; its step ends, samples and other
  load reports are quiet events (they touch or read nothing a run changes, or replay
  it: `SimInstance.pool_at`). Without a migration policy a run also takes the step in flight
  at the barrier (an admission only queues work for the next `schedule`), and when it ends with
  no admission to its instance, the rest of the guaranteed run goes on without a new check: an
  arrival routed elsewhere splits a run but does not end it. Behind a waiting request an
  admission changes no step, so such a run has no horizon at all. Results equal step-by-step
  simulation except the ITL mean's last bit (a compensated sum of the same gaps in another
  order).
- P/D disaggregation (`prefill_instances` / `decode_instances` > 0, next to `num_instances` mixed
  ones): the router pairs each request with the P/D policy (`Router(..., pd_policy)`, as the
  proxy does), the prefill instance computes the prompt and the first token, and the request is
  handed to its decode instance through the same migration driver and session as a live
  migration (`simulator.pd.SimHandoffs`: order, queueing, outcomes), opened as the agents open
  it, at admission (stage 0 reserves the prompt's blocks on the decode instance from its block
  hashes, sharing those it caches, the rest held there under the migration's owner until later
  stages fill them; while the request waits or prefills, `Wait` drives the session again after
  the source's next step, and each step that filled blocks gets a live stage; the stop-and-copy
  at the first token sends only the rest), each stage timed on the pair's link (`transfer:
  simulator.transfer.TransferModel`); a refused or aborted handoff decodes on the prefill
  instance (held: resumed; still prefilling: no longer held), its reservation freed. Handoff
  byte counts go to `handoff_stats`, outcomes to `handoffs.stats`. Decode fast-forward is off
  in such a fleet (handoffs touch decode instances at any step).
- KV tiers (`InstanceConfig.num_cpu_blocks` / `num_disk_blocks`): each load an engine step starts
  lands after its time on the instance's tier links (`SimInstance.take_loads`), an event that
  calls the engine's `finish_load` between the instance's steps (a barrier: the request joins the
  running batch, so no decode run straddles it). The router prices lower-tier hits with each
  instance's load ratio (`tier_load_ratio`: tier bytes per token over bandwidth, over the latency
  model's prefill time per token).
- Cross-instance prefix pull (`prefix_pull`: `simulator.pull.PullConfig`, mixed fleets only): the
  router asks `scheduler.core.prefix_pull` after the policy, every instance a kvherd agent (its
  block server sends its GPU cache alone). A PULL holds its request back when it reaches its
  instance: between that instance's steps, as the agent does, the blocks past its GPU hits up to
  the choice's end are reserved there under a carrier request (the engine core's `pull_carrier`;
  no room: recompute), the holder's GPU-cached run of them then is copied on the pair's NICs
  (`PullLinks`: contention, read without stalling the holder's steps), cached there by the
  engine's `cache_full_blocks` (KV events and all) and the request is admitted; the carrier lets
  go once the request is scheduled (it hit them) or ends. Counts go to `pull_stats`.
- Models and LoRA adapters (a trace with `model`s; `models`: `simulator.models.FleetModels`,
  default one base model on every instance): each request goes only to the instances serving its
  model, through production's model index (`ModelIndex.route`, the router's `only`), and an
  adapter's request is routed with its `adapter` and hashed with its name on every block (the
  engine `Request`'s `lora_name`). Each instance has `max_loras` adapter slots
  (`simulator.lora.AdapterSlots`): a request whose adapter is not in a slot reaches the engine
  only once it is loaded there (`lora_load_s`, evicting the least recently used adapter no request
  pins; with every slot pinned it waits for one), and its load reports carry the pinned adapters
  and the slot count (`active_adapters`, `lora_slots`), which the policies' adapter views read.
  Not yet with migrations, P/D or prefix pulls (`ValueError`).
- A request the engine refuses (too long for an instance), or whose model no instance serves, is
  counted as failed, never crashes the run.
- Deterministic: same trace, config and seed -> identical results.
"""

from __future__ import annotations

import copy
import heapq
import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass, field

from instance_agent.engine.core.load import engine_load
from instance_agent.engine.core.request import (
    InvalidRequestError,
    Request,
    RequestStatus,
    pull_carrier,
)
from kvherd.kv_events import KVEvent
from migration.core.destination import (
    Accept,
    DestinationProtocol,
    Refuse,
    ReserveAction,
    ReserveBlocks,
    ShareCached,
)
from migration.core.handoff import handoff_stages, holds_first_token
from migration.core.protocol import AbortReason
from migration.core.session import (
    Abort,
    AheadBlocks,
    Commit,
    Copy,
    Done,
    Release,
    RequestSnapshot,
    Reserve,
    Snapshot,
    SourceAction,
    SourceSession,
    Suspend,
    Wait,
)
from migration.core.stages import Stage, StageConfig
from policies.base import DispatchPolicy, MigrationPolicy, PDPolicy
from policies.views import MigrationOrder, NoInstanceError, RunningRequestView
from scheduler.core.admission import AdmissionSettings
from scheduler.core.admission_queue import QueueSettings
from scheduler.core.autoscale import AutoscaleSettings
from scheduler.core.cache_truth import CacheTruth
from scheduler.core.cluster_state import ClusterState
from scheduler.core.load_report import LoadReport
from scheduler.core.migration_loop import MigrationLoop
from scheduler.core.model_index import UnknownModelError
from scheduler.core.prefix_pull import PullAction, PullChoice
from scheduler.core.rate_limit import RateLimits
from scheduler.core.router import Router
from scheduler.core.slow_start import SlowStart, SlowStartSettings
from simulator.admission import SimAdmission
from simulator.autoscale import SimAutoscaler
from simulator.host_model import HostModel
from simulator.instance import DecodeRun, InstanceConfig, SimInstance, make_request
from simulator.latency.base import LatencyModel
from simulator.loop import EventLoop
from simulator.lora import AdapterSlots
from simulator.metrics import MetricsCollector
from simulator.models import FleetModels, ModelRoutes
from simulator.pd import FINISHED_FIRST, SimHandoffs
from simulator.pull import (
    HOLDER_LOST,
    NO_ROOM,
    NOTHING_TO_PULL,
    PullConfig,
    PullLinks,
    PullStats,
    pull_settings,
)
from simulator.routers import RouterReplicas, StateFanout
from simulator.traces import Trace, TraceRequest
from simulator.transfer import TransferLink, TransferModel

# Longest decode run guaranteed by one check (`fast_forward.decode_run_length`'s limit); a
# run that gets that far is checked anew.
_MAX_RUN_STEPS = 512


@dataclass(slots=True)
class ClusterConfig:
    num_instances: int
    instance: InstanceConfig
    report_interval_s: float = 0.1
    report_delay_s: float = 0.002
    # The request path and co-location (default: a host that adds nothing).
    host: HostModel = field(default_factory=HostModel)
    seed: int = 0  # the run's seed (the request path's draws)
    kv_event_delay_s: float = 0.005
    migration_interval_s: float = 0.5
    max_migrations_in_flight: int = 16
    migration_bandwidth: float = 25e9  # bytes/s between two instances
    migration_stage_latency_s: float = 0.002  # control round trip per stage
    migration_stages: StageConfig = field(default_factory=StageConfig)
    sample_interval_s: float | None = None  # per-instance load samples; None: ~400 over the run
    # P/D disaggregation: instances that only prefill / only decode (besides the mixed ones).
    prefill_instances: int = 0
    decode_instances: int = 0
    transfer: TransferModel = field(default_factory=TransferModel)  # P/D handoff links
    # The proxy's admission (None: every request is routed at once, as before).
    admission: AdmissionSettings | None = None
    admission_queue: QueueSettings = field(default_factory=QueueSettings)
    max_inflight_per_instance: int = 256
    tenant_weights: dict[str, float] = field(default_factory=dict)  # fair share (default 1)
    tenant_limits: dict[str, RateLimits] = field(default_factory=dict)  # rpm / tpm (none)
    prefix_pull: PullConfig | None = None  # cross-instance prefix pulls (None: off)
    # Models and adapter slots, for a trace that names models (None: the defaults).
    models: FleetModels | None = None
    # The autoscaler (None: a fixed fleet): its settings, its tick, an instance's cold start.
    autoscale: AutoscaleSettings | None = None
    autoscale_interval_s: float = 1.0
    instance_start_s: float = 30.0
    slow_start_s: float = 0.0  # an added instance's traffic ramps (`scheduler.core.slow_start`)
    routers: int = 1  # router replicas in front of the fleet (`simulator.routers`)
    peer_interval_s: float | None = None  # replicas exchange their charges this often (None: not)

    @property
    def disaggregated(self) -> bool:
        return self.prefill_instances > 0 or self.decode_instances > 0


class _Periodic:
    """A fixed-phase periodic task (ticks at k * interval) that sleeps while the fleet is idle.

    Ticks of an idle fleet would repeat the last idle tick exactly (reports, samples, migration
    plans of an empty fleet), so skipping them changes nothing, and a stretched trace does not cost
    millions of empty ticks. `wake` re-arms the next tick on the same phase.
    """

    __slots__ = ("_armed", "_callback", "_loop", "interval", "quiet")

    def __init__(
        self, loop: EventLoop, interval: float, callback: Callable[[], bool], quiet: bool = False
    ) -> None:
        self._loop = loop
        self.interval = interval
        self._callback = callback
        self._armed = False
        # A quiet task only reads what a decode run keeps valid (or can replay): no barrier.
        self.quiet = quiet

    def wake(self) -> None:
        if self._armed:
            return
        now = self._loop.now
        phase = math.ceil(now / self.interval - 1e-9) * self.interval
        self._arm(max(phase, now))

    def _arm(self, when: float) -> None:
        self._armed = True
        if self.quiet:
            self._loop.call_at_quiet(when, self._tick)
        else:
            self._loop.call_at(when, self._tick)

    def _tick(self) -> None:
        self._armed = False
        if self._callback():
            self._arm(self._loop.now + self.interval)


@dataclass(slots=True)
class MigrationStats:
    started: int = 0
    committed: int = 0
    aborted: dict[str, int] = field(default_factory=dict)
    bytes_sent: float = 0.0
    blocks_shared: int = 0
    bytes_shared: float = 0.0  # KV the destination already cached (never sent)
    downtime_s: list[float] = field(default_factory=list)


@dataclass(slots=True)
class _Migration:
    order: MigrationOrder
    session: SourceSession
    destination: DestinationProtocol  # the destination's steps (`migration.core.destination`)
    owner: str  # the destination's reservation owner id
    stats: MigrationStats
    link: TransferLink  # times each stage's copy
    on_done: Callable[[str, str | None], None]  # (request id, abort reason or None: committed)
    suspended_at: float = math.nan

    @property
    def ahead(self) -> AheadBlocks:
        """The blocks stage 0 reserved on the destination for later stages (held under `owner`)."""
        return self.destination.ahead


class SimCluster:
    def __init__(
        self,
        config: ClusterConfig,
        latency: LatencyModel,
        dispatch: DispatchPolicy,
        migration: MigrationPolicy | None = None,
        vocab_size: int = 256,
        on_progress: Callable[[int], None] | None = None,
        fast_forward: bool = True,
        pd_policy: PDPolicy | None = None,
    ) -> None:
        self.config = config
        self.latency = latency
        self.dispatch_policy = dispatch
        self.migration_policy = migration
        self.vocab_size = vocab_size
        # A step's time depends on the other instances at its start: no step is planned ahead;
        # P/D handoffs reserve and commit on decode instances between any two of their steps.
        self.fast_forward = (
            fast_forward and not config.host.times_steps_by_fleet and not config.disaggregated
        )
        self.loop = EventLoop()
        self.metrics = MetricsCollector()
        # One approximate-index shard: shards keep the proxy's single decisions from stalling
        # while the index grows; a simulation only pays their overhead (same decisions).
        pull = config.prefix_pull
        pulls = None if pull is None or config.disaggregated else pull_settings(pull, latency)
        pd = pd_policy if config.disaggregated else None
        if config.routers < 1:
            raise ValueError("at least one router")
        states = [
            ClusterState(block_size=config.instance.block_size, approx_shards=1)
            for _ in range(config.routers)
        ]
        ramp = SlowStartSettings(window_s=config.slow_start_s)
        routers = [
            Router(
                state, copy.deepcopy(dispatch) if i else dispatch, copy.deepcopy(pd) if i else pd,
                pulls, slow_start=SlowStart(ramp),
            )
            for i, state in enumerate(states)
        ]  # fmt: skip
        self._routers = routers
        self.state = states[0]  # the fleet's view for what one process decides
        self.router: Router | RouterReplicas = routers[0]
        self.states: ClusterState | StateFanout = self.state  # membership and observations
        if config.routers > 1:
            self.router, self.states = RouterReplicas(routers), StateFanout(states)
        self.pull_stats = PullStats()
        self._pull_links = PullLinks()
        self._pull_plans: dict[str, PullChoice] = {}  # routed as a PULL, not reached yet
        self.truth = CacheTruth()  # the engines' hits against the event index's claims
        self._pulls_into: dict[str, int] = {}  # instance id -> pulls on their way to it
        # Request id -> (instance, carrier id, first pulled block, end): blocks held for it.
        self._pull_carriers: dict[str, tuple[SimInstance, str, int, int]] = {}
        self.migration_loop = (
            None
            if migration is None
            else MigrationLoop(
                migration,
                self._start_migration,
                interval_s=config.migration_interval_s,
                max_in_flight=config.max_migrations_in_flight,
            )
        )
        self.instances: dict[str, SimInstance] = {}
        for i in range(config.num_instances):
            iid = f"inst-{i}"
            self.instances[iid] = SimInstance(iid, config.instance, latency, self)
            # kvherd agents hash with the very same function, so their hashes are trusted.
            self.states.add_instance(
                iid,
                has_kv_events=True,
                trust_engine_hashes=True,
                now=0.0,
                tier_load_ratio=tier_load_ratio(config.instance, latency),
            )
        for role, count in (
            ("prefill", config.prefill_instances),
            ("decode", config.decode_instances),
        ):
            for i in range(count):
                iid = f"{role}-{i}"
                self.instances[iid] = SimInstance(iid, config.instance, latency, self)
                self.states.add_instance(
                    iid, has_kv_events=True, trust_engine_hashes=True, now=0.0, role=role
                )
        self._migration_link = TransferLink(
            "migration", config.migration_bandwidth, config.migration_stage_latency_s
        )
        self.handoffs = SimHandoffs(self._start_handoff)
        self.handoff_stats = MigrationStats()  # the handoffs' sessions: bytes, shares, downtime
        self._trace_index: dict[str, int] = {}
        self._migrations_of: dict[str, int] = {}
        self._migrating: dict[str, _Migration] = {}  # by request id
        self._between_steps: dict[str, list[Callable[[], None]]] = {}
        # The trace being fed: its requests, their arrival order, its id block size.
        self._arrivals: tuple[list[TraceRequest], list[int], int] = ([], [], 0)
        # Per trace request: its draw from the host's request-path spread (empty: no spread).
        self._path_draws: list[float] = []
        # KV events on their way to the prefix index: (due, loop order, instance, events).
        self._pending_events: list[tuple[float, int, str, list[KVEvent]]] = []
        self.migration_stats = MigrationStats()
        # Models (a trace naming them): the router's answer per model, each instance's slots,
        # and the requests holding a pin on their adapter there.
        self._model_routes: ModelRoutes | None = None
        self.adapter_slots: dict[str, AdapterSlots[Request]] = {}
        self._pinned: set[str] = set()
        self._remaining = 0
        self._periodic: list[_Periodic] = []
        self._on_progress = on_progress
        self.load_times: list[float] = []
        self.load_samples: dict[str, list[int]] = {iid: [] for iid in self.instances}
        self.waiting_samples: dict[str, list[int]] = {iid: [] for iid in self.instances}
        self.kv_use_samples: dict[str, list[float]] = {iid: [] for iid in self.instances}
        self.retired: dict[str, SimInstance] = {}  # instances the autoscaler removed
        self.autoscaler = (
            None
            if config.autoscale is None
            else SimAutoscaler(
                self, config.autoscale, config.autoscale_interval_s, config.instance_start_s
            )
        )
        self.admission: SimAdmission[tuple[Request, TraceRequest, float]] | None = None
        if config.admission is not None:
            self.admission = SimAdmission(
                config.admission,
                config.admission_queue,
                config.max_inflight_per_instance,
                config.tenant_weights,
                config.tenant_limits,
            )

    # -- run -------------------------------------------------------------------------------------
    def run(self, trace: Trace) -> MetricsCollector:
        loop = self.loop
        requests = trace.requests
        self._remaining = len(requests)
        # Arrivals are fed one at a time (the next is queued when one arrives), with the order
        # keys queueing them all first would have given: -n .. -1, before any other event at
        # the same time. The queue stays small however long the trace.
        order = list(range(len(requests)))
        if any(b.arrival_s < a.arrival_s for a, b in itertools.pairwise(requests)):
            order.sort(key=lambda i: requests[i].arrival_s)
        self._arrivals = (requests, order, trace.block_size)
        if trace.has_models:
            self._serve_models(trace)
        self._path_draws = self.config.host.path_draws(len(requests), self.config.seed)
        if order:
            self._queue_arrival(0)
        sample_interval = self.config.sample_interval_s or max(trace.duration_s / 400.0, 0.05)
        # Reports read running views (which a decode run moves) only for migration policies;
        # otherwise what they read is replayed from the run (`SimInstance.pool_at`). Samples read
        # queue lengths, which a decode run never changes, and the replayed pool.
        self._periodic = [
            _Periodic(
                loop,
                self.config.report_interval_s,
                self._report_tick,
                quiet=self.migration_loop is None,
            ),
            _Periodic(loop, sample_interval, self._sample_tick, quiet=True),
        ]
        if self.migration_loop is not None:
            self._periodic.append(
                _Periodic(loop, self.config.migration_interval_s, self._migration_tick)
            )
        if isinstance(self.router, RouterReplicas) and self.config.peer_interval_s is not None:
            self._periodic.append(
                _Periodic(loop, self.config.peer_interval_s, self._peer_tick, quiet=True)
            )
        if self.autoscaler is not None:  # it reads the router's ledger and queues: quiet
            tick = _Periodic(loop, self.autoscaler.interval_s, self.autoscaler.tick, quiet=True)
            tick.wake()  # (it never sleeps: an idle fleet is when it scales in)
        loop.run()
        self._deliver_events(before=(math.inf, 0))  # the run is over: every delivery is due
        return self.metrics

    def _serve_models(self, trace: Trace) -> None:
        config = self.config
        if self.migration_loop is not None or config.disaggregated or config.prefix_pull:
            raise ValueError(
                "a trace naming models runs without migrations, P/D or prefix pulls (not yet)"
            )
        models = config.models or FleetModels()
        self._model_routes = models.index(trace, list(self.instances))
        self.adapter_slots = {
            iid: AdapterSlots(models.max_loras, models.lora_load_s) for iid in self.instances
        }

    # -- fleet size (the autoscaler's) -------------------------------------------------------------
    def add_instance(self, instance_id: str) -> None:
        """A new, empty mixed instance (its load series start at 0 before it joined)."""
        config = self.config.instance
        self.instances[instance_id] = SimInstance(instance_id, config, self.latency, self)
        self.states.add_instance(
            instance_id,
            has_kv_events=True,
            trust_engine_hashes=True,
            now=self.loop.now,
            tier_load_ratio=tier_load_ratio(config, self.latency),
        )
        for series in (self.load_samples, self.waiting_samples, self.kv_use_samples):
            series[instance_id] = [0] * len(self.load_times)
        for router in self._routers:
            router.slow_start.joined(instance_id, self.loop.now)

    def idle_instance(self, instance_id: str) -> bool:
        """Nothing runs, waits, migrates or pulls on it, and nothing is routed to it."""
        inst = self.instances[instance_id]
        return (
            inst.idle
            and not inst.scheduler.has_unfinished()
            and not self.state.get(instance_id).inflight
            and not self._pulls_into.get(instance_id)
            and all(instance_id not in (m.order.src, m.order.dst) for m in self._migrating.values())
        )

    def remove_instance(self, instance_id: str) -> None:
        """Take an idle instance out of the fleet (its cache goes with it)."""
        self.states.remove_instance(instance_id)
        for router in self._routers:
            router.slow_start.left(instance_id)
        self.retired[instance_id] = self.instances.pop(instance_id)

    def has_requests_left(self) -> bool:
        return self._remaining > 0

    def _done_one(self) -> None:
        self._remaining -= 1
        if self._on_progress is not None:
            self._on_progress(1)

    # -- arrivals and dispatch -------------------------------------------------------------------
    def _queue_arrival(self, position: int) -> None:
        requests, order, _ = self._arrivals
        tr = requests[order[position]]
        self.loop.call_at_order(tr.arrival_s, position - len(order), self._next_arrival, position)

    def _next_arrival(self, position: int) -> None:
        requests, order, id_block_size = self._arrivals
        if position + 1 < len(order):
            self._queue_arrival(position + 1)
        index = order[position]
        path_draw = self._path_draws[index] if self._path_draws else 0.0
        self._arrive(requests[index], id_block_size, path_draw)

    def _arrive(self, tr: TraceRequest, id_block_size: int, path_draw: float) -> None:
        """A trace request arrives: route it, and admit it after its request-path time
        (`path_draw`: its draw from the host's request-path spread)."""
        now = self.loop.now
        adapter = None
        if tr.model is not None and self._model_routes is not None:
            try:
                adapter = self._model_routes.of(tr.model)[1]
            except UnknownModelError:  # the proxy's 404
                self.metrics.on_failed(tr.request_id)
                self._done_one()
                return
        request = make_request(
            tr, id_block_size, self.config.instance.block_size, now, self.vocab_size, adapter
        )
        rid = request.request_id
        self._trace_index[rid] = tr.index
        self.metrics.on_arrival(rid, now, tr.input_length)
        for periodic in self._periodic:
            periodic.wake()
        self._deliver_events()
        admission = self.admission
        if admission is not None:
            views = self.state.view(now).instances
            tokens = tr.input_length + tr.output_length  # its max_tokens: what it generates
            code = admission.check(now, views, rid, tr.tenant, tr.priority, tokens)
            if code is not None:
                self._refuse(rid)
                return
        self._route(request, tr, path_draw)

    def _refuse(self, rid: str) -> None:
        """A 429: the request never reaches an instance."""
        del self._trace_index[rid]
        if self.admission is not None:
            self.admission.ended(rid)
        self.metrics.on_refused(rid)
        self._done_one()

    def _expire_queue(self) -> None:
        assert self.admission is not None
        for request, _, _ in self.admission.expire(self.loop.now):
            self._refuse(request.request_id)

    def _route(self, request: Request, tr: TraceRequest, path_draw: float) -> None:
        """Route an admitted request (or queue it while every instance is saturated)."""
        now = self.loop.now
        rid = request.request_id
        admission = self.admission
        # Only the slots kept for tenants within their share are free: it waits (fair share).
        reserved = admission is not None and not admission.may_start(tr.tenant, len(self.instances))
        only = None
        if tr.model is not None and self._model_routes is not None:
            only = self._model_routes.of(tr.model)[0]
        try:
            if reserved:
                raise NoInstanceError("only reserved slots are free")
            routed = self.router.route(
                rid,
                now=now,
                num_tokens=request.num_tokens,
                block_hashes=request.block_hashes,
                max_tokens=tr.output_length,
                exclude=() if admission is None else admission.saturated,
                only=only,
                adapter=request.lora_name,
            )
        except NoInstanceError:
            if admission is None or not (reserved or admission.saturated):
                raise
            item = (request, tr, path_draw)
            if admission.wait(now, item, tr.tenant, tr.priority):
                self.loop.call_at(admission.deadline(item), self._expire_queue)
            else:
                self._refuse(rid)
            return
        if admission is not None:
            admission.dispatched(routed.instance_id, rid)
        if routed.decode_id is not None:
            self.handoffs.expect(rid, routed.instance_id, routed.decode_id)
        elif routed.claimed_blocks is not None:
            size = request.block_size
            self.truth.expect(rid, routed.instance_id, routed.claimed_blocks * size, size)
        if routed.pull is not None:
            self._note_pull(rid, routed.pull)
        instance = self.instances[routed.instance_id]
        overhead = self.config.host.request_overhead(
            path_draw, lambda: self._busy_others(instance), lambda: self._fleet_idle_s(now)
        )
        if overhead > 0:  # (a negative total is no delay)
            self.loop.call_later(overhead, self._admit, instance, request)
        else:
            self._admit(instance, request)

    def _admit(self, instance: SimInstance, request: Request) -> None:
        now = self.loop.now
        rid = request.request_id
        if rid in self._pull_plans:  # its blocks come first
            self._defer_for_pull(instance, request)
            return
        adapter = request.lora_name
        if adapter is not None and rid not in self._pinned:  # its adapter comes first
            ready = self.adapter_slots[instance.instance_id].acquire(adapter, now, request)
            if ready is None:  # every slot pinned: it waits for one (`_release_adapter`)
                return
            self._pinned.add(rid)
            if ready > now:
                self.loop.call_at(ready, self._admit, instance, request)
                return
        for periodic in self._periodic:  # the fleet may have gone idle while it was in transit
            periodic.wake()
        waiting = instance.scheduler.waiting
        head = waiting[0] if waiting else None
        # The engine stamps a request's arrival when it receives it (`LLMEngine.add_request`), so
        # its queue is in admission order: a request whose path took longer (the host's spread,
        # co-location, wake-up) queues behind those that overtook it on the way.
        request.arrival_time = now
        try:
            instance.add_request(request)
        except InvalidRequestError:
            self._release_adapter(request, instance.instance_id, now)
            self.router.on_finish(rid, now)
            self.metrics.on_failed(rid)
            self._done_one()
            return
        pair = self.handoffs.paired(rid)
        if pair is not None:
            if holds_first_token(self._role(pair[0])):
                instance.scheduler.hold_at_first_token(rid)  # it never decodes there
            self.handoffs.on_admitted(rid)  # reserve on the decode instance now
        # Admissions are stamped in admission order at one priority, so they queue behind the head: a
        # decode run planned behind a waiting head stays exact (see `_start_step`).
        assert head is None or waiting[0] is head, "an admission overtook the waiting head"
        if instance.idle:
            self._start_step(instance)

    def _release_adapter(self, request: Request, instance_id: str, now: float) -> None:
        """The request ended: its adapter's pin goes, and requests waiting for a slot there may
        load theirs."""
        if request.request_id not in self._pinned:
            return
        self._pinned.discard(request.request_id)
        assert request.lora_name is not None
        instance = self.instances[instance_id]
        for waiting, ready in self.adapter_slots[instance_id].release(request.lora_name, now):
            self._pinned.add(waiting.request_id)
            self.loop.call_at(ready, self._admit, instance, waiting)

    # -- cross-instance prefix pull --------------------------------------------------------------
    def _note_pull(self, request_id: str, choice: PullChoice) -> None:
        self.pull_stats.count(self.pull_stats.decided, choice.action.value)
        if choice.action is PullAction.PULL:
            self._pull_plans[request_id] = choice

    def _defer_for_pull(self, instance: SimInstance, request: Request) -> None:
        """The request reached its instance's agent: the pull starts between its steps."""
        iid = instance.instance_id
        self._pulls_into[iid] = self._pulls_into.get(iid, 0) + 1
        self._run_between_steps(instance, lambda: self._start_pull(instance, request))

    def _start_pull(self, dst: SimInstance, request: Request) -> None:
        """As an agent pulls (`instance_agent.prefix_pull`): hold `dst`'s GPU hits, reserve the
        blocks past them up to the choice's end (no room: recompute), then copy what the holder's
        block server sends, its GPU-cached run from there (none left: recompute; `dst` holding
        them all already: nothing to pull)."""
        rid = request.request_id
        choice = self._pull_plans.pop(rid)
        assert choice.source is not None
        source = self.instances[choice.source]
        holder = source.block_manager
        hashes = request.block_hashes[: choice.first_block + choice.num_blocks]
        bm = dst.block_manager
        shared = bm.lookup_cached_prefix(hashes)
        first = len(shared)
        owner = f"pull:{rid}"
        reason = None
        if first >= len(hashes):
            reason = NOTHING_TO_PULL
        else:
            bm.share_cached_blocks(owner, shared)
            if bm.reserve_blocks(owner, len(hashes) - first) is None:
                reason = NO_ROOM
        sent = holder.lookup_cached_prefix(hashes[first:]) if reason is None else []
        end = first + len(sent)
        if reason is None and end <= first:
            reason = HOLDER_LOST
        if reason is not None:
            bm.free_owner(owner)
            self.pull_stats.count(self.pull_stats.fallback, reason)
            self._pull_done(dst, request)
            return
        pinned = f"pull-out:{rid}"  # the holder's block server pins them while it reads them
        holder.share_cached_blocks(pinned, sent)
        nbytes = (end - first) * bm.block_size * (self.latency.kv_bytes_per_token or 0.0)
        assert self.config.prefix_pull is not None  # (only pulls reach here)
        seconds = self.config.prefix_pull.time(nbytes)
        now = self.loop.now
        lands = self._pull_links.reserve(source.instance_id, dst.instance_id, now, seconds)
        stats = self.pull_stats
        stats.started += 1
        stats.bytes_pulled += nbytes
        stats.link_s += lands - now
        self.loop.call_at(lands, self._pull_landed, source, dst, request, first, end)

    def _pull_landed(
        self, src: SimInstance, dst: SimInstance, request: Request, first: int, end: int
    ) -> None:
        pinned = f"pull-out:{request.request_id}"
        self._run_between_steps(src, lambda: src.block_manager.free_owner(pinned))
        self._run_between_steps(dst, lambda: self._finish_pull(dst, request, first, end))

    def _finish_pull(self, dst: SimInstance, request: Request, first: int, end: int) -> None:
        """The blocks landed: cache them on `dst` (held until the request is scheduled) and
        admit the request."""
        held = pull_carrier(request, end)
        held.num_computed_tokens = end * request.block_size
        dst.block_manager.cache_full_blocks(held)
        rid = request.request_id
        self._pull_carriers[rid] = (dst, held.request_id, first, end)
        stats = self.pull_stats
        stats.landed += 1
        stats.tokens_landed += (end - first) * request.block_size
        self._pull_done(dst, request)
        if rid not in dst.scheduler.requests:  # the engine refused it
            self._release_pull(rid)

    def _pull_done(self, dst: SimInstance, request: Request) -> None:
        iid = dst.instance_id
        self._pulls_into[iid] -= 1
        if not self._pulls_into[iid]:
            del self._pulls_into[iid]
        self._admit(dst, request)

    def _release_pull(self, request_id: str) -> None:
        """The request was scheduled (it took its hits) or ended: the carrier lets go."""
        dst, owner, first, end = self._pull_carriers.pop(request_id)
        dst.block_manager.free_owner(owner)
        request = dst.scheduler.requests.get(request_id)
        if request is not None and request.num_cached_tokens >= 0:
            hit = min(request.num_cached_tokens, end * request.block_size)
            self.pull_stats.tokens_hit += max(0, hit - first * request.block_size)

    # -- engine steps ----------------------------------------------------------------------------
    def _start_step(self, instance: SimInstance) -> None:
        if not instance.idle:
            # A between-steps action already started one (an aborted migration resumed its
            # request on this instance, or a commit landed here).
            return
        loop = self.loop
        if self.fast_forward and not self._migrating:
            # Without a migration policy the barriers are arrivals and admissions, which only
            # queue a request: the step in flight at one may join the run. Behind a waiting
            # request (refused: the run is pure decode) an admission queues behind it and changes
            # no step of the run, so nothing bounds such a run.
            horizon = loop.next_barrier()
            if (
                self.migration_loop is None
                and instance.scheduler.waiting
                and not instance.scheduler.num_loading  # a landing load joins the batch
                and instance.instance_id not in self._pulls_into  # so does a landing pull
            ):
                horizon = math.inf
            run = instance.start_decode_run(
                loop.now, horizon, _MAX_RUN_STEPS, straddle=self.migration_loop is None
            )
            if run is not None:
                self._schedule_run(instance, run)
                return
        stretch = self.config.host.step_stretch(lambda: self._busy_others(instance))
        end = instance.start_step(loop.now, stretch)
        self._start_loads(instance)
        if end is not None:
            loop.call_at_quiet(end, self._step_end, instance)

    # -- KV tiers --------------------------------------------------------------------------------
    def _start_loads(self, instance: SimInstance) -> None:
        """Time the loads the instance's last step started (a barrier each: see the contract)."""
        for request_id, seconds in instance.take_loads():
            self.loop.call_later(seconds, self._load_landed, instance, request_id)

    def _load_landed(self, instance: SimInstance, request_id: str) -> None:
        self._run_between_steps(instance, lambda: self._finish_load(instance, request_id))

    def _finish_load(self, instance: SimInstance, request_id: str) -> None:
        instance.scheduler.finish_load(request_id, True)
        if instance.idle:
            self._start_step(instance)

    def _fleet_idle_s(self, now: float) -> float:
        """How long the whole fleet has been idle at `now` (0 while any instance runs a step)."""
        instances = self.instances.values()
        if any(not i.idle for i in instances):
            return 0.0
        return now - max(i.last_busy for i in instances)

    def _busy_others(self, instance: SimInstance) -> int:
        """How many instances other than `instance` are running a step now."""
        busy = sum(1 for other in self.instances.values() if not other.idle)
        return busy - (0 if instance.idle else 1)

    def _schedule_run(self, instance: SimInstance, run: DecodeRun) -> None:
        loop = self.loop
        delay = self.config.kv_event_delay_s
        iid = instance.instance_id
        pending = self._pending_events
        key_at = loop.key_at
        for step_end, events in zip(run.step_ends, run.events, strict=True):
            if events:
                heapq.heappush(pending, (*key_at(step_end + delay), iid, events))
        loop.call_at_quiet(run.step_ends[-1], self._decode_run_end, instance)

    def _decode_run_end(self, instance: SimInstance) -> None:
        if self.migration_loop is None and instance.instance_id not in self._between_steps:
            # Arrivals elsewhere cut the run only to keep it from running past one routed here;
            # without one (no admission), the rest of the guaranteed run needs no new check.
            run = instance.continue_decode_run(self.loop.now, self.loop.next_barrier(), True)
            if run is not None:
                self._schedule_run(instance, run)
                return
        instance.finish_decode_run()
        self._after_step(instance)

    def _step_end(self, instance: SimInstance) -> None:
        # Deliveries due by now are applied here too: a prefill's events carry its token ids,
        # which should not wait for the next read (hours of virtual time on a sparse trace).
        self._deliver_events()
        instance.finish_step(self.loop.now)
        events = instance.take_events()
        if events:
            due = self.loop.key_at(self.loop.now + self.config.kv_event_delay_s)
            heapq.heappush(self._pending_events, (*due, instance.instance_id, events))
        self._after_step(instance)

    def _after_step(self, instance: SimInstance) -> None:
        pending = self._between_steps.pop(instance.instance_id, None)
        if pending:
            for action in pending:
                action()
        self._start_step(instance)

    def _deliver_events(self, before: tuple[float, int] | None = None) -> None:
        """Apply the KV events due before the running event (or the loop key `before`), in the
        order their deliveries would have run as events of their own.

        Only routing and migration planning read the prefix index, so deliveries wait in
        `_pending_events` (keyed like loop events) until one of those runs, or a step ends
        (which bounds how long events hold their token ids): the same state at every read,
        without a loop event per engine step.
        """
        pending = self._pending_events
        current = self.loop.current if before is None else before
        apply = self._apply_events
        while pending and pending[0][:2] < current:
            due, _, instance_id, events = heapq.heappop(pending)
            apply(due, instance_id, events)

    def _apply_events(self, due: float, instance_id: str, events: list[KVEvent]) -> None:
        """One delivery, due at virtual time `due` (none for an instance removed meanwhile)."""
        if instance_id in self.state:
            self.states.apply_kv_events(instance_id, events)

    def _run_between_steps(self, instance: SimInstance, action: Callable[[], None]) -> None:
        """Run `action` when no step is in flight on `instance` (now if idle)."""
        if instance.idle:
            action()
        else:
            self._between_steps.setdefault(instance.instance_id, []).append(action)

    # -- TokenSink (called by instances) ---------------------------------------------------------
    def on_scheduled(self, request_id: str, now: float) -> None:
        self.metrics.on_scheduled(request_id, now)
        if request_id in self._pull_carriers:
            self._release_pull(request_id)

    def on_tokens(self, request_ids: list[str], now: float) -> None:
        for request_id in self.metrics.on_tokens(request_ids, now):
            self.router.on_first_token(request_id, now)
            self.handoffs.on_first_token(request_id, now)

    def on_decode_run(self, request_ids: list[str], times: list[float]) -> None:
        # Never a first token: every request of a decode run already has output.
        self.metrics.on_decode_run(request_ids, times)

    def on_finished(self, request: Request, instance_id: str, now: float) -> None:
        rid = request.request_id
        if rid in self._pull_carriers:
            self._release_pull(rid)
        self._release_adapter(request, instance_id, now)
        if request.num_cached_tokens >= 0:
            self.truth.check(self.state, rid, request.lora_name or "", request.num_cached_tokens)
        self.truth.forget(rid)
        self.router.on_finish(rid, now)
        if self.admission is not None:
            self.admission.released(rid)
            self.admission.ended(rid)
            queued = self.admission.freed(now)
            if queued is not None:
                self.loop.call_later(0.0, self._route, *queued)
        self.handoffs.on_finished(rid)
        self.metrics.on_finished_ids(
            rid,
            self._trace_index.pop(rid),
            request.num_cached_tokens,
            request.num_preemptions,
            self._migrations_of.pop(rid, 0),
            instance_id,
        )
        self._done_one()

    # -- periodic: load reports and samples ------------------------------------------------------
    def _fleet_busy(self) -> bool:
        return any(inst.scheduler.has_unfinished() for inst in self.instances.values())

    def _report_tick(self) -> bool:
        now = self.loop.now
        with_running = self.migration_loop is not None
        slots = self.adapter_slots
        reports = [
            (iid, load_report(inst, with_running, now, slots.get(iid)))
            for iid, inst in self.instances.items()
        ]
        # The global state only: never a barrier for an instance. One event delivers the whole
        # fleet's reports (they are due at the same time, one after another).
        self.loop.call_at_quiet(
            now + self.config.report_delay_s, self._deliver_reports, reports, now
        )
        return self._fleet_busy()

    def _peer_tick(self) -> bool:
        assert isinstance(self.router, RouterReplicas)
        self.router.exchange(self.loop.now)
        return self._fleet_busy()

    def _deliver_reports(self, reports: list[tuple[str, LoadReport]], taken_at: float) -> None:
        for instance_id, report in reports:
            self._deliver_report(instance_id, report, taken_at)

    def _deliver_report(self, instance_id: str, report: LoadReport, taken_at: float) -> None:
        if instance_id in self.state:  # (not one the autoscaler removed meanwhile)
            self.states.apply_report(instance_id, report, self.loop.now, taken_at)

    def _sample_tick(self) -> bool:
        now = self.loop.now
        self.load_times.append(now)
        for iid, inst in self.instances.items():
            sched = inst.scheduler
            self.load_samples[iid].append(sched.num_running + sched.num_waiting)
            self.waiting_samples[iid].append(sched.num_waiting)
            free, _ = inst.pool_at(now)
            self.kv_use_samples[iid].append(1.0 - free / inst.block_manager.num_blocks)
        for iid in self.retired:  # series stay as long as the run's
            self.load_samples[iid].append(0)
            self.waiting_samples[iid].append(0)
            self.kv_use_samples[iid].append(0.0)
        return self._fleet_busy()

    # -- migration -------------------------------------------------------------------------------
    def _migration_tick(self) -> bool:
        assert self.migration_loop is not None
        now = self.loop.now
        self._deliver_events()
        self.migration_loop.tick(self.state.view(now), now)
        return self._fleet_busy() or bool(self._migrating)

    def _start_migration(self, order: MigrationOrder) -> None:
        """`MigrationLoop`'s executor: start the order, or report it failed at once."""
        self._open_migration(
            order, self.migration_stats, self._migration_link, self._finish_migration
        )

    def _start_handoff(self, order: MigrationOrder) -> None:
        """`SimHandoffs`' executor: the handoff starts once the prefill instance's agent picks
        it up (an event right after its admission or its turn; the engine goes on stepping
        meanwhile, as an agent's does)."""
        self.loop.call_at_quiet(self.loop.now, self._open_handoff, order)

    def _open_handoff(self, order: MigrationOrder) -> None:
        src = self.instances[order.src]
        request = src.scheduler.requests.get(order.request_id)
        if request is None:
            self.handoffs.on_done(order.request_id, FINISHED_FIRST)
            return
        link = self.config.transfer.link(order.src, order.dst)
        stages = handoff_stages(self._role(order.src), self.config.migration_stages)
        self._open_migration(
            order, self.handoff_stats, link, self._handoff_done, stages, request.num_prompt_tokens
        )

    def _handoff_done(self, request_id: str, reason: str | None) -> None:
        """A handoff ended; one that did not commit leaves its request decoding where it was
        prefilled (a held request that no session suspended is resumed here, one still
        prefilling is no longer held). A request that finished first counts as the agents
        report it (``finished_first``)."""
        pair = self.handoffs.paired(request_id)
        src = None if pair is None else self.instances[pair[0]]
        request = None if src is None else src.scheduler.requests.get(request_id)
        if (
            reason is not None
            and src is not None
            and request is not None
            and request_id not in self._migrating
        ):
            if request.status is RequestStatus.SUSPENDED:
                src.scheduler.resume(request_id)
                if src.idle:
                    self._start_step(src)
            else:
                src.scheduler.cancel_hold(request_id)
        if reason == AbortReason.REQUEST_FINISHED.value:
            reason = FINISHED_FIRST
        self.handoffs.on_done(request_id, reason)

    def _role(self, instance_id: str) -> str:
        return self.state.get(instance_id).role or "mixed"

    def _open_migration(
        self,
        order: MigrationOrder,
        stats: MigrationStats,
        link: TransferLink,
        on_done: Callable[[str, str | None], None],
        stages: StageConfig | None = None,
        prefill_tokens: int = 0,
    ) -> None:
        """Start one migration through the sessions (`stages`: the migrations' unless given; a
        handoff's may find its request held, suspended at its first token), or report it failed
        at once. `prefill_tokens` > 0: a P/D handoff opened as its request is admitted, as
        `migration.source.PrefillOpening` opens it (stage 0 at once, from the prompt's hashes,
        before any look at the engine; the request may still wait or prefill)."""
        src = self.instances.get(order.src)
        dst = self.instances.get(order.dst)
        request = None if src is None else src.scheduler.requests.get(order.request_id)
        if (
            src is None
            or dst is None
            or request is None
            or (
                request.status is not RequestStatus.RUNNING
                and (stages is None or request.status is not RequestStatus.SUSPENDED)
                and not prefill_tokens
            )
            or order.request_id in self._migrating
        ):
            on_done(order.request_id, AbortReason.REQUEST_NOT_RUNNING.value)
            return
        block_size = src.block_manager.block_size
        rid = request.request_id
        m = _Migration(
            order,
            SourceSession(rid, block_size, stages or self.config.migration_stages, prefill_tokens),
            DestinationProtocol(rid, dst.block_manager.block_size, self.loop.now),
            owner=f"migration:{rid}",
            stats=stats,
            link=link,
            on_done=on_done,
        )
        self._migrating[rid] = m
        stats.started += 1
        if prefill_tokens:
            # As admitted: nothing computed yet (what the engine computed since, the next
            # snapshot sees), so stage 0 copies nothing and reserves the whole prompt.
            hashes = request.block_hashes[: prefill_tokens // block_size]
            self._drive(m, m.session.on_snapshot(RequestSnapshot("waiting", (), 0, hashes)))
        else:
            self._run_between_steps(src, lambda: self._drive(m, m.session.start()))

    def _finish_migration(self, request_id: str, reason: str | None) -> None:
        assert self.migration_loop is not None
        if reason is None:
            self._migrations_of[request_id] = self._migrations_of.get(request_id, 0) + 1
        self.migration_loop.on_done(request_id, reason is None, self.loop.now)

    def _drive(self, m: _Migration, action: SourceAction) -> None:
        """Perform the session's actions (source and destination sides at once: no wire) until
        it waits for a copy to land, or is over. Runs between the source's steps."""
        src = self.instances[m.order.src]
        dst = self.instances[m.order.dst]
        session = m.session
        rid = session.request_id
        while True:
            match action:
                case Snapshot():
                    request = src.scheduler.requests.get(rid)
                    if (
                        request is not None
                        and request.status is RequestStatus.SUSPENDED
                        and math.isnan(m.suspended_at)
                    ):
                        # Held since its first token (P/D): its downtime starts there.
                        held = self.handoffs.first_token_at(rid)
                        m.suspended_at = self.loop.now if held is None else held
                    action = session.on_snapshot(
                        RequestSnapshot(None)
                        if request is None
                        else RequestSnapshot(
                            request.migration_phase,
                            src.block_manager.block_ids(rid),
                            request.num_computed_tokens,
                            request.block_hashes,
                        )
                    )
                case Suspend():
                    src.scheduler.suspend(rid)
                    m.suspended_at = self.loop.now
                    action = session.on_suspended()
                case Wait():
                    # No new full block yet: look again after the source's next step.
                    self._between_steps.setdefault(src.instance_id, []).append(
                        lambda: self._drive(m, Snapshot())
                    )
                    return
                case Reserve(stage=stage):
                    action = self._reserve_on_dst(m, dst, stage)
                case Copy(stage=stage):
                    kv_bytes = self.latency.kv_bytes_per_token or 0.0
                    nbytes = stage.num_blocks * src.block_manager.block_size * kv_bytes
                    m.stats.bytes_sent += nbytes
                    self.loop.call_later(m.link.time(nbytes), self._stage_landed, m)
                    return
                case Commit():
                    action = self._commit_on_dst(m, src, dst)
                case Release():
                    src.scheduler.finish_request(rid, RequestStatus.FINISHED_MIGRATED)
                    action = session.on_released()
                case Done():
                    self._committed(m, src, dst)
                    return
                case Abort():
                    self._aborted(m, src, dst, action)
                    return

    def _reserve_on_dst(self, m: _Migration, dst: SimInstance, stage: Stage) -> SourceAction:
        """Perform the destination's steps for one stage's reservation (as `migration.destination`);
        blocks are held under `m.owner`, so freeing it frees those reserved ahead too."""
        bm = dst.block_manager
        action: ReserveAction = m.destination.on_reserve(
            stage.index, stage.num_blocks, stage.expected_blocks, stage.block_hashes, self.loop.now
        )
        while True:
            match action:
                case ShareCached(hashes):
                    shared = bm.lookup_cached_prefix(list(hashes))
                    if shared:
                        bm.share_cached_blocks(m.owner, shared)
                    action = m.destination.on_shared(shared)
                case ReserveBlocks(count):
                    action = m.destination.on_reserved(bm.reserve_blocks(m.owner, count))
                case Accept(shared_ids, reserved_ids):
                    m.stats.blocks_shared += len(shared_ids)
                    m.stats.bytes_shared += (
                        len(shared_ids) * bm.block_size * (self.latency.kv_bytes_per_token or 0.0)
                    )
                    return m.session.on_reserved(True, len(shared_ids), len(reserved_ids))
                case Refuse(detail=detail):
                    bm.free_owner(m.owner)
                    return m.session.on_reserved(False, 0, 0, detail)

    def _stage_landed(self, m: _Migration) -> None:
        action = m.session.on_landed()
        if isinstance(action, Commit):  # the request is suspended: no step can race the commit
            self._drive(m, action)
        else:
            self._run_between_steps(self.instances[m.order.src], lambda: self._drive(m, action))

    def _commit_on_dst(self, m: _Migration, src: SimInstance, dst: SimInstance) -> SourceAction:
        """Send the request's state (`Request.to_state`, as the agents do) and adopt it there."""
        session = m.session
        request = src.scheduler.requests.get(session.request_id)
        if request is None:
            return session.fail(AbortReason.REQUEST_FINISHED, "finished or aborted on the source")
        state = request.to_state()
        action = m.destination.on_commit(
            state["request_id"],
            state["num_computed_tokens"],
            len(dst.block_manager.block_ids(m.owner)),
            self.loop.now,
        )
        if isinstance(action, Refuse):
            dst.block_manager.free_owner(m.owner)
            return session.on_commit_answer(False, action.detail)
        adopted = Request.from_state(state, dst.block_manager.block_size)
        dst.block_manager.transfer_owner(m.owner, adopted.request_id)
        dst.scheduler.adopt(adopted)
        return session.on_commit_answer(True)

    def _committed(self, m: _Migration, src: SimInstance, dst: SimInstance) -> None:
        rid = m.session.request_id
        del self._migrating[rid]
        stats = m.stats
        stats.committed += 1
        stats.downtime_s.append(self.loop.now - m.suspended_at)
        self.router.on_migrated(rid, m.order.dst, self.loop.now)
        if self.admission is not None:
            self.admission.moved(rid, m.order.dst)
        m.on_done(rid, None)
        if dst.idle:
            self._start_step(dst)
        if src.idle and src.scheduler.waiting:
            # The released blocks may admit its queue (an idle source held only suspended
            # requests: P/D handoffs held at their first token).
            self._start_step(src)

    def _aborted(self, m: _Migration, src: SimInstance, dst: SimInstance, abort: Abort) -> None:
        rid = m.session.request_id
        request = src.scheduler.requests.get(rid)
        if abort.resume and request is not None and request.status is RequestStatus.SUSPENDED:
            src.scheduler.resume(rid)
            if src.idle:
                self._start_step(src)
        if abort.notify_destination:
            dst.block_manager.free_owner(m.owner)
        self._migrating.pop(rid, None)
        key = abort.reason.value
        m.stats.aborted[key] = m.stats.aborted.get(key, 0) + 1
        m.on_done(rid, key)


def tier_load_ratio(config: InstanceConfig, latency: LatencyModel) -> tuple[float, float]:
    """What loading one token from the CPU and disk tiers costs in prefill tokens: its KV bytes
    over the tier's bandwidth, over the model's prefill time per token (one 4k-token chunk);
    (0, 0), the policy's defaults, for an instance without tiers (the model is not asked)."""
    if not (config.num_cpu_blocks or config.num_disk_blocks):
        return (0.0, 0.0)
    kv_bytes = latency.kv_bytes_per_token or 0.0
    prefill_s = latency.step_time([(4096, 0)], []) / 4096
    return (
        kv_bytes / config.cpu_bandwidth / prefill_s,
        kv_bytes / config.disk_bandwidth / prefill_s,
    )


def load_report(
    inst: SimInstance,
    with_running: bool = False,
    now: float | None = None,
    adapters: AdapterSlots[Request] | None = None,
) -> LoadReport:
    """What the instance's agent would report at `now`: the engine's one load report
    (`instance_agent.engine.core.load.engine_load`, as the agent's state snapshot carries it),
    and with `adapters` its active adapters and slot count (vLLM's ``lora_requests_info``).

    Inside a decode run the pool figures are those of the step in flight at `now`; running
    views (`with_running`) are only valid outside runs.
    """
    sched = inst.scheduler
    bm = inst.block_manager
    load = engine_load(sched, bm, None if now is None else inst.pool_at(now))
    running = None
    if with_running:
        running = tuple(
            RunningRequestView(
                r.request_id,
                r.num_tokens,
                len(bm.block_ids(r.request_id)),
                r.sampling_params.max_tokens - r.num_output_tokens,
            )
            for r in sched.running
        )
    return LoadReport(
        num_running=load.num_running,
        num_waiting=load.num_waiting,
        kv_usage=load.kv_usage,
        num_total_blocks=load.num_total_blocks,
        num_free_blocks=load.num_free_blocks,
        num_cached_blocks=load.num_cached_blocks,
        num_preemptions=load.num_preemptions,
        waiting_prefill_tokens=load.waiting_prefill_tokens,
        head_waiting_blocks=load.head_waiting_blocks,
        running=running,
        block_size=load.block_size,
        max_num_seqs=sched.config.max_num_seqs,
        active_adapters=None if adapters is None else adapters.active,
        lora_slots=None if adapters is None else adapters.max_loras,
    )
