"""One load report: the agent's snapshot (JSON, parsed by the scheduler) and the simulator agree."""

from __future__ import annotations

import json
import random
from dataclasses import fields

from instance_agent.engine.core.load import engine_load
from instance_agent.engine.core.request import Request, SamplingParams
from instance_agent.state import StepLatencyWindow, snapshot
from policies import load_dispatch_policy
from scheduler.core.load_report import LoadReport, parse_agent_state
from simulator.cluster import ClusterConfig, SimCluster, load_report
from simulator.instance import InstanceConfig, SimInstance
from simulator.latency import load_latency_model

BLOCK = 16


def _instance(num_blocks: int = 400, budget: int = 1024, max_seqs: int = 8) -> SimInstance:
    config = ClusterConfig(
        num_instances=1,
        instance=InstanceConfig(
            num_blocks=num_blocks,
            block_size=BLOCK,
            max_num_seqs=max_seqs,
            max_num_batched_tokens=budget,
            watermark=0.0,
        ),
    )
    cluster = SimCluster(
        config,
        load_latency_model("roofline:llama-2-7b:a100-80gb"),
        load_dispatch_policy("round_robin"),
    )
    return cluster.instances["inst-0"]


# What the agent reports beyond its engine's state (its event stream, its configured role).
_AGENT_ONLY = {"last_kv_event_seq", "role", "tiers"}  # tiers: shown by the admin API only


def _engine_fields(report: LoadReport) -> dict[str, object]:
    return {f.name: getattr(report, f.name) for f in fields(report) if f.name not in _AGENT_ONLY}


def _agent_report(inst: SimInstance) -> dict[str, object]:
    state = snapshot(
        inst.scheduler,
        inst.block_manager,
        instance_id="inst-0",
        model="m",
        draining=False,
        step_latency=StepLatencyWindow(),
        last_kv_event_seq=-1,
    )
    return _engine_fields(parse_agent_state(json.loads(json.dumps(state))))


def _step(inst: SimInstance, rng: random.Random) -> None:
    scheduler = inst.scheduler
    output = scheduler.schedule()
    sampled = {
        s.request.request_id: rng.randrange(1000, 2000) for s in output.scheduled if s.samples
    }
    scheduler.update_from_output(output, sampled)


def _request(rid: str, tokens: list[int], max_tokens: int = 4) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=max_tokens, ignore_eos=True), BLOCK)


def test_chunked_prefill_in_progress_counts_as_queued_prefill() -> None:
    """The issue's state: a 2,000-token prompt halfway through chunked prefill + two waiting."""
    inst = _instance()
    inst.add_request(_request("long", list(range(2000))))
    _step(inst, random.Random(0))  # 1,024 of the 2,000 prompt tokens computed
    inst.add_request(_request("a", [7] * 300))
    inst.add_request(_request("b", [9] * 300))
    assert inst.scheduler.running[0].num_computed_tokens == 1024
    simulated = load_report(inst, with_running=True)
    assert _engine_fields(simulated) == _agent_report(inst)
    assert simulated.waiting_prefill_tokens == (2000 - 1024) + 300 + 300
    assert simulated.head_waiting_blocks == -(-300 // BLOCK)
    assert engine_load(inst.scheduler, inst.block_manager).waiting_prefill_tokens == 1576


def test_decoding_requests_add_no_queued_prefill() -> None:
    inst = _instance()
    inst.add_request(_request("r", list(range(100)), max_tokens=8))
    rng = random.Random(1)
    _step(inst, rng)
    _step(inst, rng)
    report = load_report(inst, with_running=True)
    assert _engine_fields(report) == _agent_report(inst)
    assert report.num_running == 1 and report.waiting_prefill_tokens == 0


def test_reports_agree_at_every_step_of_a_busy_engine() -> None:
    """Shared prefixes, chunked prefill, a full queue and preemption (a small pool)."""
    rng = random.Random(7)
    inst = _instance(num_blocks=120, budget=256, max_seqs=6)
    prefixes = [[rng.randrange(100, 900) for _ in range(64)] for _ in range(3)]
    states_seen = {"chunked": 0, "waiting": 0}
    for step in range(300):
        if step % 3 == 0 and step < 150:
            tail = [rng.randrange(100, 900) for _ in range(rng.randrange(20, 400))]
            inst.add_request(
                _request(f"r{step}", rng.choice(prefixes) + tail, max_tokens=rng.randrange(2, 40))
            )
        assert _engine_fields(load_report(inst, with_running=True)) == _agent_report(inst), step
        scheduler = inst.scheduler
        states_seen["chunked"] += any(r.is_prefill for r in scheduler.running)
        states_seen["waiting"] += bool(scheduler.waiting)
        _step(inst, rng)
    assert inst.scheduler.num_preemptions > 0
    assert states_seen["chunked"] > 0 and states_seen["waiting"] > 0
