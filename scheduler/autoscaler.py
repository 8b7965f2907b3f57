"""The autoscaler on the proxy's clock: `scheduler.core.autoscale` deciding, a launcher acting.

Contract:
- `AutoscaleLoop(fleet, launcher, settings, interval_s)`; `run()` ticks every `interval_s` until
  cancelled: the fleet's load (requests in flight from the router's ledger, requests the engines
  report waiting, present = dispatchable instances plus those launched and not yet registered),
  the core's decision, then the launcher. An instance launched but dead before it registered, or
  not registered after `start_timeout_s`, stops counting as starting (and is stopped).
- Out: `launcher.launch()` per instance; the new instance registers itself (the admin API).
- In: the victim (`scale_in_victim` over the dispatchable instances the launcher started: blocks
  no other instance holds from the prefix index, requests in flight from the ledger) is drained in
  the fleet at once (no new requests), then `launcher.retire(id)`: a kvherd agent given SIGTERM
  migrates its running requests away (the drain policy), deregisters and exits.
- Every event is kept in `events` and counted: ``kvherd_autoscale_instances`` (present),
  ``kvherd_scale_events_total{direction,reason}``, on the proxy's registry.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from prometheus_client import Counter, Gauge

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

if TYPE_CHECKING:
    from scheduler.fleet import Fleet

log = logging.getLogger("kvherd.autoscale")


class Launcher(Protocol):
    def launch(self) -> str:
        """Start one instance; its instance id (it registers itself)."""
        ...

    def alive(self, instance_id: str) -> bool: ...

    async def retire(self, instance_id: str) -> None:
        """Stop it (SIGTERM: it drains), and wait until it has exited."""
        ...


@dataclass(frozen=True, slots=True)
class ScaleEvent:
    at: float  # the fleet clock
    direction: str  # "out" or "in"
    reason: str
    instance_id: str
    instances: int  # present after it


class AutoscaleLoop:
    def __init__(
        self,
        fleet: Fleet,
        launcher: Launcher,
        settings: AutoscaleSettings,
        interval_s: float = 0.5,
        start_timeout_s: float = 300.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.fleet = fleet
        self.launcher = launcher
        self.core = Autoscaler(settings)
        self.interval_s = interval_s
        self.start_timeout_s = start_timeout_s
        self.clock = clock
        self.owned: set[str] = set()  # instances this loop may remove (it or its caller started)
        self._starting: dict[str, float] = {}  # launched, not yet dispatchable -> since
        self._stopping: set[asyncio.Task[None]] = set()
        self.events: list[ScaleEvent] = []
        registry = fleet.metrics.registry
        self._present = Gauge(
            "kvherd_autoscale_instances",
            "Instances serving or starting, as the autoscaler counts them",
            registry=registry,
        )
        self._scaled = Counter(
            "kvherd_scale_events",
            "Instances started or removed by the autoscaler, by direction and reason",
            ["direction", "reason"],
            registry=registry,
        )

    async def run(self) -> None:
        try:
            while True:
                await self.tick()
                await asyncio.sleep(self.interval_s)  # a control period, not a wait for an event
        finally:
            for task in self._stopping:
                task.cancel()

    async def tick(self) -> None:
        now = self.clock()
        fleet = self.fleet
        dispatchable = [
            i
            for i in fleet.instances
            if fleet.cluster.get(i).healthy and not fleet.cluster.get(i).draining
        ]
        for instance_id, since in list(self._starting.items()):
            if instance_id in dispatchable:
                del self._starting[instance_id]
            elif not self.launcher.alive(instance_id) or now - since > self.start_timeout_s:
                log.warning("autoscale: %s did not come up; stopping it", instance_id)
                del self._starting[instance_id]
                self.owned.discard(instance_id)
                self._stop(instance_id)
        present = len(dispatchable) + len(self._starting)
        queued = sum(fleet.cluster.get(i).report.num_waiting or 0 for i in dispatchable)
        load = FleetLoad(present, fleet.inflight.total, queued, len(self._starting))
        self._present.set(present)
        action = self.core.decide(now, load)
        if isinstance(action, ScaleOut):
            for _ in range(action.count):
                instance_id = self.launcher.launch()
                self.owned.add(instance_id)
                self._starting[instance_id] = now
                present += 1
                self._record(now, "out", action.reason, instance_id, present)
            self.core.changed(now)
        elif isinstance(action, ScaleIn):
            victim = scale_in_victim(self._candidates(dispatchable))
            if victim is not None:
                fleet.set_draining(victim, True)
                self.owned.discard(victim)
                self._stop(victim)
                self._record(now, "in", action.reason, victim, present - 1)
                self.core.changed(now)
        self._present.set(present)

    def _candidates(self, dispatchable: list[str]) -> list[Candidate]:
        index = self.fleet.cluster.prefix_index
        held = {i: index.blocks(i) if i in index else set() for i in dispatchable}
        inflight = {i: self.fleet.inflight.count(i) for i in dispatchable}
        # Only those it may remove are candidates; all count as holders.
        return [c for c in candidates(held, inflight) if c.instance_id in self.owned]

    def _stop(self, instance_id: str) -> None:
        task = asyncio.create_task(self.launcher.retire(instance_id))
        self._stopping.add(task)
        task.add_done_callback(self._stopping.discard)

    def _record(self, now: float, direction: str, reason: str, instance_id: str, n: int) -> None:
        log.info("autoscale: %s %s (%s): %d instances", direction, instance_id, reason, n)
        self.events.append(ScaleEvent(now, direction, reason, instance_id, n))
        self._scaled.labels(direction, reason).inc()
