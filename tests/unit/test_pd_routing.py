"""P/D routing in the scheduler core and the proxy: roles from reports and overrides, pairing only
in a disaggregated fleet, the colocated fallback when a phase has no instance left, accounting that
follows the handoff, and the proxy's reading of the agent's handoff report."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from policies.registry import load_dispatch_policy, load_pd_policy
from scheduler.core.cluster_state import ClusterState
from scheduler.core.load_report import LoadReport, LoadReportError, parse_agent_state
from scheduler.core.router import Router
from scheduler.fleet import Fleet, FleetSettings
from scheduler.forwarding import UpstreamError
from scheduler.metrics import ProxyMetrics
from scheduler.proxy import pd

BS = 16
PROMPT = list(range(3, 3 + 400))  # 25 full blocks, past kvherd's local_prefill_tokens


def report(role: str | None, running: int = 0) -> LoadReport:
    return LoadReport(
        num_running=running,
        num_waiting=0,
        num_total_blocks=1000,
        num_free_blocks=1000,
        waiting_prefill_tokens=0,
        head_waiting_blocks=0,
        role=role,
    )


def core(roles: dict[str, str | None], override: dict[str, str] | None = None) -> Router:
    cluster = ClusterState(block_size=BS)
    for instance_id, role in roles.items():
        cluster.add_instance(instance_id, role=(override or {}).get(instance_id))
        cluster.apply_report(instance_id, report(role), now=0.0)
    return Router(cluster, load_dispatch_policy("kvherd"), load_pd_policy("kvherd"))


def test_role_is_read_from_the_state_snapshot_and_checked() -> None:
    assert parse_agent_state({"role": "decode"}).role == "decode"
    assert parse_agent_state({}).role is None
    with pytest.raises(LoadReportError, match="role"):
        parse_agent_state({"role": "both"})


def test_disaggregated_fleet_pairs_and_accounting_follows_the_handoff() -> None:
    router = core({"p": "prefill", "d": "decode"})
    assert router.cluster.disaggregated
    routed = router.route("r1", PROMPT, now=1.0)
    assert (routed.instance_id, routed.decode_id) == ("p", "d")
    assert router.cluster.get("p").view().inflight == 1
    assert router.cluster.get("d").view().inflight == 1  # incoming
    router.on_migrated("r1", "d", now=2.0)
    assert router.cluster.get("p").view().inflight == 0
    assert router.cluster.get("d").view().inflight == 1
    router.on_finish("r1", now=3.0)
    assert router.cluster.get("d").view().inflight == 0


def test_pairings_spread_over_decode_instances_before_any_handoff() -> None:
    router = core({"p": "prefill", "d0": "decode", "d1": "decode"})
    first = router.route("r1", PROMPT, now=1.0)
    second = router.route("r2", [t + 1 for t in PROMPT], now=1.1)
    assert {first.decode_id, second.decode_id} == {"d0", "d1"}
    d0 = router.cluster.get(first.decode_id or "")
    assert d0.view().inflight == 1  # incoming: counted from the pairing on
    router.on_handoff_failed("r1")  # it decodes on the prefill instance after all
    assert d0.view().inflight == 0
    router.on_migrated("r2", second.decode_id or "", now=2.0)
    assert router.cluster.get(second.decode_id or "").view().inflight == 1  # adopted, once
    router.on_finish("r2", now=3.0)
    router.on_finish("r1", now=3.0)
    assert all(router.cluster.get(i).view().inflight == 0 for i in ("p", "d0", "d1"))


def test_short_prompt_is_not_handed_off() -> None:
    routed = core({"p": "prefill", "d": "decode"}).route("r1", PROMPT[:40], now=1.0)
    assert (routed.instance_id, routed.decode_id) == ("d", None)


def test_mixed_fleet_never_pairs() -> None:
    router = core({"a": None, "b": "mixed"})
    assert not router.cluster.disaggregated
    assert router.route("r1", PROMPT, now=1.0).decode_id is None


def test_a_phase_without_instances_falls_back_to_colocated() -> None:
    router = core({"p": "prefill", "d": "decode"})
    routed = router.route("r1", PROMPT, now=1.0, exclude={"p"})  # the prefill instance failed
    assert (routed.instance_id, routed.decode_id) == ("d", None)


def test_operator_role_overrides_the_report() -> None:
    router = core({"p": "prefill", "d": "decode"}, override={"p": "mixed", "d": "mixed"})
    assert {router.cluster.get(i).view().role for i in ("p", "d")} == {"mixed"}
    assert not router.cluster.disaggregated
    router.cluster.remove_instance("p")
    assert not router.cluster.disaggregated


async def _chunks(*parts: bytes, error: bool = False) -> AsyncIterator[bytes]:
    for part in parts:
        yield part
    if error:
        raise UpstreamError("broke")


def _fleet() -> tuple[Fleet, ProxyMetrics]:
    metrics = ProxyMetrics()
    return Fleet("kvherd", FleetSettings(block_size=BS), metrics), metrics


def _outcome(fleet: Fleet, metrics: ProxyMetrics) -> pd.HandoffOutcome:
    return pd.HandoffOutcome(fleet, metrics, "k", "d")


def _count(metrics: ProxyMetrics, outcome: str) -> float:
    value = metrics.registry.get_sample_value("kvherd_pd_handoffs_total", {"outcome": outcome})
    return value or 0.0


async def test_watch_strips_the_handoff_line_split_across_chunks() -> None:
    fleet, metrics = _fleet()
    line = (
        b': kvherd {"handoff":{"outcome":"ok","blocks_sent":3,"blocks_skipped":20,'
        b'"bytes_sent":300,"bytes_skipped":2000,"downtime_s":0.01,"duration_s":0.05}}\n'
    )
    data = b"data: {}\n\n" + line + b'data: {"kvherd":{"migrated_to":"x"}}\n\n'
    for cut in (5, len(b"data: {}\n\n") + 3, len(b"data: {}\n\n") + 30, len(data) - 3):
        out = [c async for c in pd.watch(_chunks(data[:cut], data[cut:]), _outcome(fleet, metrics))]
        assert b"".join(out) == data.replace(line, b"")
    assert _count(metrics, "ok") == 4
    blocks = metrics.registry.get_sample_value(
        "kvherd_pd_handoff_blocks_total", {"kind": "deduplicated"}
    )
    assert blocks == 80
    assert metrics.registry.get_sample_value("kvherd_pd_handoff_bytes_count") == 4


async def test_watch_counts_fallback_and_failed() -> None:
    fleet, metrics = _fleet()
    fallback = b': kvherd {"handoff":{"outcome":"fallback","reason":"dst_failed"}}\n'
    body = b"data: {}\n\ndata: [DONE]\n\n"
    out = [c async for c in pd.watch(_chunks(fallback + body), _outcome(fleet, metrics))]
    assert b"".join(out) == body
    assert _count(metrics, "fallback") == 1
    with pytest.raises(UpstreamError):
        async for _ in pd.watch(_chunks(b"data: {}\n\n", error=True), _outcome(fleet, metrics)):
            pass
    assert _count(metrics, "failed") == 1
    assert _count(metrics, "ok") == 0


def test_a_handoff_is_settled_once_whatever_reports_it_later() -> None:
    fleet, metrics = _fleet()
    handoff = _outcome(fleet, metrics)
    handoff.reported({"outcome": "fallback"})
    handoff.moved()
    handoff.failed()
    handoff.reported({"outcome": "ok", "duration_s": 0.1})
    assert (_count(metrics, "fallback"), _count(metrics, "ok"), _count(metrics, "failed")) == (
        1, 0, 0,
    )  # fmt: skip
    unread = _outcome(fleet, metrics)
    unread.reported("not a report")
    unread.fell_back()
    assert (_count(metrics, "fallback"), _count(metrics, "failed")) == (1, 1)
    silent = _outcome(fleet, metrics)
    silent.failed(counted=False)  # an error answer: not a failed handoff
    silent.failed()
    assert _count(metrics, "failed") == 1
