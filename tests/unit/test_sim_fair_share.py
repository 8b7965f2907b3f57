"""Fair share and priorities in `kvherd sim`'s admission (the proxy's core, `SimAdmission`): a tenant
flooding at 10x the fleet's capacity next to one at 30% leaves the quiet one served, none refused,
at its TTFT without the flood (within 1.5x), and the flooder refused; under contention a high
class's p99 TTFT is well below a low class's, and no low-class request waits beyond aging."""

from __future__ import annotations

import numpy as np

from policies import load_dispatch_policy
from scheduler.core.admission import AdmissionSettings
from scheduler.core.admission_queue import QueueSettings
from simulator.cluster import ClusterConfig, SimCluster
from simulator.instance import InstanceConfig
from simulator.latency import load_latency_model
from simulator.traces import Trace, TraceRequest

LATENCY = "roofline:llama-2-7b:a100-80gb"
SECONDS = 6.0


def _cluster(queue: QueueSettings | None = None) -> SimCluster:
    cfg = ClusterConfig(
        num_instances=2,
        instance=InstanceConfig(
            num_blocks=4096, block_size=16, max_num_seqs=8, max_num_batched_tokens=2048
        ),
        admission=AdmissionSettings(),
        admission_queue=queue or QueueSettings(),
        max_inflight_per_instance=8,  # the engines' batch: what waits, waits in admission
    )
    return SimCluster(cfg, load_latency_model(LATENCY), load_dispatch_policy("round_robin"))


def _trace(*loads: tuple[str, float, int]) -> Trace:
    """Evenly spaced arrivals for each (tenant, requests/s, priority), merged by time."""
    arrivals = sorted(
        (i / rate, tenant, priority)
        for tenant, rate, priority in loads
        for i in range(int(rate * SECONDS))
    )
    requests = [
        TraceRequest(i, at, 64, 32, (2 * i, 2 * i + 1), tenant, priority)
        for i, (at, tenant, priority) in enumerate(arrivals)
    ]
    return Trace("tenants", requests, block_size=32, has_prefix_info=True)


def _run(trace: Trace, queue: QueueSettings | None = None) -> tuple[SimCluster, dict[str, float]]:
    cluster = _cluster(queue)
    cluster.run(trace)
    return cluster, _ttfts(cluster, trace)


def _ttfts(cluster: SimCluster, trace: Trace) -> dict[str, float]:
    cols = cluster.metrics.columns()
    ttft = dict(zip(cols["index"].astype(int), cols["first_token"] - cols["arrival"], strict=True))
    return {
        f"{r.tenant}:{r.priority}:{r.index}": ttft[r.index]
        for r in trace.requests
        if r.index in ttft
    }


def _capacity() -> float:
    """Requests/s the fleet completes flooded (one tenant at far above it)."""
    cluster = _cluster()
    cluster.run(_trace(("probe", 2000.0, 0)))
    cols = cluster.metrics.columns()
    return len(cols["index"]) / float(cols["last_token"].max() - cols["arrival"].min())


def _of(ttfts: dict[str, float], prefix: str) -> np.ndarray:
    return np.array([v for k, v in ttfts.items() if k.startswith(prefix)])


def test_a_flooding_tenant_takes_no_more_than_its_share() -> None:
    capacity = _capacity()
    quiet = ("quiet", 0.3 * capacity, 0)
    _, alone = _run(_trace(quiet))
    cluster, both = _run(_trace(quiet, ("flood", 10 * capacity, 0)))
    stats = cluster.admission.stats  # type: ignore[union-attr]
    assert stats.refused_by_tenant.get("quiet", 0) == 0
    assert stats.refused_by_tenant["flood"] > 5 * capacity * SECONDS
    quiet_alone, quiet_flooded = _of(alone, "quiet"), _of(both, "quiet")
    assert len(quiet_flooded) == len(quiet_alone) == int(0.3 * capacity * SECONDS)
    ratio = float(np.median(quiet_flooded) / np.median(quiet_alone))
    print(
        f"\ncapacity {capacity:.1f} req/s; quiet TTFT p50 {np.median(quiet_alone) * 1e3:.1f} ms "
        f"alone, {np.median(quiet_flooded) * 1e3:.1f} ms flooded ({ratio:.2f}x)"
    )
    assert ratio <= 1.5
    # Idle share is lent: the flooder still got the rest of the fleet.
    assert len(_of(both, "flood")) > 0.5 * capacity * SECONDS


def test_a_high_class_goes_first_and_aging_bounds_the_low_one() -> None:
    capacity = _capacity()
    aging = QueueSettings(aging_s=1.0)
    trace = _trace(("a", 0.7 * capacity, 0), ("a", 0.7 * capacity, 5))  # 1.4x: contention
    cluster, ttfts = _run(trace, aging)
    high, low = _of(ttfts, "a:0:"), _of(ttfts, "a:5:")
    print(f"\np99 TTFT high {np.percentile(high, 99):.3f} s, low {np.percentile(low, 99):.3f} s")
    assert np.percentile(high, 99) < 0.5 * np.percentile(low, 99)
    waits = cluster.admission.stats.queue_waits_s  # type: ignore[union-attr]
    assert max(waits) <= aging.aging_s + 0.5  # aging's bound, plus the turn it then waits
