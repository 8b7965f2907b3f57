"""Read-only views a policy sees, and what a policy answers.

Contract:
- Policies see the world only through these frozen objects. They never mutate them and never reach
  into the scheduler core, so the same policy runs in the proxy (real clock) and in the simulator
  (virtual clock), and a policy can be unit-tested by building views by hand.
- Load figures in an `InstanceView` are the scheduler's *effective* estimate: the instance's last
  report plus the router's own optimistic charges for requests dispatched since that report.
- `ClusterView.prefix_match(request)` returns, per instance, how many *leading* blocks of the
  request's block-hash chain that instance already caches. It is computed at most once per request
  (cached on the view), so several scorers may ask for it freely; its array form
  (`prefix_match_array`) and `prefix_match_of` reuse that answer rather than walk the chain again.
  The scheduler core answers in the array form only (one walk, in `instances` order) and the view
  derives the mapping from it; a hand-built view may be given a mapping instead. These count the
  GPU tier only. `prefix_match_tiers` adds the lower tiers: per tier (`TIERS`: GPU, CPU,
  STORAGE) and instance, the blocks that continue the instance's GPU match there (row 0 is
  `prefix_match_array`; without a tier matcher the lower rows are 0).
- `Decision` names the chosen instance and can explain itself (per-instance scores, a reason);
  `PDDecision` names a prefill and a decode instance (equal: no handoff); `MigrationOrder` asks for
  one running request to move from `src` to `dst`.
- An instance's `role` (``prefill``, ``decode``, ``mixed``) says which phases it serves;
  `active_adapters` / `lora_slots` which LoRA adapters it holds and may hold (`RequestView.adapter`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

import numpy as np

# KV tiers by vLLM's ``medium`` names, fastest first: the rows of `ClusterView.prefix_match_tiers`.
TIERS = ("GPU", "CPU", "STORAGE")


@dataclass(frozen=True, slots=True)
class RequestView:
    """A request about to be dispatched.

    `block_hashes` is the request's chain of full-block hashes (tenant salt already folded in),
    computed by the scheduler core; policies never hash tokens themselves.
    """

    request_id: str
    num_tokens: int
    block_hashes: tuple[int, ...] = ()
    block_size: int = 16
    tenant: str | None = None
    priority: int = 0
    max_tokens: int | None = None  # decode budget if the client gave one
    adapter: str | None = None  # the LoRA adapter the request runs with (None: a base model)
    slo_ttft_s: float | None = None  # the TTFT the client asked for (None: as soon as may be)

    @property
    def num_blocks(self) -> int:
        """KV blocks the prompt occupies once prefilled (the last partial block counts)."""
        return -(-self.num_tokens // self.block_size)


@dataclass(frozen=True, slots=True)
class RunningRequestView:
    """A request running on an instance, as migration policies need it."""

    request_id: str
    num_tokens: int
    num_blocks: int
    remaining_tokens: int | None = None  # decode budget left (None: unknown)


@dataclass(frozen=True, slots=True)
class InstanceView:
    """One instance's state at decision time.

    `capacity` is the total number of KV blocks (0 when unknown, e.g. a plain vLLM server that was
    never scraped). `freeness` is Llumnix's: (free blocks - blocks the head-of-line waiting request
    needs) / number of requests, +inf for an idle instance.
    """

    instance_id: str
    capacity: int = 0
    num_running: int = 0
    num_waiting: int = 0
    kv_usage: float = 0.0
    free_blocks: int = 0
    cached_blocks: int = 0
    freeness: float = math.inf
    # The router's own accounting (requests it dispatched that have not finished).
    inflight: int = 0
    pending_prefill: int = 0  # dispatched, first token not yet seen
    pending_prefill_tokens: int = 0  # their prompt tokens not covered by a prefix hit
    inflight_blocks: int = 0  # KV blocks the in-flight requests hold or will hold
    # Queued prefill work as best known: reported waiting tokens + router charges since the report.
    waiting_prefill_tokens: int = 0
    head_waiting_blocks: int = 0  # blocks the head-of-line waiting request needs (0: none waits)
    num_preemptions: int = 0  # cumulative, as reported
    # Capacity as the engine states it: its batch slots (max_num_seqs; 0 unknown), the most
    # requests it was seen running at once (a lower bound on its slots, learned from its reports)
    # and the requests it reports queued: waiting for room (not for a pull), in two reports in a
    # row (a request that arrived between two steps is no queue; no router estimate mixed in).
    batch_slots: int = 0
    reported_waiting: int = 0
    running_peak: int = 0
    healthy: bool = True
    draining: bool = False
    has_kv_events: bool = False
    running: tuple[RunningRequestView, ...] = ()
    # Prefill/decode disaggregation: "prefill", "decode" or "mixed" (does both; the default).
    role: str = "mixed"
    # What loading one token's KV from the CPU / STORAGE tier costs, in prefill tokens (load
    # seconds over prefill seconds per token: bytes over the tier's bandwidth, from the host
    # model or `kvherd profile`); 0: unknown, the policy's default.
    cpu_load_ratio: float = 0.0
    storage_load_ratio: float = 0.0
    # LoRA: the adapters the engine holds in its batch slots (reported running or waiting, plus
    # the router's own dispatches since) and how many it may hold at once (0: unknown).
    active_adapters: frozenset[str] = frozenset()
    lora_slots: int = 0

    @property
    def num_requests(self) -> int:
        return self.num_running + self.num_waiting

    @property
    def dispatchable(self) -> bool:
        """Healthy and not draining: may receive new requests."""
        return self.healthy and not self.draining

    @property
    def prefills(self) -> bool:
        """May compute prompts (role ``prefill`` or ``mixed``)."""
        return self.role != "decode"

    @property
    def decodes(self) -> bool:
        """May decode requests (role ``decode`` or ``mixed``)."""
        return self.role != "prefill"


class NoInstanceError(RuntimeError):
    """No instance can take the request (none registered, or all unhealthy or draining)."""


PrefixMatcher = Callable[["RequestView"], Mapping[str, int]]
# The same answer as a float64 array aligned with `ClusterView.instances` (large fleets).
PrefixArrayMatcher = Callable[["RequestView"], np.ndarray]
# The lower tiers' rows (len(TIERS) - 1 of them, `instances` order), given the GPU row.
TierMatcher = Callable[["RequestView", np.ndarray], np.ndarray]
# Leading blocks of the request an instance is known to hold on any tier (its KV events said so),
# without the ones only routed there (still being computed); None: the match is all it knows.
ConfirmedMatcher = Callable[["RequestView", str], int | None]
# Predicted TTFT in seconds of (instance id, uncached prompt tokens, queued prefill tokens, running
# requests, requests on its host's other instances), learned from the engines
# (`scheduler.core.ttft_model`); None: nothing learned yet.
TtftPredictor = Callable[[str, float, float, float, float], float | None]


# InstanceView fields available as numpy columns (see `ClusterView.column`).
COLUMNS: tuple[str, ...] = (
    "capacity",
    "num_running",
    "num_waiting",
    "kv_usage",
    "free_blocks",
    "cached_blocks",
    "freeness",
    "inflight",
    "pending_prefill",
    "pending_prefill_tokens",
    "inflight_blocks",
    "waiting_prefill_tokens",
    "head_waiting_blocks",
    "dispatchable",
    "cpu_load_ratio",
    "storage_load_ratio",
)


class ClusterView:
    """The fleet at one instant: instances, the current time, and prefix matching.

    Built by the scheduler core for each decision (or by hand in tests). `instances` holds every
    registered instance, unhealthy and draining ones included; `dispatchable` is what a dispatch
    policy may choose from. `column(name)` gives a field of every instance as a float64 numpy array
    in `instances` order, for policies that score a large fleet vectorised; the scheduler core
    maintains these incrementally, a hand-built view computes them on first use. Likewise
    `prefix_match_array` is the prefix match as an array in `instances` order. A view is valid for
    one decision: do not keep it.
    """

    __slots__ = (
        "_array_cache",
        "_array_matcher",
        "_columns",
        "_confirmed_matcher",
        "_dispatchable",
        "_host_load",
        "_hosts",
        "_index",
        "_indexed_blocks",
        "_match_cache",
        "_matcher",
        "_tier_cache",
        "_tier_matcher",
        "_ttft_predictor",
        "instances",
        "now",
    )

    def __init__(
        self,
        instances: Iterable[InstanceView],
        now: float,
        matcher: PrefixMatcher | None = None,
        columns: Mapping[str, np.ndarray] | None = None,
        index: Mapping[str, int] | None = None,
        array_matcher: PrefixArrayMatcher | None = None,
        tier_matcher: TierMatcher | None = None,
        confirmed_matcher: ConfirmedMatcher | None = None,
        ttft_predictor: TtftPredictor | None = None,
        indexed_blocks: Callable[[str], int] | None = None,
        hosts: Mapping[str, str] | None = None,
    ) -> None:
        self.instances: tuple[InstanceView, ...] = tuple(instances)
        self._hosts = hosts or {}
        self._host_load: dict[str, int] | None = None
        self._indexed_blocks = indexed_blocks
        self._ttft_predictor = ttft_predictor
        self._confirmed_matcher = confirmed_matcher
        self.now = now
        self._matcher = matcher
        self._array_matcher = array_matcher
        self._match_cache: dict[str, Mapping[str, int]] = {}
        self._array_cache: dict[str, np.ndarray] = {}
        self._tier_matcher = tier_matcher
        self._tier_cache: dict[str, np.ndarray] = {}
        self._columns: dict[str, np.ndarray] = dict(columns or {})
        self._dispatchable: tuple[InstanceView, ...] | None = None
        if index is None:
            index = {inst.instance_id: i for i, inst in enumerate(self.instances)}
            if len(index) != len(self.instances):
                raise ValueError("instance ids must be unique")
        self._index = index

    def __getitem__(self, instance_id: str) -> InstanceView:
        return self.instances[self._index[instance_id]]

    def __contains__(self, instance_id: object) -> bool:
        return instance_id in self._index

    def __len__(self) -> int:
        return len(self.instances)

    def index_of(self, instance_id: str) -> int:
        """Position of the instance in `instances` (and in every column)."""
        return self._index[instance_id]

    @property
    def dispatchable(self) -> tuple[InstanceView, ...]:
        if self._dispatchable is None:
            flags = self._columns.get("dispatchable")
            if flags is None:
                self._dispatchable = tuple(inst for inst in self.instances if inst.dispatchable)
            else:  # the column the scheduler core keeps: select without a loop over the fleet
                keep = np.flatnonzero(flags)
                if len(keep) == len(self.instances):
                    self._dispatchable = self.instances
                else:
                    self._dispatchable = tuple(map(self.instances.__getitem__, keep.tolist()))
        return self._dispatchable

    def column(self, name: str) -> np.ndarray:
        """Field `name` (one of `COLUMNS`) of every instance, float64, in `instances` order.

        Read-only where the scheduler core built the view: it is a row of the core's own table."""
        found = self._columns.get(name)
        if found is None:
            if name not in COLUMNS:
                raise KeyError(f"unknown column {name!r}")
            found = np.array([float(getattr(inst, name)) for inst in self.instances])
            self._columns[name] = found
        return found

    def prefix_match(self, request: RequestView) -> Mapping[str, int]:
        """Leading blocks of `request` cached per instance (instances with 0 may be absent)."""
        cached = self._match_cache.get(request.request_id)
        if cached is None:
            if not request.block_hashes:
                cached = {}
            elif self._matcher is not None and request.request_id not in self._array_cache:
                cached = self._matcher(request)
            elif self._array_matcher is not None or request.request_id in self._array_cache:
                array = self.prefix_match_array(request)
                cached = {
                    self.instances[i].instance_id: int(array[i]) for i in np.flatnonzero(array)
                }
            else:
                cached = {}
            self._match_cache[request.request_id] = cached
        return cached

    def prefix_match_array(self, request: RequestView) -> np.ndarray:
        """`prefix_match` as a float64 array in `instances` order (read-only)."""
        cached = self._array_cache.get(request.request_id)
        if cached is None:
            if (
                self._array_matcher is not None
                and request.block_hashes
                and request.request_id not in self._match_cache  # else: the walk is done
            ):
                cached = self._array_matcher(request)
            else:
                cached = np.zeros(len(self.instances))
                for instance_id, blocks in self.prefix_match(request).items():
                    if instance_id in self._index:
                        cached[self._index[instance_id]] = blocks
            cached.flags.writeable = False
            self._array_cache[request.request_id] = cached
        return cached

    @property
    def has_lower_tiers(self) -> bool:
        """Whether blocks below the GPU are matched at all (else `prefix_match_tiers`' lower rows
        are zeros, and a policy may read `prefix_match_array` alone)."""
        return self._tier_matcher is not None

    def prefix_match_tiers(self, request: RequestView) -> np.ndarray:
        """Blocks per tier and instance, shape (len(`TIERS`), instances), read-only: row 0 the
        leading GPU blocks (`prefix_match_array`), each lower row the blocks continuing them on
        that tier."""
        cached = self._tier_cache.get(request.request_id)
        if cached is None:
            gpu = self.prefix_match_array(request)
            cached = np.zeros((len(TIERS), len(self.instances)))
            cached[0] = gpu
            if self._tier_matcher is not None and request.block_hashes:
                cached[1:] = self._tier_matcher(request, gpu)
            cached.flags.writeable = False
            self._tier_cache[request.request_id] = cached
        return cached

    def confirmed_depth(self, request: RequestView, instance_id: str) -> int | None:
        """Leading blocks of `request` that `instance_id` is known to hold, on any tier, without
        the blocks the match counts because requests were only routed there (None: the view
        cannot tell them apart). A pull can copy only these."""
        if self._confirmed_matcher is None:
            return None
        return self._confirmed_matcher(request, instance_id)

    def indexed_blocks(self, instance_id: str) -> int:
        """Blocks the KV-event index holds for an instance (0: none, or no index): how much of
        the fleet's cached prefixes, and so of their future traffic, it already draws."""
        return 0 if self._indexed_blocks is None else self._indexed_blocks(instance_id)

    def host_requests(self, instance_id: str) -> int:
        """Requests running or waiting on the other instances of `instance_id`'s host (0 when
        its host is unknown): they share its CPU."""
        host = self._hosts.get(instance_id)
        if host is None:
            return 0
        if self._host_load is None:
            load: dict[str, int] = {}
            for inst in self.instances:
                h = self._hosts.get(inst.instance_id)
                if h is not None:
                    load[h] = load.get(h, 0) + inst.num_requests
            self._host_load = load
        return self._host_load.get(host, 0) - self[instance_id].num_requests

    def ttft_inputs(
        self, request: RequestView, inst: InstanceView, cached_tokens: int
    ) -> tuple[int, int, int, int]:
        """What a TTFT on `inst` is learned and predicted from: the request's uncached prompt
        tokens, the prefill tokens queued ahead of it (reported or charged by the router,
        whichever is more), the requests running there and those on its host's other
        instances."""
        queued = max(inst.waiting_prefill_tokens, inst.pending_prefill_tokens)
        uncached = max(0, request.num_tokens - cached_tokens)
        return uncached, queued, inst.num_running, self.host_requests(inst.instance_id)

    def predict_ttft(
        self, request: RequestView, inst: InstanceView, cached_tokens: int
    ) -> float | None:
        """Predicted TTFT (seconds) of `request` on `inst` with `cached_tokens` of its prompt
        cached there, by the model learned from the engines' first tokens (None: none yet)."""
        if self._ttft_predictor is None:
            return None
        return self._ttft_predictor(
            inst.instance_id, *self.ttft_inputs(request, inst, cached_tokens)
        )

    def weighted_prefix_match(
        self, request: RequestView, weights: tuple[float, ...]
    ) -> dict[str, float]:
        """Per instance, its blocks per tier weighted by `weights` (one per `TIERS`, GPU first:
        how a peer router prices a lower-tier hit as a fraction of a GPU hit); zeros absent."""
        if not request.block_hashes:
            return {}
        scores = np.asarray(weights, dtype=np.float64) @ self.prefix_match_tiers(request)
        instances = self.instances
        return {instances[i].instance_id: float(scores[i]) for i in np.flatnonzero(scores)}

    def prefix_match_of(self, request: RequestView, instance_id: str) -> int:
        """Leading blocks of `request` cached on one instance, from whichever form of the match
        the policy already asked for (a small fleet's mapping, a large fleet's array)."""
        array = self._array_cache.get(request.request_id)
        if array is not None:
            return int(array[self._index[instance_id]])
        return int(self.prefix_match(request).get(instance_id, 0))


@dataclass(frozen=True, slots=True)
class Decision:
    """Where a request goes, with the evidence: scores per candidate instance and a reason.

    Scores are the policy's own and always higher-is-better: cost-based policies report the
    negated cost, so `explain()` lists the best instance first for every policy.
    """

    instance_id: str
    scores: Mapping[str, float] = field(default_factory=dict)
    reason: str = ""

    def explain(self) -> str:
        """One line per scored instance, best first, for logs and tests."""
        lines = [f"-> {self.instance_id}: {self.reason}"]
        for inst, score in sorted(self.scores.items(), key=lambda kv: (-kv[1], kv[0])):
            lines.append(f"   {inst:>16} {score:.4f}")
        return "\n".join(lines)


@dataclass(frozen=True, slots=True)
class PDDecision:
    """Where a request is prefilled and where it decodes.

    `decode` == `prefill` means no handoff: the request runs where it is prefilled (colocated, or
    conditional disaggregation keeping a short prompt on its decode instance).
    """

    prefill: str
    decode: str
    reason: str = ""

    @property
    def disaggregated(self) -> bool:
        return self.prefill != self.decode


@dataclass(frozen=True, slots=True)
class MigrationOrder:
    """Move running request `request_id` from instance `src` to instance `dst`."""

    request_id: str
    src: str
    dst: str
    reason: str = ""
