"""One simulated run = one trace x one fleet configuration x one dispatch (+ migration) policy.

Contract: `SimSettings` holds everything but the policy (the fleet's latency model and host model,
`simulator.host_model.HostModel`, each one object); `run_policy(trace, settings, policy)` builds
a fresh fleet (new instances, new router state, a freshly loaded and seeded policy), replays the whole
trace and returns a `SimResult`. Runs share nothing, so every policy sees exactly the same arrivals
and a run is deterministic for a seed. `kvherd sim` and the benchmarks both go through here.
With `prefill_instances` / `decode_instances` the fleet is disaggregated: the P/D policy
`pd_policy` (loaded and seeded like the others) pairs each request, and the summary gains the
handoff rows (`handoff_summary`). Every summary has the KV tier rows (`tier_summary`: hit rate
per lower tier, loads, offloads) and the trace's `shared_cache_limit` beside the hit rate; with
`prefix_pull` also the pull rows (`pull_summary`); a trace naming models adds the adapter rows
(`lora_summary`: adapter loads, evictions, requests that waited for a slot).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvherd.kv_events import MEDIUM_CPU, MEDIUM_STORAGE
from policies.base import DispatchPolicy, MigrationPolicy
from policies.registry import (
    PolicyLoadError,
    load_dispatch_policy,
    load_migration_policy,
    load_pd_policy,
)
from scheduler.core.admission import AdmissionSettings
from scheduler.core.admission_queue import QueueSettings
from scheduler.core.autoscale import AutoscaleSettings
from simulator.admission import AdmissionStats
from simulator.cluster import ClusterConfig, MigrationStats, SimCluster
from simulator.host_model import HostModel
from simulator.instance import InstanceConfig
from simulator.latency.base import LatencyModel
from simulator.metrics import shared_cache_limit
from simulator.models import FleetModels
from simulator.pull import PullConfig, PullStats
from simulator.traces import Trace
from simulator.transfer import TransferModel


@dataclass(slots=True)
class SimSettings:
    num_instances: int
    latency: LatencyModel
    instance: InstanceConfig
    migration_policy: str = "none"
    seed: int = 0
    slo_ttft_ms: float | None = None
    slo_tpot_ms: float | None = None
    report_interval_s: float = 0.1
    kv_event_delay_s: float = 0.005
    migration_interval_s: float = 0.5
    migration_bandwidth: float = 25e9
    host: HostModel = field(default_factory=HostModel)  # request path, co-location
    # Decode fast-forward (same results, fewer Python steps); off only to check that claim.
    fast_forward: bool = True
    # P/D disaggregation: instances that only prefill / only decode, next to the mixed ones.
    prefill_instances: int = 0
    decode_instances: int = 0
    pd_policy: str = "kvherd"
    transfer: TransferModel = field(default_factory=TransferModel)
    # The proxy's admission (`scheduler.core.admission`); None: every request is routed at once.
    admission: AdmissionSettings | None = None
    admission_queue: QueueSettings = field(default_factory=QueueSettings)
    max_inflight_per_instance: int = 256
    prefix_pull: PullConfig | None = None  # cross-instance prefix pulls (None: off)
    models: FleetModels | None = None  # base models, adapter slots (a trace naming models)
    autoscale: AutoscaleSettings | None = None  # the autoscaler; None: a fixed fleet
    instance_start_s: float = 30.0  # an autoscaled instance's cold start
    slow_start_s: float = 0.0  # an autoscaled instance's traffic ramps over this long (0: at once)
    routers: int = 1  # router replicas in front of the fleet, each with its own view
    peer_interval_s: float | None = None  # how often they exchange charges (None: never)

    def cluster_config(self) -> ClusterConfig:
        return ClusterConfig(
            num_instances=self.num_instances,
            instance=self.instance,
            report_interval_s=self.report_interval_s,
            kv_event_delay_s=self.kv_event_delay_s,
            migration_interval_s=self.migration_interval_s,
            migration_bandwidth=self.migration_bandwidth,
            host=self.host,
            seed=self.seed,
            prefill_instances=self.prefill_instances,
            decode_instances=self.decode_instances,
            transfer=self.transfer,
            admission=self.admission,
            admission_queue=self.admission_queue,
            max_inflight_per_instance=self.max_inflight_per_instance,
            prefix_pull=self.prefix_pull,
            models=self.models,
            autoscale=self.autoscale,
            instance_start_s=self.instance_start_s,
            slow_start_s=self.slow_start_s,
            routers=self.routers,
            peer_interval_s=self.peer_interval_s,
        )

    @property
    def disaggregated(self) -> bool:
        return self.prefill_instances > 0 or self.decode_instances > 0


@dataclass(slots=True)
class SimResult:
    label: str
    summary: dict[str, Any]
    columns: dict[str, np.ndarray]
    load_times: list[float]
    load_samples: dict[str, list[int]]  # per instance at load_times: running + waiting
    waiting_samples: dict[str, list[int]]
    kv_use_samples: dict[str, list[float]]  # share of GPU KV blocks in use
    refused_arrivals: list[float]  # arrival times of the requests admission refused (429)
    migration: MigrationStats
    wall_s: float
    num_steps: int


def _with_seed(load: Callable[..., Any], spec: str, seed: int) -> Any:
    # Seeded when the policy takes a seed; policies without randomness take none.
    try:
        return load(spec, seed=seed)
    except PolicyLoadError as exc:
        if "bad parameters" not in str(exc):
            raise
        return load(spec)


def load_policies(
    dispatch: str, migration: str, seed: int
) -> tuple[DispatchPolicy, MigrationPolicy | None]:
    policy = _with_seed(load_dispatch_policy, dispatch, seed)
    mig = None if migration == "none" else load_migration_policy(migration)
    return policy, mig


def run_policy(
    trace: Trace,
    settings: SimSettings,
    policy_spec: str,
    on_progress: Callable[[int], None] | None = None,
) -> SimResult:
    dispatch, migration = load_policies(policy_spec, settings.migration_policy, settings.seed)
    pd = (
        _with_seed(load_pd_policy, settings.pd_policy, settings.seed)
        if settings.disaggregated
        else None
    )
    cluster = SimCluster(
        settings.cluster_config(),
        settings.latency,
        dispatch,
        migration,
        on_progress=on_progress,
        fast_forward=settings.fast_forward,
        pd_policy=pd,
    )
    start = time.perf_counter()
    metrics = cluster.run(trace)
    wall = time.perf_counter() - start
    summary = metrics.summary(settings.slo_ttft_ms, settings.slo_tpot_ms)
    stats = cluster.migration_stats
    summary["migrations_started"] = stats.started
    summary["migrations_aborted"] = sum(stats.aborted.values())
    summary["migration_gbytes"] = stats.bytes_sent / 1e9
    summary["migration_downtime_ms_mean"] = (
        float(np.mean(stats.downtime_s)) * 1000.0 if stats.downtime_s else float("nan")
    )
    summary["unfinished"] = metrics.num_unfinished
    summary["routers"] = settings.routers
    summary["cache_missing_tokens"] = cluster.truth.missing_tokens()  # 0: the index is true
    learned = cluster.state.ttft.quality()  # the fleet's learned TTFT model, as the proxy's
    summary["ttft_model_r2"] = learned.r2
    summary["ttft_model_error_ratio"] = learned.error_ratio
    if cluster.admission is not None:
        summary.update(admission_summary(cluster.admission.stats))
    prompt_tokens = float(metrics.columns()["prompt_tokens"].sum())
    summary.update(tier_summary(cluster, prompt_tokens))
    if settings.prefix_pull is not None:
        summary.update(pull_summary(cluster.pull_stats, prompt_tokens))
    summary["shared_cache_limit"] = shared_cache_limit(trace)
    if settings.disaggregated:
        summary.update(handoff_summary(cluster))
    if cluster.adapter_slots:
        summary.update(lora_summary(cluster))
    scaler = cluster.autoscaler
    if scaler is not None:
        summary["instance_hours"] = scaler.instance_s / 3600.0
        summary["scale_outs"] = sum(1 for e in scaler.events if e[1] == "out")
        summary["scale_ins"] = sum(1 for e in scaler.events if e[1] == "in")
        summary["instances_max"] = max([settings.num_instances, *(e[4] for e in scaler.events)])
    else:
        ends = metrics.columns()["last_token"]  # held from 0 to the last token, as scaled ones
        held_s = float(np.nanmax(ends)) if len(ends) else 0.0
        summary["instance_hours"] = settings.num_instances * held_s / 3600.0
    return SimResult(
        label=policy_spec,
        summary=summary,
        columns=metrics.columns(),
        load_times=cluster.load_times,
        load_samples=cluster.load_samples,
        waiting_samples=cluster.waiting_samples,
        kv_use_samples=cluster.kv_use_samples,
        refused_arrivals=list(metrics.refused_arrivals),
        migration=stats,
        wall_s=wall,
        num_steps=sum(
            inst.num_steps for inst in [*cluster.instances.values(), *cluster.retired.values()]
        ),
    )


def admission_summary(stats: AdmissionStats) -> dict[str, Any]:
    """The admission rows: refusals (429s) by code, and the admission queue's waits."""
    waits = np.asarray(stats.queue_waits_s) * 1000.0
    out: dict[str, Any] = {"refused": sum(stats.refused.values())}
    out |= {
        f"refused_{code}": stats.refused.get(code, 0)
        for code in ("queue_wait", "queue_full", "queue_timeout")
    }
    out["admission_queued"] = stats.queued
    out["admission_wait_ms_mean"] = float(waits.mean()) if len(waits) else float("nan")
    out["admission_wait_ms_p99"] = float(np.percentile(waits, 99)) if len(waits) else float("nan")
    return out


def tier_summary(cluster: SimCluster, prompt_tokens: float) -> dict[str, Any]:
    """Hit rate per KV tier (GPU: the rest of the prefix hits), loads and offloads."""
    stats = [inst.tier_stats for inst in cluster.instances.values()]
    loaded = {m: sum(s.loaded_tokens[m] for s in stats) for m in (MEDIUM_CPU, MEDIUM_STORAGE)}
    kv_bytes = cluster.latency.kv_bytes_per_token or 0.0
    share = (lambda tokens: tokens / prompt_tokens) if prompt_tokens else (lambda _: math.nan)
    return {
        "hit_rate_cpu": share(loaded[MEDIUM_CPU]),
        "hit_rate_disk": share(loaded[MEDIUM_STORAGE]),
        "loads": sum(s.loads for s in stats),
        "load_gbytes": sum(loaded.values()) * kv_bytes / 1e9,
        "load_ms_mean": (
            1000.0 * sum(s.load_s for s in stats) / max(1, sum(s.loads for s in stats))
        ),
        "offload_gbytes": sum(s.offload_bytes for s in stats) / 1e9,
    }


def pull_summary(stats: PullStats, prompt_tokens: float) -> dict[str, Any]:
    """The prefix-pull rows: decisions by action, pulls and their fallbacks, bytes, and the
    share of prompt tokens served from pulled blocks (inside `prefix_hit_rate` already)."""
    out: dict[str, Any] = {f"pull_decided_{a}": n for a, n in sorted(stats.decided.items())}
    out |= {
        "pulls": stats.landed,
        "pulls_fallback": sum(stats.fallback.values()),
        "pull_gbytes": stats.bytes_pulled / 1e9,
        "pull_ms_mean": 1000.0 * stats.link_s / stats.started if stats.started else math.nan,
        "hit_rate_pulled": stats.tokens_hit / prompt_tokens if prompt_tokens else math.nan,
    }
    out |= {f"pulls_fallback_{r}": n for r, n in sorted(stats.fallback.items())}
    return out


def lora_summary(cluster: SimCluster) -> dict[str, Any]:
    """The adapter rows: loads into slots, evictions, requests that found every slot pinned."""
    stats = [slots.stats for slots in cluster.adapter_slots.values()]
    return {
        "lora_loads": sum(s.loads for s in stats),
        "lora_evictions": sum(s.evictions for s in stats),
        "lora_slot_waits": sum(s.slot_waits for s in stats),
    }


def handoff_summary(cluster: SimCluster) -> dict[str, Any]:
    """The P/D rows: handoffs by outcome (fallbacks by reason), bytes moved and deduplicated,
    the handoffs' downtime."""
    outcomes = cluster.handoffs.stats
    stats = cluster.handoff_stats
    out: dict[str, Any] = {
        "handoffs_ok": outcomes.ok,
        "handoffs_fallback": outcomes.num_fallback,
        "handoff_gbytes": stats.bytes_sent / 1e9,
        "handoff_dedup_gbytes": stats.bytes_shared / 1e9,
        "handoff_downtime_ms_mean": (
            float(np.mean(stats.downtime_s)) * 1000.0 if stats.downtime_s else float("nan")
        ),
    }
    for reason, count in sorted(outcomes.fallback.items()):
        out[f"handoffs_fallback_{reason}"] = count
    return out
