"""P/D disaggregation in the simulator: production's pairing, the agents' migration session for the
handoff (one stop-and-copy stage out of a prefill-only instance, live stages out of a mixed one),
the request never decoding on a prefill instance, concurrent handoffs, the same tokens as colocated
serving, no leaked blocks, conditional disaggregation, refused handoffs and the link's bandwidth."""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar

import pytest

import simulator.cluster as sim_cluster
from instance_agent.engine.core.batch_scheduler import SchedulerOutput
from instance_agent.engine.core.request import Request
from migration.core.handoff import MAX_HANDOFFS_OUT, handoff_stages
from migration.core.session import (
    Abort,
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
)
from migration.core.stages import StageConfig
from policies import load_dispatch_policy
from policies.registry import load_pd_policy
from simulator.cluster import ClusterConfig, SimCluster
from simulator.instance import InstanceConfig
from simulator.latency import load_latency_model
from simulator.pd import FINISHED_FIRST
from simulator.traces import Trace, TraceRequest
from simulator.transfer import TransferModel, link

BS = 16
LATENCY = "roofline:llama-2-7b:a100-80gb"


class _TokenCluster(SimCluster):
    """A fleet that keeps each finished request's output tokens."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.outputs: dict[str, list[int]] = {}

    def on_finished(self, request: Request, instance_id: str, now: float) -> None:
        self.outputs[request.request_id] = list(request.output_token_ids)
        super().on_finished(request, instance_id, now)


def _run(
    trace: list[TraceRequest],
    mixed: int = 0,
    prefill: int = 0,
    decode: int = 0,
    num_blocks: int = 4000,
    transfer: TransferModel | None = None,
    stages: StageConfig | None = None,
    prepare: Callable[[SimCluster], None] | None = None,
    instance: InstanceConfig | None = None,
) -> _TokenCluster:
    config = ClusterConfig(
        num_instances=mixed,
        instance=instance or InstanceConfig(num_blocks=num_blocks, block_size=BS),
        prefill_instances=prefill,
        decode_instances=decode,
        transfer=transfer or TransferModel(),
        migration_stages=stages or StageConfig(),
    )
    cluster = _TokenCluster(
        config,
        load_latency_model(LATENCY),
        load_dispatch_policy("kvherd"),
        pd_policy=load_pd_policy("kvherd"),
    )
    if prepare is not None:
        prepare(cluster)
    cluster.run(Trace("t", trace, block_size=BS))
    return cluster


def _trace(
    n: int, input_length: int, output_length: int, gap_s: float = 0.05
) -> list[TraceRequest]:
    blocks = -(-input_length // BS)
    return [
        TraceRequest(
            i, i * gap_s, input_length, output_length, tuple(range(i * 1000, i * 1000 + blocks))
        )
        for i in range(n)
    ]


def _no_leaks(cluster: SimCluster) -> None:
    for inst in cluster.instances.values():
        inst.block_manager.check_integrity()
        assert inst.block_manager.owners() == [], inst.instance_id
        assert not inst.scheduler.requests, inst.instance_id
    assert not cluster._migrating
    for state in cluster.state.instances.values():
        assert not state.inflight, state.instance_id


class _RecordingSession(SourceSession):
    """The agents' source session, keeping every input it got and action it returned."""

    log: ClassVar[list[tuple[str, object, SourceAction]]] = []
    in_flight: ClassVar[int] = 0
    most_in_flight: ClassVar[int] = 0

    def _note(self, event: str, given: object, action: SourceAction) -> SourceAction:
        self.log.append((event, given, action))
        if isinstance(action, Done | Abort):
            type(self).in_flight -= 1
        return action

    def start(self) -> SourceAction:
        cls = type(self)
        cls.in_flight += 1
        cls.most_in_flight = max(cls.most_in_flight, cls.in_flight)
        return self._note("start", None, super().start())

    def on_snapshot(self, snapshot: RequestSnapshot) -> SourceAction:
        return self._note("snapshot", snapshot, super().on_snapshot(snapshot))

    def on_suspended(self) -> SourceAction:
        return self._note("suspended", None, super().on_suspended())

    def on_reserved(
        self, accepted: bool, num_cached_blocks: int = 0, num_reserved: int = 0, reason: str = ""
    ) -> SourceAction:
        given = (accepted, num_cached_blocks, num_reserved, reason)
        return self._note("reserved", given, super().on_reserved(*given))

    def on_landed(self) -> SourceAction:
        return self._note("landed", None, super().on_landed())

    def on_commit_answer(self, ok: bool, reason: str = "") -> SourceAction:
        return self._note("commit_answer", (ok, reason), super().on_commit_answer(ok, reason))

    def on_released(self) -> SourceAction:
        return self._note("released", None, super().on_released())


def _replay(
    log: list[tuple[str, object, SourceAction]], request_id: str, role: str
) -> list[SourceAction]:
    """Feed a fresh session the same events, as `migration.source.migrate_out` feeds them (with
    the stages `instance_agent.pd_handoff` picks for a source of `role`)."""
    session = SourceSession(request_id, BS, handoff_stages(role, StageConfig()))
    out: list[SourceAction] = []
    for event, given, _ in log:
        if event == "start":
            out.append(session.start())
        elif event == "snapshot":
            assert isinstance(given, RequestSnapshot)
            out.append(session.on_snapshot(given))
        elif event == "reserved":
            assert isinstance(given, tuple)
            out.append(session.on_reserved(*given))
        elif event == "commit_answer":
            assert isinstance(given, tuple)
            out.append(session.on_commit_answer(*given))
        else:
            out.append(getattr(session, f"on_{event}")())
    return out


def test_a_prefill_instance_hands_off_in_one_stop_and_copy_stage(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _RecordingSession.log = []
    monkeypatch.setattr(sim_cluster, "SourceSession", _RecordingSession)
    cluster = _run(_trace(1, 800, 40), prefill=1, decode=1)
    assert cluster.handoffs.stats.ok == 1 and cluster.handoffs.stats.expected == 1
    log = _RecordingSession.log
    actions = [action for _, _, action in log]
    # Held at its first token, the request is suspended already: no live stage, no Suspend; one
    # stop-and-copy stage carries every block (hashes offered: cache-aware).
    assert [type(a) for a in actions] == [Snapshot, Reserve, Copy, Commit, Release, Done]
    (only,) = [a for a in actions if isinstance(a, Reserve)]
    assert only.stage.index == 0 and only.stage.final
    assert only.stage.num_blocks == 800 // BS and len(only.stage.block_hashes) == 800 // BS
    first_snapshot = log[1][1]
    assert isinstance(first_snapshot, RequestSnapshot) and first_snapshot.phase == "suspended"
    assert first_snapshot.num_kv_tokens == 800  # the first token's KV is not computed yet
    assert _replay(log, "0", "prefill") == actions
    stats = cluster.handoff_stats
    kv = load_latency_model(LATENCY).kv_bytes_per_token or 0.0
    assert stats.bytes_sent == pytest.approx(only.stage.num_blocks * BS * kv)
    _no_leaks(cluster)


def test_a_mixed_instance_hands_off_with_live_stages(monkeypatch: pytest.MonkeyPatch) -> None:
    _RecordingSession.log = []
    monkeypatch.setattr(sim_cluster, "SourceSession", _RecordingSession)
    cluster = _run(_trace(1, 800, 40), mixed=1, decode=1)
    assert cluster.handoffs.stats.ok == 1 and cluster.handoffs.stats.expected == 1
    assert cluster.metrics.columns()["instance"].tolist() == ["decode-0"]
    log = _RecordingSession.log
    actions = [action for _, _, action in log]
    # Llumnix's stages as the agents run them: a live stage of the prompt's full blocks (hashes
    # offered: cache-aware), the suspension with a second look, the stop-and-copy stage, commit.
    kinds = [type(a) for a in actions]
    assert kinds == [
        Snapshot,
        Reserve,
        Copy,
        Snapshot,
        Suspend,
        Snapshot,
        Reserve,
        Copy,
        Commit,
        Release,
        Done,
    ]
    live, final = actions[1], actions[6]
    assert isinstance(live, Reserve) and isinstance(final, Reserve)
    assert live.stage.index == 0 and not live.stage.final
    assert live.stage.num_blocks == 800 // BS and len(live.stage.block_hashes) == 800 // BS
    assert final.stage.final and 1 <= final.stage.num_blocks <= 4
    first_snapshot = log[1][1]
    assert isinstance(first_snapshot, RequestSnapshot) and first_snapshot.phase == "decoding"
    # The same events give the same actions from a plain session: nothing simulator-specific.
    assert _replay(log, "0", "mixed") == actions
    stats = cluster.handoff_stats
    kv = load_latency_model(LATENCY).kv_bytes_per_token or 0.0
    sent = live.stage.num_blocks + final.stage.num_blocks
    assert stats.bytes_sent == pytest.approx(sent * BS * kv)
    _no_leaks(cluster)


def test_a_prefill_instance_never_decodes_a_handed_off_request() -> None:
    decodes: list[str] = []

    def watch(cluster: SimCluster) -> None:
        scheduler = cluster.instances["prefill-0"].scheduler
        schedule = scheduler.schedule

        def scheduled() -> SchedulerOutput:
            out = schedule()
            decodes.extend(
                s.request.request_id for s in out.scheduled if s.request.output_token_ids
            )
            return out

        scheduler.schedule = scheduled  # type: ignore[method-assign]

    # A burst of long prompts: the prefill instance computes prompts while handoffs queue.
    cluster = _run(_trace(24, 900, 30, gap_s=0.005), prefill=1, decode=1, prepare=watch)
    assert cluster.handoffs.stats.ok == 24
    assert cluster.instances["prefill-0"].num_steps > 0
    assert decodes == []
    _no_leaks(cluster)


@pytest.mark.parametrize("chunked", [True, False])
@pytest.mark.parametrize("fleet", [(2, 0, 0), (0, 1, 1)])
def test_without_chunked_prefill_every_prompt_is_computed_whole(
    chunked: bool, fleet: tuple[int, int, int]
) -> None:
    """The DistServe-era baseline (vLLM without chunked prefill) runs end to end, colocated and
    disaggregated: a prompt joins a step only whole; with chunking the same burst is split."""
    chunks: list[tuple[int, int, int]] = []  # (new tokens, computed before, prompt length)

    def watch(cluster: SimCluster) -> None:
        for inst in cluster.instances.values():
            schedule = inst.scheduler.schedule

            def scheduled(schedule: Callable[[], SchedulerOutput] = schedule) -> SchedulerOutput:
                out = schedule()
                chunks.extend(
                    (s.num_new_tokens, s.num_computed_before, s.request.num_prompt_tokens)
                    for s in out.scheduled
                    if not s.request.output_token_ids
                )
                return out

            inst.scheduler.schedule = scheduled  # type: ignore[method-assign]

    config = InstanceConfig(
        num_blocks=4000,
        block_size=BS,
        max_num_batched_tokens=1024,
        max_model_len=1024,
        enable_chunked_prefill=chunked,
    )
    mixed, prefill, decode = fleet
    trace = _trace(8, 700, 20, gap_s=0.0)  # two prompts never fit one 1,024-token step
    cluster = _run(trace, mixed, prefill, decode, prepare=watch, instance=config)
    assert cluster.metrics.columns()["output_tokens"].tolist() == [20] * len(trace)
    split = [c for c in chunks if c[0] + c[1] < c[2]]
    if chunked:
        assert split
    else:
        assert not split and len(chunks) == len(trace)
    if prefill:
        assert cluster.handoffs.stats.ok == len(trace)
    _no_leaks(cluster)


def test_a_held_handoffs_downtime_runs_from_its_first_token(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Out of a busy prefill instance a handoff's session first runs after the step in flight
    when its request sampled its first token; the request stopped decoding at that token, so
    that is where its downtime starts (not at the session's snapshot)."""
    committed_at: dict[str, float] = {}
    committed = SimCluster._committed

    def record(self: SimCluster, m: object, src: object, dst: object) -> None:
        committed_at[m.session.request_id] = self.loop.now  # type: ignore[attr-defined]
        committed(self, m, src, dst)  # type: ignore[arg-type]

    monkeypatch.setattr(SimCluster, "_committed", record)
    trace = _trace(24, 900, 30, gap_s=0.005)  # prompts keep coming while handoffs wait
    cluster = _run(trace, prefill=1, decode=1)
    assert cluster.handoffs.stats.ok == len(trace)
    cols = cluster.metrics.columns()
    first = {f"trace-{int(i)}": t for i, t in zip(cols["index"], cols["first_token"], strict=True)}
    expected = sorted(committed_at[rid] - first[rid] for rid in committed_at)
    assert sorted(cluster.handoff_stats.downtime_s) == pytest.approx(expected)
    # The burst makes some handoffs wait a whole prefill step: far beyond the copy itself.
    step = load_latency_model(LATENCY).step_time([(900, 0)], [])
    assert max(expected) > step
    _no_leaks(cluster)


def test_handoffs_out_of_one_prefill_instance_run_concurrently(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _RecordingSession.log = []
    _RecordingSession.in_flight = _RecordingSession.most_in_flight = 0
    monkeypatch.setattr(sim_cluster, "SourceSession", _RecordingSession)
    # Eight prompts prefilled in the same steps: their first tokens come together.
    cluster = _run(_trace(8, 300, 30, gap_s=0.0), prefill=1, decode=1)
    assert cluster.handoffs.stats.ok == 8
    assert _RecordingSession.most_in_flight == MAX_HANDOFFS_OUT
    _no_leaks(cluster)


def test_disaggregated_decodes_give_the_colocated_tokens() -> None:
    trace = _trace(12, 700, 30)
    colocated = _run(trace, mixed=2)
    disaggregated = _run(trace, prefill=1, decode=1)
    assert disaggregated.handoffs.stats.ok == len(trace)
    assert disaggregated.outputs == colocated.outputs
    assert all(len(tokens) == 30 for tokens in disaggregated.outputs.values())
    cols = disaggregated.metrics.columns()
    assert set(cols["instance"]) == {"decode-0"}  # every request finished where it decoded
    assert cols["output_tokens"].tolist() == [30] * len(trace)
    _no_leaks(colocated)
    _no_leaks(disaggregated)


def test_short_prompts_stay_where_they_decode() -> None:
    cluster = _run(_trace(6, 100, 20), prefill=1, decode=1)
    assert cluster.handoffs.stats.expected == 0 and cluster.handoff_stats.started == 0
    assert set(cluster.metrics.columns()["instance"]) == {"decode-0"}
    assert cluster.instances["prefill-0"].num_steps == 0
    _no_leaks(cluster)


def test_a_single_token_request_finishes_before_its_handoff() -> None:
    cluster = _run(_trace(1, 800, 1), prefill=1, decode=1)
    stats = cluster.handoffs.stats
    assert stats.ok == 0 and stats.fallback == {FINISHED_FIRST: 1}
    _no_leaks(cluster)


@pytest.mark.parametrize("live_stages", [8, 0], ids=["live-stage-refused", "suspended-refused"])
def test_a_refused_handoff_decodes_on_the_prefill_instance(live_stages: int) -> None:
    # The decode instance (100 blocks) holds a short request that keeps growing; the long
    # prompt's handoff finds no room there and the request decodes where it was prefilled
    # (with no live stage, it is refused after its suspension and resumes there).
    trace = [
        TraceRequest(0, 0.0, 100, 1200, tuple(range(7))),
        TraceRequest(1, 10.0, 800, 30, tuple(range(100, 150))),
    ]
    cluster = _run(
        trace, prefill=1, decode=1, num_blocks=100, stages=StageConfig(max_live_stages=live_stages)
    )
    stats = cluster.handoffs.stats
    assert stats.ok == 0 and stats.fallback == {"dst_refused": 1}
    cols = cluster.metrics.columns()
    assert cols["instance"].tolist() == ["decode-0", "prefill-0"]
    assert cols["output_tokens"].tolist() == [1200, 30]
    _no_leaks(cluster)


def test_a_slower_link_takes_longer_to_hand_off(monkeypatch: pytest.MonkeyPatch) -> None:
    kv = load_latency_model(LATENCY).kv_bytes_per_token or 0.0
    downtimes = {}
    for name in ("nvlink", "rdma100"):
        _RecordingSession.log = []
        monkeypatch.setattr(sim_cluster, "SourceSession", _RecordingSession)
        model = TransferModel(link(name))
        cluster = _run(_trace(1, 800, 40), prefill=1, decode=1, transfer=model)
        (final,) = [a for _, _, a in _RecordingSession.log if isinstance(a, Copy) and a.stage.final]
        (downtime,) = cluster.handoff_stats.downtime_s
        # The stop-and-copy stage is the request's whole downtime: its bytes on this link.
        assert downtime == pytest.approx(model.default.time(final.stage.num_blocks * BS * kv))
        downtimes[name] = downtime
    assert downtimes["rdma100"] > 5 * downtimes["nvlink"]
    assert link("rdma100").bandwidth == 12.5e9 and link("nvlink").bandwidth == 450e9


@pytest.mark.timeout(60)
def test_a_committed_handoff_lets_its_prefill_instance_admit_its_queue() -> None:
    # Two held prompts fill the prefill instance (120 blocks); the rest wait there until the
    # handoffs release their blocks, while the instance runs no step (it holds only suspended
    # requests): the commit must start its next step.
    cluster = _run(_trace(6, 800, 10, gap_s=0.0), prefill=1, decode=3, num_blocks=120)
    stats = cluster.handoffs.stats
    assert stats.ok + stats.num_fallback == stats.expected == 6
    assert len(cluster.metrics.columns()["instance"]) == 6
    _no_leaks(cluster)
