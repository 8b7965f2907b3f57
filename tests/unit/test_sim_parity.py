"""Parity of the shared core: the simulated instance schedules exactly the real engine's batches.

The real `LLMEngine` (tiny model, torch) serves a small trace on a virtual clock advanced by each
step's measured wall time; the simulated instance serves the same arrivals with a latency model that
replays those measured step times. Both must plan identical batches step by step: the same requests,
the same chunk sizes from the same computed positions, the same preemptions.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from pathlib import Path

import pytest

from instance_agent.engine.core.request import SamplingParams
from policies import load_dispatch_policy
from simulator.cluster import ClusterConfig, SimCluster
from simulator.instance import InstanceConfig, make_request
from simulator.latency.base import LatencyModel, PrefillChunk
from simulator.synthetic import SyntheticSpec, generate

torch = pytest.importorskip("torch")
from instance_agent.engine.llm_engine import EngineConfig, LLMEngine  # noqa: E402

Batch = tuple[tuple[tuple[str, int, int], ...], tuple[str, ...]]


class _MeasuredSteps(LatencyModel):
    """Replays the step times measured on the real engine, in order."""

    name = "measured"

    def __init__(self, durations: Sequence[float]) -> None:
        self._durations = list(durations)
        self._next = 0

    def step_time(self, prefill: Sequence[PrefillChunk], decode_contexts: Sequence[int]) -> float:
        duration = self._durations[self._next]
        self._next += 1
        return duration


def _record(scheduler: object, into: list[Batch]) -> None:
    schedule = scheduler.schedule  # type: ignore[attr-defined]

    def recording() -> object:
        output = schedule()
        if output.scheduled:
            into.append(
                (
                    tuple(
                        (s.request.request_id, s.num_new_tokens, s.num_computed_before)
                        for s in output.scheduled
                    ),
                    tuple(r.request_id for r in output.preempted),
                )
            )
        return output

    scheduler.schedule = recording  # type: ignore[attr-defined]


def test_simulated_instance_schedules_the_real_engines_batches() -> None:
    trace = generate(
        SyntheticSpec(
            requests=14,
            rate=2000.0,  # a burst: the pool is oversubscribed whatever the step times are
            input_mean=90,
            output_mean=12,
            num_groups=2,
            prefix_tokens=64,
            id_block_size=32,
            max_input=200,
            seed=4,
        )
    )
    engine_config = InstanceConfig(
        num_blocks=24, block_size=16, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=512
    )
    engine = LLMEngine(
        EngineConfig(
            model="tiny",
            block_size=16,
            num_gpu_blocks=engine_config.num_blocks,
            max_num_seqs=engine_config.max_num_seqs,
            max_num_batched_tokens=engine_config.max_num_batched_tokens,
            max_model_len=engine_config.max_model_len,
            device="cpu",
        )
    )
    real: list[Batch] = []
    _record(engine.scheduler, real)
    durations: list[float] = []
    clock, pending = 0.0, list(trace.requests)
    while pending or engine.has_unfinished():
        while pending and pending[0].arrival_s <= clock:
            tr = pending.pop(0)
            req = make_request(tr, trace.block_size, 16, tr.arrival_s)
            params = SamplingParams(max_tokens=tr.output_length, temperature=0.0, ignore_eos=True)
            engine.add_request(
                req.request_id, req.prompt_token_ids, params, arrival_time=tr.arrival_s
            )
        if not engine.has_unfinished():
            clock = pending[0].arrival_s
            continue
        planned = len(real)
        start = time.perf_counter()
        engine.step()
        elapsed = time.perf_counter() - start
        if len(real) > planned:  # a plan that only preempted computes nothing and takes no time
            durations.append(elapsed)
            clock += elapsed
    assert any(preempted for _, preempted in real), "the pool should force a preemption"
    assert len(real) > 2 * len(trace)  # chunked prefills and decodes, not one step per request

    cluster = SimCluster(
        ClusterConfig(num_instances=1, instance=engine_config),
        _MeasuredSteps(durations),
        load_dispatch_policy("round_robin"),
        # Step by step: the recorder sees `schedule` calls, which a decode fast-forward skips
        # (test_sim_fast_forward checks that skipping them changes nothing).
        fast_forward=False,
    )
    simulated: list[Batch] = []
    _record(cluster.instances["inst-0"].scheduler, simulated)
    cluster.run(trace)
    assert len(simulated) == len(real)
    for step, (sim_batch, real_batch) in enumerate(zip(simulated, real, strict=True)):
        assert sim_batch == real_batch, f"step {step} differs"
    assert cluster.metrics.summary()["completed"] == len(trace)


def test_profile_file_drives_the_calibrated_model(tmp_path: Path) -> None:
    """`kvherd profile` and the simulator's calibrated model agree on every measured point."""
    from kvherd.cli import main
    from simulator.latency import load_latency_model

    out = tmp_path / "tiny.json"
    args = ["profile", "--model", "tiny", "--out", str(out), "--max-context", "64"]
    assert main([*args, "--max-batch", "4", "--repeats", "1", "--device", "cpu"]) == 0
    profile = json.loads(out.read_text())
    assert profile["fit"]["num_points"] == len(profile["points"]) > 10
    assert profile["engine"]["block_size"] == 16 and profile["engine"]["num_blocks"] > 0
    model = load_latency_model(f"calibrated:{out}")
    assert model.kv_capacity_tokens == 16 * profile["engine"]["num_blocks"]
    for point in profile["points"]:
        prefill = [tuple(chunk) for chunk in point["prefill"]]
        predicted = model.step_time(prefill, point["decode"])
        assert predicted == pytest.approx(point["predicted_s"], rel=1e-9)
