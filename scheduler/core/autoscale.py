"""Autoscaling: how many instances the fleet needs now, and which one to take out.

Contract:
- Pure (explicit `now`, seconds). `Autoscaler.decide(now, load)` takes one control tick's
  `FleetLoad` and returns `ScaleOut(count, reason)`, `ScaleIn(reason)` or None; the driver then
  reports what it did with `changed(now)` (cool-downs count from there).
- Demand is the requests in flight over the fleet (running and waiting), smoothed by an EWMA of
  time constant ``window_s``; the count needed is ``ceil(demand / (slots * target_utilization))``
  within ``[min_instances, max_instances]``. Instances still starting count as present.
- Out, by ``needed - present`` (at most ``max_step``): when needed exceeds present, or when
  requests have queued on the engines (``queued`` > 0) for ``window_s`` while in flight exceeds
  what the present instances take at the target; ``scale_out_cooldown_s`` after any change.
- In, one instance at a time: when needed stayed below present for ``scale_in_delay_s``, with
  no instance still starting, and ``scale_in_cooldown_s`` after any change. Below min or above
  max is corrected at once.
- `scale_in_victim(candidates)`: whose removal loses least: fewest blocks that no other instance
  holds, then fewest requests in flight, then the last in order (the newest); `candidates(held,
  inflight)` builds them from each instance's cached blocks.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class AutoscaleSettings:
    min_instances: int = 1
    max_instances: int = 4
    slots: int = 8  # requests one instance serves at the target (its batch slots)
    target_utilization: float = 0.75
    window_s: float = 2.0
    scale_out_cooldown_s: float = 5.0
    scale_in_delay_s: float = 10.0
    scale_in_cooldown_s: float = 10.0
    max_step: int = 2

    def __post_init__(self) -> None:
        if not 1 <= self.min_instances <= self.max_instances:
            raise ValueError("need 1 <= min_instances <= max_instances")
        if self.slots < 1 or not 0 < self.target_utilization <= 1 or self.max_step < 1:
            raise ValueError("need slots >= 1, 0 < target_utilization <= 1, max_step >= 1")
        if min(self.window_s, self.scale_out_cooldown_s, self.scale_in_cooldown_s) < 0:
            raise ValueError("windows and cool-downs must not be negative")
        if self.scale_in_delay_s < 0:
            raise ValueError("scale_in_delay_s must not be negative")


@dataclass(frozen=True, slots=True)
class FleetLoad:
    present: int  # instances serving or starting (not those being removed)
    inflight: int  # requests in flight over the fleet
    queued: int = 0  # requests the engines report waiting for room
    starting: int = 0  # of `present`, those not serving yet


@dataclass(frozen=True, slots=True)
class ScaleOut:
    count: int
    reason: str  # "load", "queue", "min"


@dataclass(frozen=True, slots=True)
class ScaleIn:
    reason: str  # "load", "max"


@dataclass(frozen=True, slots=True)
class Candidate:
    instance_id: str
    unique_blocks: int  # cached blocks no other instance holds
    inflight: int


class Autoscaler:
    def __init__(self, settings: AutoscaleSettings) -> None:
        self.settings = settings
        self.demand = 0.0
        self.needed = settings.min_instances
        self._last_tick: float | None = None
        self._last_change = -math.inf
        self._below_since: float | None = None  # needed < present since then
        self._queued_since: float | None = None

    def changed(self, now: float) -> None:
        """The driver started or removed instances at `now`."""
        self._last_change = now
        self._below_since = None
        self._queued_since = None

    def decide(self, now: float, load: FleetLoad) -> ScaleOut | ScaleIn | None:
        s = self.settings
        self._smooth(now, load.inflight)
        per_instance = s.slots * s.target_utilization
        self.needed = min(
            s.max_instances, max(s.min_instances, math.ceil(self.demand / per_instance))
        )
        present = load.present
        if present < s.min_instances:
            return ScaleOut(s.min_instances - present, "min")
        if present > s.max_instances:
            return ScaleIn("max")
        pressed = load.queued > 0 and load.inflight > present * per_instance
        if not pressed:
            self._queued_since = None
        elif self._queued_since is None:
            self._queued_since = now
        cooled_out = now - self._last_change >= s.scale_out_cooldown_s
        if self.needed > present and cooled_out:
            return ScaleOut(min(s.max_step, self.needed - present), "load")
        queued_long = self._queued_since is not None and now - self._queued_since >= s.window_s
        if queued_long and present < s.max_instances and cooled_out:
            return ScaleOut(1, "queue")
        if self.needed >= present or load.starting:  # (never in while the fleet is still growing)
            self._below_since = None
            return None
        if self._below_since is None:
            self._below_since = now
        held = now - self._below_since >= s.scale_in_delay_s
        if held and now - self._last_change >= s.scale_in_cooldown_s:
            return ScaleIn("load")
        return None

    def _smooth(self, now: float, inflight: int) -> None:
        if self._last_tick is None or self.settings.window_s == 0:
            self.demand = float(inflight)
        else:
            weight = 1.0 - math.exp(-max(0.0, now - self._last_tick) / self.settings.window_s)
            self.demand += (inflight - self.demand) * weight
        self._last_tick = now


def candidates(
    held: Mapping[str, Collection[int]], inflight: Mapping[str, int]
) -> list[Candidate]:
    """A `Candidate` per instance of `held` (its cached blocks): the blocks no other instance of
    `held` holds, and its requests in flight."""
    holders: Counter[int] = Counter()
    for blocks in held.values():
        holders.update(blocks)
    return [
        Candidate(i, sum(holders[b] == 1 for b in blocks), inflight.get(i, 0))
        for i, blocks in held.items()
    ]


def scale_in_victim(candidates: Sequence[Candidate]) -> str | None:
    """The candidate whose removal loses least (see the module contract); None if there is none."""
    best: tuple[int, int, int] | None = None
    victim: str | None = None
    for order, c in enumerate(candidates):
        key = (c.unique_blocks, c.inflight, -order)
        if best is None or key < best:
            best, victim = key, c.instance_id
    return victim
