"""Capacity planning: the fewest instances each fleet configuration needs to meet the SLOs.

Contract: `search(configs, lo, hi, evaluate, parallel)` finds, per `FleetConfig`, the least count
in [lo, hi] whose run meets the SLOs, assuming (as Vidur's configuration search does) that meeting
them is monotone in the count. Each configuration is a binary search on (largest count known to
fail, least known to pass): about log2(hi - lo + 2) runs each, not a grid. Rounds: one `evaluate`
call gets every open configuration's next probes (evenly spaced, `parallel // open` each, at least
one) and returns an `Outcome` per probe; no probe runs twice. Should a larger count fail where a
smaller passed (possible only with several probes a round), the least passing count stands and the
point says `monotone=False`. Cheapest: the least count (instances are the cost), then the smaller
CPU tier, then the configurations' order. The answer depends only on the arguments and outcomes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class FleetConfig:
    """Everything about a fleet but its size."""

    policy: str
    cpu_tokens: int = 0  # host-DRAM KV tier per instance, in tokens (0: none)
    block_size: int = 16

    @property
    def label(self) -> str:
        tier = f", cpu {self.cpu_tokens:,} tok" if self.cpu_tokens else ""
        return f"{self.policy}, block {self.block_size}{tier}"


@dataclass(frozen=True, slots=True)
class Probe:
    config: FleetConfig
    instances: int


@dataclass(frozen=True, slots=True)
class Outcome:
    met: bool
    values: dict[str, float]  # each SLO's value (`simulator.slo.measure`)
    wall_s: float = field(default=0.0, compare=False)  # the run's own time, for reports only


@dataclass(slots=True)
class FrontierPoint:
    config: FleetConfig
    instances: int | None  # least count meeting the SLOs; None: none in [lo, hi]
    outcome: Outcome | None  # at `instances`
    below: Outcome | None  # at `instances - 1` (None when that is below lo, or none passed)
    monotone: bool = True  # False: a larger count failed where this one passed


@dataclass(slots=True)
class Plan:
    frontier: list[FrontierPoint]
    probes: dict[Probe, Outcome] = field(default_factory=dict)  # every run, in run order

    @property
    def best(self) -> FrontierPoint | None:
        feasible = [p for p in self.frontier if p.instances is not None]
        if not feasible:
            return None
        return min(feasible, key=lambda p: (p.instances, p.config.cpu_tokens))


Evaluate = Callable[[Sequence[Probe]], Sequence[Outcome]]


def _probe_counts(failing: int, passing: int, width: int) -> list[int]:
    """Up to `width` counts evenly spaced strictly between a failing and a passing count."""
    gap = passing - failing
    return sorted({failing + (j * gap) // (width + 1) for j in range(1, width + 1)} - {failing})


def _bounds(met: dict[int, bool], lo: int, hi: int) -> tuple[int, int]:
    """(largest count known to fail below the least known to pass, that least passing count);
    lo - 1 and hi + 1 stand for "none yet"."""
    ok = min((count for count, passed in met.items() if passed), default=hi + 1)
    fail = max(
        (count for count, passed in met.items() if not passed and count < ok), default=lo - 1
    )
    return fail, ok


def search(
    configs: Sequence[FleetConfig], lo: int, hi: int, evaluate: Evaluate, parallel: int = 1
) -> Plan:
    if not 1 <= lo <= hi:
        raise ValueError(f"instance counts must satisfy 1 <= lo <= hi, got {lo}..{hi}")
    if parallel < 1:
        raise ValueError("parallel must be at least 1")
    configs = list(dict.fromkeys(configs))
    plan = Plan(frontier=[])
    results: dict[FleetConfig, dict[int, bool]] = {config: {} for config in configs}
    while True:
        bounds = {config: _bounds(met, lo, hi) for config, met in results.items()}
        open_configs = [c for c, (fail, ok) in bounds.items() if ok - fail > 1]
        if not open_configs:
            break
        per_config = max(1, parallel // len(open_configs))
        probes = [
            Probe(config, count)
            for config in open_configs
            for count in _probe_counts(*bounds[config], per_config)
        ]
        for probe, outcome in zip(probes, evaluate(probes), strict=True):
            plan.probes[probe] = outcome
            results[probe.config][probe.instances] = outcome.met
    for config, (fail, ok) in bounds.items():
        found = ok <= hi
        plan.frontier.append(
            FrontierPoint(
                config,
                ok if found else None,
                plan.probes[Probe(config, ok)] if found else None,
                plan.probes.get(Probe(config, fail)) if found else None,
                monotone=all(met or count < ok for count, met in results[config].items()),
            )
        )
    return plan
