"""P/D disaggregation in the simulator: production's pairing, the agents' migration session for the
handoff opened at admission (stage 0 reserving the prompt's blocks on the decode instance, live
stages while a chunked prefill computes, one stop-and-copy stage out of a prefill-only instance,
live stages out of a mixed one), the request never decoding on a prefill instance, concurrent
handoffs, the same tokens as colocated serving, no leaked blocks or reservations, conditional
disaggregation, refused handoffs and the link's bandwidth."""

from __future__ import annotations

import re
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
    Wait,
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


Log = list[tuple[str, object, SourceAction]]


class _RecordingSession(SourceSession):
    """The agents' source session, keeping every input it got and action it returned (all
    sessions in `log`, each request's in `logs`)."""

    log: ClassVar[Log] = []
    logs: ClassVar[dict[str, Log]] = {}
    in_flight: ClassVar[int] = 0
    most_in_flight: ClassVar[int] = 0

    def __init__(
        self,
        request_id: str,
        block_size: int,
        config: StageConfig | None = None,
        prefill_tokens: int = 0,
    ) -> None:
        super().__init__(request_id, block_size, config, prefill_tokens)
        cls = type(self)
        cls.in_flight += 1
        cls.most_in_flight = max(cls.most_in_flight, cls.in_flight)

    def _note(self, event: str, given: object, action: SourceAction) -> SourceAction:
        self.log.append((event, given, action))
        self.logs.setdefault(self.request_id, []).append((event, given, action))
        if isinstance(action, Done | Abort):
            type(self).in_flight -= 1
        return action

    def start(self) -> SourceAction:
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


def _record(monkeypatch: pytest.MonkeyPatch) -> None:
    _RecordingSession.log = []
    _RecordingSession.logs = {}
    _RecordingSession.in_flight = _RecordingSession.most_in_flight = 0
    monkeypatch.setattr(sim_cluster, "SourceSession", _RecordingSession)


def _replay(log: Log, request_id: str, role: str, prefill_tokens: int) -> list[SourceAction]:
    """Feed a fresh session the same events, as `migration.source.migrate_out` feeds them (with
    the stages `instance_agent.pd_handoff` picks for a source of `role`, opened at admission
    for a prompt of `prefill_tokens`, as `PrefillOpening` opens it)."""
    session = SourceSession(request_id, BS, handoff_stages(role, StageConfig()), prefill_tokens)
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


def test_a_prefill_instance_reserves_at_admission_and_hands_off_in_one_stop_and_copy_stage(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _record(monkeypatch)
    cluster = _run(_trace(1, 800, 40), prefill=1, decode=1)
    assert cluster.handoffs.stats.ok == 1 and cluster.handoffs.stats.expected == 1
    log = _RecordingSession.log
    actions = [action for _, _, action in log]
    # Stage 0 at admission reserves the whole prompt and copies nothing (hashes offered:
    # cache-aware); the prompt is one chunk, so the next look finds it held at its first token:
    # no live stage, no Suspend, one stop-and-copy stage carries every block.
    kinds = [type(a) for a in actions]
    assert kinds == [Reserve, Copy, Snapshot, Reserve, Copy, Commit, Release, Done]
    opening, only = actions[0], actions[3]
    assert isinstance(opening, Reserve) and isinstance(only, Reserve)
    assert opening.stage.index == 0 and opening.stage.num_blocks == 0
    assert opening.stage.expected_blocks == len(opening.stage.block_hashes) == 800 // BS
    assert only.stage.index == 1 and only.stage.final and only.stage.num_blocks == 800 // BS
    first_snapshot = log[3][1]
    assert isinstance(first_snapshot, RequestSnapshot) and first_snapshot.phase == "suspended"
    assert first_snapshot.num_kv_tokens == 800  # the first token's KV is not computed yet
    assert _replay(log, "0", "prefill", 800) == actions
    stats = cluster.handoff_stats
    kv = load_latency_model(LATENCY).kv_bytes_per_token or 0.0
    assert stats.bytes_sent == pytest.approx(only.stage.num_blocks * BS * kv)
    _no_leaks(cluster)


def test_a_mixed_instance_hands_off_with_live_stages(monkeypatch: pytest.MonkeyPatch) -> None:
    _record(monkeypatch)
    cluster = _run(_trace(1, 800, 40), mixed=1, decode=1)
    assert cluster.handoffs.stats.ok == 1 and cluster.handoffs.stats.expected == 1
    assert cluster.metrics.columns()["instance"].tolist() == ["decode-0"]
    log = _RecordingSession.log
    actions = [action for _, _, action in log]
    # Llumnix's stages as the agents run them: stage 0 at admission (hashes offered:
    # cache-aware), a live stage of the prompt's full blocks, the suspension with a second look,
    # the stop-and-copy stage, commit.
    kinds = [type(a) for a in actions]
    assert kinds == [
        Reserve,
        Copy,
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
    opening, live, final = actions[0], actions[3], actions[8]
    assert isinstance(opening, Reserve) and isinstance(live, Reserve)
    assert isinstance(final, Reserve)
    assert opening.stage.num_blocks == 0 and len(opening.stage.block_hashes) == 800 // BS
    assert live.stage.index == 1 and not live.stage.final and live.stage.num_blocks == 800 // BS
    assert final.stage.final and 1 <= final.stage.num_blocks <= 4
    first_snapshot = log[3][1]
    assert isinstance(first_snapshot, RequestSnapshot) and first_snapshot.phase == "decoding"
    # The same events give the same actions from a plain session: nothing simulator-specific.
    assert _replay(log, "0", "mixed", 800) == actions
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
    _record(monkeypatch)
    # Eight prompts admitted together: four handoffs open at once, the others wait for a turn.
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
    # prompt's handoff finds no room there for its reservation at admission, and the request
    # decodes where it is prefilled (no longer held at its first token), whatever its stages.
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
        _record(monkeypatch)
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


_LETTERS = {Reserve: "R", Copy: "C", Snapshot: "S", Wait: "W", Commit: "M", Release: "L", Done: "D"}


def test_a_chunked_prefill_moves_while_it_computes(monkeypatch: pytest.MonkeyPatch) -> None:
    """The agents' handoff of a chunked prefill (`test_migration_prefill_stages`), in the
    simulator: stage 0 at admission reserves the whole prompt on the decode instance, a live
    stage follows each chunk that filled blocks (`Wait` while none did: the second prompt waits
    behind the first's chunks), the stop-and-copy at the first token sends only the last chunk's
    blocks, and the reserved-ahead blocks stay held there until the commit adopts them."""
    _record(monkeypatch)
    chunks: dict[str, list[int]] = {}  # request -> tokens computed before each of its chunks
    held: list[tuple[str, int, int, int]] = []  # at each landing: (request, held, ahead, sent)

    def watch(cluster: SimCluster) -> None:
        scheduler = cluster.instances["prefill-0"].scheduler
        schedule = scheduler.schedule

        def scheduled() -> SchedulerOutput:
            out = schedule()
            for s in out.scheduled:
                chunks.setdefault(s.request.request_id, []).append(s.num_computed_before)
            return out

        scheduler.schedule = scheduled  # type: ignore[method-assign]

    landed = SimCluster._stage_landed

    def record(self: SimCluster, m: sim_cluster._Migration) -> None:
        dst = self.instances["decode-0"].block_manager
        num_held, num_ahead = len(dst.block_ids(m.owner)), len(m.ahead.blocks)
        landed(self, m)
        planner = m.session.planner  # the stage counts as sent once landed
        sent = planner.blocks_sent + planner.num_shared_blocks
        held.append((m.session.request_id, num_held, num_ahead, sent))

    monkeypatch.setattr(SimCluster, "_stage_landed", record)
    config = InstanceConfig(num_blocks=4000, block_size=BS, max_num_batched_tokens=256)
    cluster = _run(
        _trace(2, 800, 20, gap_s=0.0), prefill=1, decode=1, prepare=watch, instance=config
    )
    assert cluster.handoffs.stats.ok == 2 and cluster.handoffs.stats.expected == 2
    blocks = 800 // BS
    for rid, log in _RecordingSession.logs.items():
        actions = [a for _, _, a in log]
        letters = "".join(_LETTERS[type(a)] for a in actions)
        # Stage 0, then live stages between waits (after a `Wait` the driver looks again, which
        # the session answers), then the stop-and-copy, commit, release.
        assert re.fullmatch(r"RCSW*(RCSW*)+RCMLD", letters), (rid, letters)
        reserves = [a for a in actions if isinstance(a, Reserve)]
        opening, *live, final = (r.stage for r in reserves)
        assert opening.index == 0 and opening.num_blocks == 0
        assert opening.expected_blocks == len(opening.block_hashes) == blocks
        assert live and not any(s.final for s in live) and final.final
        # Every live stage copies blocks a prefill chunk computed, before the first token.
        looks = [given for event, given, a in log if event == "snapshot" and isinstance(a, Reserve)]
        phases = [s.phase for s in looks if isinstance(s, RequestSnapshot)]
        assert phases == ["waiting"] + ["prefilling"] * len(live) + ["suspended"], phases
        # The stop-and-copy sends only the last chunk's blocks.
        last = chunks[rid][-1]
        assert final.first_block == last // BS and final.num_blocks == blocks - last // BS
        assert sum(s.num_blocks for s in (opening, *live, final)) == blocks
        assert _replay(log, rid, "prefill", 800) == actions
    # The second prompt waited behind the first one's chunks: its session waited meanwhile.
    assert "W" in "".join(_LETTERS[type(a)] for _, _, a in _RecordingSession.logs["trace-1"])
    # The decode instance holds the whole prompt's blocks from stage 0 on: those landed or in
    # flight, and the rest reserved ahead for later stages.
    assert held and all(n == blocks and ahead == blocks - sent for _, n, ahead, sent in held), held
    _no_leaks(cluster)
