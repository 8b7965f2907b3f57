"""A capacity plan's probes run as simulations on any `concurrent.futures.Executor`.

Contract: `simulate(job)` runs one `Probe` (a fleet configuration at a count) through
`experiment.run_policy` and returns its `Outcome` against the job's SLOs; it is a pure function
of the job (the simulator is deterministic for a seed), so any executor, a local process pool or
Ray (`simulator.ray_executor`), and any retry of a lost task, give the same outcome. The base
`SimSettings` fix everything a probe does not: its KV capacity per instance in tokens is the base's
`num_blocks * block_size`, re-cut into the probe's block size, and its CPU tier is the probe's
tokens in those blocks. `evaluator(executor, ...)` is `plan.search`'s `evaluate`: one task per
probe, the outcomes in probe order.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from concurrent.futures import Executor
from dataclasses import dataclass

from simulator.experiment import SimSettings, run_policy
from simulator.plan import Evaluate, Outcome, Probe
from simulator.slo import RequestTargets, Slo, measure
from simulator.traces import Trace


@dataclass(frozen=True, slots=True)
class Job:
    trace: Trace
    base: SimSettings
    slos: tuple[Slo, ...]
    targets: RequestTargets
    probe: Probe


def probe_settings(base: SimSettings, targets: RequestTargets, probe: Probe) -> SimSettings:
    config = probe.config
    kv_tokens = base.instance.num_blocks * base.instance.block_size
    instance = dataclasses.replace(
        base.instance,
        block_size=config.block_size,
        num_blocks=kv_tokens // config.block_size,
        num_cpu_blocks=config.cpu_tokens // config.block_size,
    )
    return dataclasses.replace(
        base,
        num_instances=probe.instances,
        instance=instance,
        slo_ttft_ms=None if targets.ttft_s is None else targets.ttft_s * 1000.0,
        slo_tpot_ms=None if targets.tpot_s is None else targets.tpot_s * 1000.0,
    )


def simulate(job: Job) -> Outcome:
    settings = probe_settings(job.base, job.targets, job.probe)
    result = run_policy(job.trace, settings, job.probe.config.policy)
    values = measure(job.slos, result.columns, result.summary)
    served = result.summary["completed"] == len(job.trace)
    met = served and all(slo.met(values[slo.metric]) for slo in job.slos)
    return Outcome(met, values, result.wall_s)


def evaluator(
    executor: Executor,
    trace: Trace,
    base: SimSettings,
    slos: Sequence[Slo],
    targets: RequestTargets,
) -> Evaluate:
    def evaluate(probes: Sequence[Probe]) -> list[Outcome]:
        futures = [
            executor.submit(simulate, Job(trace, base, tuple(slos), targets, probe))
            for probe in probes
        ]
        return [future.result() for future in futures]

    return evaluate
