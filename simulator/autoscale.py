"""The autoscaler on the simulated clock: `scheduler.core.autoscale` deciding for a `SimCluster`.

Contract:
- `SimAutoscaler(cluster, settings, interval_s, start_s)`; `tick()` runs every `interval_s`
  while the trace has requests left: the same `FleetLoad` as the proxy's loop (requests in
  flight by the router's ledger, requests waiting in the engines, present = serving plus
  starting instances), the core's decision, then the fleet acts.
- Out: each new instance joins `start_s` after the decision (an engine's cold start), empty.
- In: the victim (`scale_in_victim`: fewest blocks no other instance holds, then fewest in
  flight) is drained at once; it leaves once it runs nothing (a migration policy, when the run
  has one, moves its requests; otherwise they finish there).
- `instance_s` integrates the instances held (serving, starting, draining) over the run;
  `events` keeps each scale event (time, direction, reason, instance, instances after it).
"""

from __future__ import annotations

from typing import Any, Protocol

from scheduler.core.autoscale import (
    Autoscaler,
    AutoscaleSettings,
    Candidate,
    FleetLoad,
    ScaleIn,
    ScaleOut,
    candidates,
    scale_in_victim,
)
from scheduler.core.cluster_state import ClusterState
from simulator.loop import EventLoop


class ScaledFleet(Protocol):
    """What the autoscaler needs of a `simulator.cluster.SimCluster` (no import circle)."""

    instances: dict[str, Any]
    state: ClusterState
    loop: EventLoop

    def add_instance(self, instance_id: str) -> None: ...
    def idle_instance(self, instance_id: str) -> bool: ...
    def remove_instance(self, instance_id: str) -> None: ...
    def has_requests_left(self) -> bool: ...

ScaleEvent = tuple[float, str, str, str, int]  # time, "out"/"in", reason, instance, instances


class SimAutoscaler:
    def __init__(
        self, cluster: ScaledFleet, settings: AutoscaleSettings, interval_s: float, start_s: float
    ) -> None:
        self.cluster = cluster
        self.core = Autoscaler(settings)
        self.interval_s = interval_s
        self.start_s = start_s
        self.starting: set[str] = set()
        self.leaving: set[str] = set()
        self.events: list[ScaleEvent] = []
        self.instance_s = 0.0
        self._counted_at = 0.0
        self._next = len(cluster.instances)

    def held(self) -> int:
        return len(self.cluster.instances) + len(self.starting)

    def _present(self) -> int:
        """Instances serving or starting (not those leaving)."""
        return len(self.cluster.instances) - len(self.leaving) + len(self.starting)

    def _count(self, now: float) -> None:
        self.instance_s += (now - self._counted_at) * self.held()
        self._counted_at = now

    def tick(self) -> bool:
        cluster = self.cluster
        now = cluster.loop.now
        self._count(now)
        for instance_id in sorted(self.leaving):
            if cluster.idle_instance(instance_id):
                self.leaving.discard(instance_id)
                cluster.remove_instance(instance_id)
        serving = [i for i in cluster.instances if i not in self.leaving]
        state = cluster.state
        load = FleetLoad(
            len(serving) + len(self.starting),
            sum(len(state.get(i).inflight) for i in cluster.instances),
            sum(cluster.instances[i].scheduler.num_waiting for i in serving),
            len(self.starting),
        )
        action = self.core.decide(now, load)
        if isinstance(action, ScaleOut):
            for _ in range(action.count):
                instance_id = f"inst-{self._next}"
                self._next += 1
                self.starting.add(instance_id)
                cluster.loop.call_at(now + self.start_s, self._up, instance_id)
                self.events.append((now, "out", action.reason, instance_id, self._present()))
            self.core.changed(now)
        elif isinstance(action, ScaleIn):
            victim = scale_in_victim(self._candidates(serving))
            if victim is not None:
                state.set_draining(victim, True)
                self.leaving.add(victim)
                self.events.append((now, "in", action.reason, victim, self._present()))
                self.core.changed(now)
        return cluster.has_requests_left()

    def _up(self, instance_id: str) -> None:
        self._count(self.cluster.loop.now)
        self.starting.discard(instance_id)
        self.cluster.add_instance(instance_id)

    def _candidates(self, serving: list[str]) -> list[Candidate]:
        state = self.cluster.state
        index = state.prefix_index
        held = {i: index.blocks(i) if i in index else set() for i in serving}
        return candidates(held, {i: len(state.get(i).inflight) for i in serving})
