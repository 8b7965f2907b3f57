"""Prefix pulls in the simulator: a request routed as a PULL gets the holder's blocks on its own
instance before its prefill (served from them as cache hits), the holder keeps stepping, a pull
without room or without blocks left recomputes, and nothing leaks."""

from __future__ import annotations

import pytest

from policies.base import DispatchPolicy
from policies.views import ClusterView, Decision, RequestView
from simulator.cluster import ClusterConfig, SimCluster
from simulator.experiment import pull_summary
from simulator.instance import InstanceConfig
from simulator.latency import load_latency_model
from simulator.pull import PullConfig, PullLinks
from simulator.traces import Trace, TraceRequest

ID_BLOCK = 512  # tokens per trace hash id


class _Pinned(DispatchPolicy):
    """trace-0 .. trace-3 to inst-0, the rest to inst-1."""

    name = "pinned"

    def choose(self, request: RequestView, cluster: ClusterView) -> Decision:
        index = int(request.request_id.split("-")[1])
        return Decision("inst-0" if index < 4 else "inst-1")


def _trace() -> Trace:
    prefix = tuple(range(16))  # 8,192 tokens
    requests = [TraceRequest(0, 0.0, 16 * ID_BLOCK, 64, prefix)]
    # Work queued on the holder just before the request that shares its prefix arrives.
    requests += [
        TraceRequest(i, 1.9, 16 * ID_BLOCK, 8, tuple(range(100 * i, 100 * i + 16)))
        for i in range(1, 4)
    ]
    requests.append(TraceRequest(4, 2.0, 20 * ID_BLOCK, 8, (*prefix, 90, 91, 92, 93)))
    return Trace("pull", requests, ID_BLOCK, has_prefix_info=True)


def _run(pull: bool, patch: str | None = None) -> tuple[SimCluster, dict[str, float]]:
    config = ClusterConfig(
        2,
        InstanceConfig(num_blocks=4096),
        prefix_pull=PullConfig() if pull else None,
    )
    cluster = SimCluster(config, load_latency_model("roofline:llama-2-7b:a100-80gb"), _Pinned())
    if patch == "no_room":
        cluster.instances["inst-1"].block_manager.reserve_blocks = (  # type: ignore[method-assign]
            lambda *args, **kwargs: None
        )
    elif patch == "holder_lost":
        holder = cluster.instances["inst-0"].block_manager
        holder.lookup_cached_prefix = lambda block_hashes: []  # type: ignore[method-assign]
    metrics = cluster.run(_trace())
    for inst in cluster.instances.values():
        inst.block_manager.check_integrity()
        assert inst.block_manager.owners() == []  # no request, carrier or reservation left
    cols = metrics.columns()
    ttft = cols["first_token"] - cols["arrival"]
    last = list(cols["index"]).index(4)  # the request sharing the holder's prefix
    return cluster, {
        "ttft": float(ttft[last]),
        "cached": float(cols["cached_tokens"][last]),
        "completed": float(len(ttft)),
    }


def test_a_pulled_prefix_is_served_as_a_cache_hit_on_the_preferred_instance() -> None:
    cluster, pulled = _run(pull=True)
    _, plain = _run(pull=False)
    stats = cluster.pull_stats
    assert stats.decided == {"pull": 1}
    assert (stats.started, stats.landed, stats.fallback) == (1, 1, {})
    assert stats.tokens_landed == stats.tokens_hit == 16 * ID_BLOCK
    kv = cluster.latency.kv_bytes_per_token
    assert kv is not None and stats.bytes_pulled == 16 * ID_BLOCK * kv
    assert (plain["cached"], pulled["cached"]) == (0, 16 * ID_BLOCK)
    assert pulled["ttft"] < plain["ttft"]
    summary = pull_summary(stats, 100_000)
    assert summary["pulls"] == 1 and summary["hit_rate_pulled"] == pytest.approx(0.08192)


@pytest.mark.parametrize("patch", ["no_room", "holder_lost"])
def test_a_pull_that_cannot_happen_recomputes(patch: str) -> None:
    cluster, run = _run(pull=True, patch=patch)
    stats = cluster.pull_stats
    assert (stats.started, stats.landed, stats.fallback) == (0, 0, {patch: 1})
    assert run["cached"] == 0 and run["completed"] == 5


def test_pulls_queue_on_the_nics_they_share() -> None:
    links = PullLinks()
    assert links.reserve("a", "b", 0.0, 1.0) == 1.0
    assert links.reserve("a", "c", 0.5, 1.0) == 2.0  # a's egress is busy until 1.0
    assert links.reserve("d", "c", 0.5, 1.0) == 3.0  # c's ingress until 2.0
    assert links.reserve("d", "e", 5.0, 1.0) == 6.0


def test_a_prefix_only_on_the_holder_s_lower_tiers_is_routed_there_never_pulled() -> None:
    # inst-0 computes the prefix, then three other prompts push it out of its GPU pool into its
    # host tier. An agent's block server sends only GPU blocks, so for the request sharing it
    # (preferred: inst-1) there is nothing to pull: it runs on inst-0, loading it from there.
    prefix = tuple(range(16))
    requests = [TraceRequest(0, 0.0, 16 * ID_BLOCK, 8, prefix)]
    requests += [
        TraceRequest(i, 1.0 * i, 16 * ID_BLOCK, 8, tuple(range(100 * i, 100 * i + 16)))
        for i in range(1, 4)
    ]
    requests.append(TraceRequest(4, 10.0, 20 * ID_BLOCK, 8, (*prefix, 90, 91, 92, 93)))
    config = ClusterConfig(
        2, InstanceConfig(num_blocks=1024, num_cpu_blocks=2048), prefix_pull=PullConfig()
    )
    cluster = SimCluster(config, load_latency_model("roofline:llama-2-7b:a100-80gb"), _Pinned())
    metrics = cluster.run(Trace("tiers", requests, ID_BLOCK, has_prefix_info=True))
    stats = cluster.pull_stats
    assert stats.decided == {"route": 1} and stats.started == 0
    cols = metrics.columns()
    last = list(cols["index"]).index(4)
    assert cols["cached_tokens"][last] == 16 * ID_BLOCK  # loaded from inst-0's host tier
    holder = cluster.instances["inst-0"].block_manager
    assert holder.tiers is not None and holder.tiers.tiers[0].counters.hits == 16 * ID_BLOCK // 16
