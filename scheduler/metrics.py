"""The proxy's Prometheus metrics (``kvherd_`` names), on a registry of its own.

Contract (what ``GET /metrics`` on the proxy exposes):
- ``kvherd_requests_total{status}``: finished client requests by HTTP status (``"client_closed"`` when
  the client went away mid-stream).
- ``kvherd_routing_decision_seconds``: histogram of the routing decision (tokenize + hash + policy).
- ``kvherd_matched_prefix_blocks``: histogram of leading prompt blocks already cached on the chosen
  instance; ``kvherd_prompt_blocks``: histogram of full prompt blocks, for the hit ratio.
- ``kvherd_instance_inflight{instance}``: requests the proxy has in flight per instance.
- Per model (the request's ``model``: a base model or a LoRA adapter, ``""`` when it named
  none): ``kvherd_model_requests_total``, ``kvherd_model_prompt_blocks_total`` (full prompt
  blocks, at the model's block size), ``kvherd_model_hit_blocks_total`` (those cached on the
  chosen instance) and ``kvherd_model_queued_total`` (those that waited in the admission queue
  first), all ``{model}``.
- ``kvherd_retries_total``: attempts sent to another instance after a failure before the first byte.
- ``kvherd_ejections_total{instance}``: passive or active ejections.
- ``kvherd_admission_queue_depth``: requests waiting for a non-saturated instance;
  ``kvherd_rejected_total{reason}``: requests refused by admission (``queue_wait``: the
  expected wait was too long, ``queue_full``, ``queue_timeout``; a tenant's rate limits:
  ``rate_limit_requests``, ``rate_limit_tokens``, ``request_too_large``).
  ``kvherd_continuations_total{outcome}``: streams whose instance was lost after their first byte
  (``continued`` on another instance, ``migrated``: cut by the proxy's own migration of a vLLM
  stream and continued at its destination, ``finished`` locally: only the end was missing, ``failed``
  attempts, ``unsupported``: not continuable exactly, ``gave_up``: the client got an error frame).
- ``kvherd_instances{state}``: instance counts per health state.
- ``kvherd_lora_loads_total{outcome}``: LoRA adapters the proxy asked an instance to load
  (``--lora-load-on-demand``): ``loaded``, ``failed``.
- ``kvherd_load_poll_failures_total{instance}``: load polls that failed or timed out.
- ``kvherd_block_size_mismatch{instance}``: the block size of an instance whose block size differs
  from the fleet's (set once, when found).
- ``kvherd_kv_history_lost_total{instance}``: resyncs that could not recover the instance's whole
  KV event history (it is then routed with the approximate index).
- Cache truth (`scheduler.core.cache_truth`): ``kvherd_cache_checks_total``,
  ``kvherd_cache_claimed_tokens_total`` (prompt tokens the KV-event index said were cached) and
  ``kvherd_cache_missing_tokens_total`` (of those, what the engine recomputed) per
  ``{instance, model}``; ``kvherd_cache_divergence{instance}`` (missing over claimed, last
  window) and ``kvherd_cache_index_distrusted{instance}`` (1: routed by the approximate index).
- The TTFT model learned online (`scheduler.core.ttft_model`), per ``{instance}`` and for the
  fleet (``instance="fleet"``): ``kvherd_ttft_model_samples``, ``kvherd_ttft_model_r2`` and
  ``kvherd_ttft_model_error_ratio`` (mean relative error of the predictions made at dispatch);
  ``kvherd_ttft_model_weight{instance, term}`` (seconds per unit of each term).
- ``kvherd_kv_events_silent_total{instance}``: times an instance sent no KV event within the
  silence limit after requests were routed there.
- ``kvherd_instance_role{instance, role}``: 1 for each instance's P/D role (``prefill``,
  ``decode``, ``mixed``).
- P/D handoffs (`scheduler.proxy.pd`): ``kvherd_pd_handoffs_total{outcome}`` (``ok``: the request
  moved to its decode instance; ``fallback``: it kept decoding on its prefill instance;
  ``failed``: its prefill stream broke before the handoff resolved),
  ``kvherd_pd_handoff_seconds`` (the first token's frame written to the commit),
  ``kvherd_pd_handoff_downtime_seconds`` (the request suspended), ``kvherd_pd_handoff_bytes``
  (KV bytes sent per handoff), and
  ``kvherd_pd_handoff_blocks_total{kind}`` (``sent``, ``deduplicated``: already cached on the
  decode instance, not sent; ``kvherd_pd_handoff_skipped_bytes_total`` their bytes).
- ``kvherd_routed_hit_blocks_total{medium}``: prompt blocks the chosen instance holds, per KV tier
  (``GPU``, ``CPU``, ``STORAGE``), summed over the decisions (once some instance reports a tier
  below its GPU pool).
- Prefix pulls (``--prefix-pull``): ``kvherd_prefix_pull_decisions_total{action}`` (the router's
  ``recompute``/``route`` where a holder was worth a look; ``pull`` once the pull is sent to the
  chosen instance: the rule picks only sources that can send), ``kvherd_prefix_pulls_total
  {outcome}`` (what the chosen agent reported: ``landed``, ``partial``, ``nothing_to_pull``,
  ``no_room``, ``failed``: recomputed), ``kvherd_prefix_pull_bytes_total`` and
  ``kvherd_prefix_pull_seconds_total``.
- Prefixes moved when the fleet changes size (`scheduler.handover`):
  ``kvherd_handover_blocks_total{cause,outcome}``, blocks pulled (``pulled``) or not (``failed``)
  by survivors of a leaving engine (``scale_in``) or by a new engine warming up (``scale_out``).
- ``kvherd_kv_transfer_params_stripped_total``: client ``kv_transfer_params`` the proxy dropped
  (only a tenant with ``kv_transfer_params=allow`` may send them, `scheduler.core.tenancy`).

The per-request metrics (requests, the three histograms, in-flight) are plain Python numbers that a
collector turns into metric families at scrape time: prometheus_client's locked counters and
histogram bucket walks cost several microseconds per update, six times per request, while the
proxy runs on one event-loop thread that needs no locks. The rare events use prometheus_client.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterator, Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.registry import Collector

from policies.views import TIERS
from scheduler.core.cache_truth import CacheTruth
from scheduler.core.ttft_model import TERMS, TtftModel

_DECISION_BUCKETS = (
    0.00005,
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.5,
)
_BLOCK_BUCKETS = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
_HANDOFF_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0)
_BYTES_BUCKETS = tuple(float(1 << n) for n in range(12, 34, 2))  # 4 KiB .. 8 GiB

CONTENT_TYPE = CONTENT_TYPE_LATEST


class LoopHistogram:
    """A histogram updated from one thread (the event loop): a bucket index and two additions."""

    __slots__ = ("bounds", "counts", "documentation", "name", "sum")

    def __init__(self, name: str, documentation: str, bounds: Sequence[float]) -> None:
        self.name = name
        self.documentation = documentation
        self.bounds = tuple(float(b) for b in bounds)
        self.counts = [0] * (len(self.bounds) + 1)  # the last one is +Inf
        self.sum = 0.0

    def observe(self, value: float) -> None:
        # bisect_left: a value equal to a bound belongs to that bound's bucket (le = "<=").
        self.counts[bisect_left(self.bounds, value)] += 1
        self.sum += value

    def family(self) -> HistogramMetricFamily:
        cumulative = []
        total = 0
        for bound, count in zip((*self.bounds, float("inf")), self.counts, strict=True):
            total += count
            cumulative.append((_bound_text(bound), total))
        family = HistogramMetricFamily(self.name, self.documentation)
        family.add_metric([], cumulative, self.sum)
        return family


def _bound_text(bound: float) -> str:
    if bound == float("inf"):
        return "+Inf"
    return repr(float(bound))


class ProxyMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.decision_seconds = LoopHistogram(
            "kvherd_routing_decision_seconds",
            "Time to route one request (tokenize, hash, policy)",
            _DECISION_BUCKETS,
        )
        self.matched_blocks = LoopHistogram(
            "kvherd_matched_prefix_blocks",
            "Leading prompt blocks cached on the chosen instance",
            _BLOCK_BUCKETS,
        )
        self.prompt_blocks = LoopHistogram(
            "kvherd_prompt_blocks", "Full blocks per prompt", _BLOCK_BUCKETS
        )
        self._requests: dict[int | str, int] = {}
        self._inflight: dict[str, int] = {}
        self._models: dict[str, list[int]] = {}  # model -> [requests, prompt blocks, hit blocks]
        self.cache_truth: CacheTruth | None = None  # the fleet's, read at scrape time
        self.ttft_model: TtftModel | None = None  # likewise
        r.register(_LoopCollector(self))
        self.retries = Counter("kvherd_retries", "Attempts retried on another instance", registry=r)
        self._ejections = Counter(
            "kvherd_ejections", "Instance ejections (passive or active)", ["instance"], registry=r
        )
        self.queue_depth = Gauge(
            "kvherd_admission_queue_depth", "Requests waiting for admission", registry=r
        )
        self._rejected = Counter(
            "kvherd_rejected", "Requests refused by admission", ["reason"], registry=r
        )
        self._continuations = Counter(
            "kvherd_continuations",
            "Streams continued after losing their instance",
            ["outcome"],
            registry=r,
        )
        self._instances = Gauge(
            "kvherd_instances", "Registered instances by health state", ["state"], registry=r
        )
        self._lora_loads = Counter(
            "kvherd_lora_loads", "LoRA adapter loads the proxy asked for", ["outcome"], registry=r
        )
        self._load_poll_failures = Counter(
            "kvherd_load_poll_failures", "Failed or timed-out load polls", ["instance"], registry=r
        )
        self._block_size_mismatch = Gauge(
            "kvherd_block_size_mismatch",
            "Block size of an instance whose block size differs from the fleet's",
            ["instance"],
            registry=r,
        )
        self._kv_history_lost = Counter(
            "kvherd_kv_history_lost",
            "KV event resyncs that could not recover the instance's whole history",
            ["instance"],
            registry=r,
        )
        self._kv_events_silent = Counter(
            "kvherd_kv_events_silent",
            "No KV event within the silence limit after requests were routed there",
            ["instance"],
            registry=r,
        )
        self._roles = Gauge(
            "kvherd_instance_role", "P/D role of each instance", ["instance", "role"], registry=r
        )
        self._role_of: dict[str, str] = {}
        self._handoffs = Counter(
            "kvherd_pd_handoffs", "P/D handoffs by outcome", ["outcome"], registry=r
        )
        self.handoff_seconds = Histogram(
            "kvherd_pd_handoff_seconds",
            "P/D handoff duration, first token's frame written to commit on the decode instance",
            buckets=_HANDOFF_BUCKETS,
            registry=r,
        )
        self.handoff_downtime = Histogram(
            "kvherd_pd_handoff_downtime_seconds",
            "Time a committed P/D handoff kept its request suspended",
            buckets=_HANDOFF_BUCKETS,
            registry=r,
        )
        self.handoff_bytes = Histogram(
            "kvherd_pd_handoff_bytes",
            "KV bytes sent per committed P/D handoff",
            buckets=_BYTES_BUCKETS,
            registry=r,
        )
        self._handoff_blocks = Counter(
            "kvherd_pd_handoff_blocks",
            "KV blocks of committed P/D handoffs: sent, or deduplicated (cached at the decode "
            "instance already)",
            ["kind"],
            registry=r,
        )
        self.handoff_skipped_bytes = Counter(
            "kvherd_pd_handoff_skipped_bytes",
            "KV bytes of committed P/D handoffs not sent: cached at the decode instance already",
            registry=r,
        )

        self._tier_hits = Counter(
            "kvherd_routed_hit_blocks", "Prompt blocks the chosen instance holds, per KV tier",
            ["medium"], registry=r,
        )  # fmt: skip
        self._pull_decisions = Counter(
            "kvherd_prefix_pull_decisions", "Prefix-pull decisions by action", ["action"],
            registry=r,
        )  # fmt: skip
        self._pulls = Counter(
            "kvherd_prefix_pulls", "Prefix pulls by outcome, as the agents report them",
            ["outcome"], registry=r,
        )  # fmt: skip
        self._pull_bytes = Counter(
            "kvherd_prefix_pull_bytes", "KV bytes the agents pulled", registry=r
        )
        self._pull_seconds = Counter(
            "kvherd_prefix_pull_seconds", "Seconds the agents spent pulling", registry=r
        )
        self.handover_blocks = Counter(
            "kvherd_handover_blocks",
            "Prefix blocks moved between engines as the fleet changed size, by cause and outcome",
            ["cause", "outcome"], registry=r,
        )  # fmt: skip
        self.kv_transfer_params_stripped = Counter(
            "kvherd_kv_transfer_params_stripped",
            "Client kv_transfer_params dropped: the tenant may not send them", registry=r,
        )  # fmt: skip

    def tier_hits(self, blocks: tuple[int, ...]) -> None:
        """One decision's hit blocks per tier (`policies.views.TIERS` order)."""
        for medium, count in zip(TIERS, blocks, strict=False):
            if count:
                self._tier_hits.labels(medium=medium).inc(count)

    def pull_decided(self, action: str) -> None:
        self._pull_decisions.labels(action=action).inc()

    def pulled(self, outcome: str, num_bytes: int, seconds: float) -> None:
        self._pulls.labels(outcome=outcome).inc()
        self._pull_bytes.inc(num_bytes)
        self._pull_seconds.inc(seconds)

    def request_done(self, status: int | str) -> None:
        requests = self._requests
        requests[status] = requests.get(status, 0) + 1

    def model_routed(
        self, model: str, prompt_blocks: int, hit_blocks: int, queued: bool = False
    ) -> None:
        """One request for `model` routed: its full prompt blocks, those the instance holds, and
        whether it waited in the admission queue."""
        figures = self._models.get(model)
        if figures is None:
            figures = self._models[model] = [0, 0, 0, 0]
        figures[0] += 1
        figures[1] += prompt_blocks
        figures[2] += hit_blocks
        figures[3] += queued

    def model_figures(self) -> dict[str, tuple[int, int, int, int]]:
        """Per model: (requests, prompt blocks, hit blocks, queued) routed so far."""
        return {model: (f[0], f[1], f[2], f[3]) for model, f in self._models.items()}

    def set_inflight(self, instance_id: str, inflight: int) -> None:
        self._inflight[instance_id] = inflight

    def forget_instance(self, instance_id: str) -> None:
        self._inflight.pop(instance_id, None)

    def ejected(self, instance_id: str) -> None:
        self._ejections.labels(instance=instance_id).inc()

    def load_poll_failed(self, instance_id: str) -> None:
        self._load_poll_failures.labels(instance=instance_id).inc()

    def block_size_mismatch(self, instance_id: str, block_size: int) -> None:
        self._block_size_mismatch.labels(instance=instance_id).set(block_size)

    def kv_history_lost(self, instance_id: str) -> None:
        self._kv_history_lost.labels(instance=instance_id).inc()

    def kv_events_silent(self, instance_id: str) -> None:
        self._kv_events_silent.labels(instance=instance_id).inc()

    def rejected(self, reason: str) -> None:
        self._rejected.labels(reason=reason).inc()

    def lora_load(self, outcome: str) -> None:
        self._lora_loads.labels(outcome=outcome).inc()

    def continuation(self, outcome: str) -> None:
        self._continuations.labels(outcome=outcome).inc()

    def set_instance_roles(self, roles: dict[str, str]) -> None:
        """Each instance's P/D role (an instance gone or re-roled loses its old series)."""
        for instance_id, role in list(self._role_of.items()):
            if roles.get(instance_id) != role:
                self._roles.remove(instance_id, role)
                del self._role_of[instance_id]
        for instance_id, role in roles.items():
            if instance_id not in self._role_of:
                self._roles.labels(instance=instance_id, role=role).set(1)
                self._role_of[instance_id] = role

    def handoff(
        self,
        outcome: str,
        seconds: float | None = None,
        downtime_s: float = 0.0,
        bytes_sent: int = 0,
        blocks_sent: int = 0,
        blocks_skipped: int = 0,
        bytes_skipped: int = 0,
    ) -> None:
        """One P/D handoff's outcome; a committed one (`seconds` given) with its figures."""
        self._handoffs.labels(outcome=outcome).inc()
        if seconds is None:
            return
        self.handoff_seconds.observe(seconds)
        self.handoff_downtime.observe(downtime_s)
        self.handoff_bytes.observe(bytes_sent)
        self._handoff_blocks.labels(kind="sent").inc(blocks_sent)
        self._handoff_blocks.labels(kind="deduplicated").inc(blocks_skipped)
        self.handoff_skipped_bytes.inc(bytes_skipped)

    def set_instance_states(self, counts: dict[str, int]) -> None:
        for state, count in counts.items():
            self._instances.labels(state=state).set(count)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _LoopCollector(Collector):
    """The per-request metrics as metric families, read at scrape time."""

    def __init__(self, metrics: ProxyMetrics) -> None:
        self._metrics = metrics

    def collect(self) -> Iterator[Metric]:
        m = self._metrics
        requests = CounterMetricFamily(
            "kvherd_requests", "Client requests finished, by HTTP status", labels=["status"]
        )
        for status, count in list(m._requests.items()):
            requests.add_metric([str(status)], count)
        yield requests
        yield m.decision_seconds.family()
        yield m.matched_blocks.family()
        yield m.prompt_blocks.family()
        inflight = GaugeMetricFamily(
            "kvherd_instance_inflight", "Requests in flight per instance", labels=["instance"]
        )
        for instance_id, count in list(m._inflight.items()):
            inflight.add_metric([instance_id], count)
        yield inflight
        per_model = [
            CounterMetricFamily(name, text, labels=["model"])
            for name, text in (
                ("kvherd_model_requests", "Requests routed, per model"),
                ("kvherd_model_prompt_blocks", "Full prompt blocks routed, per model"),
                ("kvherd_model_hit_blocks", "Prompt blocks cached on the chosen instance"),
                ("kvherd_model_queued", "Requests that waited in the admission queue, per model"),
            )
        ]
        for model, figures in list(m._models.items()):
            for family, value in zip(per_model, figures, strict=True):
                family.add_metric([model], value)
        yield from per_model
        if m.cache_truth is not None:
            yield from _truth_families(m.cache_truth)
        if m.ttft_model is not None:
            yield from _ttft_model_families(m.ttft_model)


def _ttft_model_families(model: TtftModel) -> Iterator[Metric]:
    quality = [
        GaugeMetricFamily(name, text, labels=["instance"])
        for name, text in (
            ("kvherd_ttft_model_samples", "First tokens the learned TTFT model is fitted on"),
            ("kvherd_ttft_model_r2", "R^2 of the learned TTFT model over its samples"),
            (
                "kvherd_ttft_model_error_ratio",
                "Mean |predicted - observed| / observed TTFT of predictions made at dispatch",
            ),
        )
    ]
    weights = GaugeMetricFamily(
        "kvherd_ttft_model_weight",
        "The learned TTFT model's seconds per unit of each term",
        labels=["instance", "term"],
    )
    for instance_id in [*model.instances(), None]:
        label = instance_id or "fleet"
        q = model.quality(instance_id)
        for family, value in zip(quality, (q.samples, q.r2, q.error_ratio), strict=True):
            family.add_metric([label], value)
        coef = model.fitted(instance_id)
        if coef is not None:
            for term, value in zip(TERMS, coef, strict=True):
                weights.add_metric([label, term], value)
    yield from quality
    yield weights


def _truth_families(truth: CacheTruth) -> Iterator[Metric]:
    totals = [
        CounterMetricFamily(name, text, labels=["instance", "model"])
        for name, text in (
            ("kvherd_cache_checks", "Requests whose engine-reported cached tokens were checked"),
            ("kvherd_cache_claimed_tokens", "Prompt tokens the KV-event index said were cached"),
            ("kvherd_cache_missing_tokens", "Claimed cached prompt tokens the engine recomputed"),
        )
    ]
    for (instance_id, model), t in list(truth.totals.items()):
        for family, value in zip(
            totals, (t.checks, t.claimed_tokens, t.missing_tokens), strict=True
        ):
            family.add_metric([instance_id, model], value)
    yield from totals
    divergence = GaugeMetricFamily(
        "kvherd_cache_divergence",
        "Missing over claimed cached tokens, over the instance's last checks",
        labels=["instance"],
    )
    distrusted = GaugeMetricFamily(
        "kvherd_cache_index_distrusted",
        "1 while the instance is routed by the approximate index for diverging",
        labels=["instance"],
    )
    for instance_id in truth.checked_instances():
        divergence.add_metric([instance_id], truth.divergence(instance_id))
        distrusted.add_metric([instance_id], float(truth.diverging(instance_id)))
    yield divergence
    yield distrusted
