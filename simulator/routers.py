"""Router replicas over one simulated fleet (`kvherd sim --routers N`), as N `kvherd serve` processes.

Contract:
- `RouterReplicas(routers)`: replica i routes with ``routers[i]`` over its own `ClusterState`: its
  own in-flight charges (what it dispatched), and the fleet's load reports and KV events, which
  every replica receives (the live replicas each poll the agents and subscribe to their events).
- Requests reach the replicas in turn (an L4 balancer's round robin); a request's later events
  (`on_first_token`, `on_finish`, `on_migrated`) go to the replica that routed
  it. It duck-types `scheduler.core.router.Router` for those calls.
- `exchange(now)` (``--peer-interval``, `kvherd serve --peer`): each replica reads every other's
  own charges (`InstanceState.own_charge`) into its `scheduler.core.peer_charges.PeerCharges` and
  adds their totals to its view, as one poll of its peers does; without it replicas see each
  other's load only through the reports.
- `StateFanout(states)`: membership and observations (`add_instance`, `remove_instance`,
  `apply_report`, `apply_kv_events`, `set_draining`) reach every replica's state.
- What one process decides for the fleet (admission, the migration planner, the cache-truth check)
  reads the first replica's view, which holds only that replica's own charges.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from typing import Any

from kvherd.kv_events import KVEvent
from scheduler.core.cluster_state import ClusterState
from scheduler.core.load_report import LoadReport
from scheduler.core.peer_charges import NO_CHARGE, PeerCharges
from scheduler.core.router import Routed, Router


class RouterReplicas:
    def __init__(self, routers: Sequence[Router]) -> None:
        if not routers:
            raise ValueError("at least one router")
        self.routers = list(routers)
        self.routed = [0] * len(self.routers)  # requests each replica routed
        self._turn = itertools.cycle(range(len(self.routers)))
        self._of: dict[str, Router] = {}  # request id -> the replica that routed it, until finished
        self._peers = [PeerCharges(str(i), ttl_s=math.inf) for i in range(len(self.routers))]

    def route(self, request_id: str, *args: Any, **kwargs: Any) -> Routed:
        index = next(self._turn)
        router = self.routers[index]
        routed = router.route(request_id, *args, **kwargs)  # NoInstanceError: nothing recorded
        self._of[request_id] = router
        self.routed[index] += 1
        return routed

    def on_first_token(self, request_id: str, now: float) -> None:
        if (router := self._of.get(request_id)) is not None:
            router.on_first_token(request_id, now)

    def on_finish(self, request_id: str, now: float) -> None:
        if (router := self._of.pop(request_id, None)) is not None:
            router.on_finish(request_id, now)

    def on_migrated(self, request_id: str, dst: str, now: float) -> None:
        if (router := self._of.get(request_id)) is not None:
            router.on_migrated(request_id, dst, now)


    def exchange(self, now: float) -> None:
        said = [
            {i: state.own_charge() for i, state in router.cluster.instances.items()}
            for router in self.routers
        ]
        for router, peers in zip(self.routers, self._peers, strict=True):
            for replica, charges in enumerate(said):
                peers.update(str(replica), now, charges)
            totals = peers.totals(now)
            for instance_id in router.cluster.instances:
                router.cluster.set_peer_charge(instance_id, totals.get(instance_id, NO_CHARGE))


class StateFanout:
    def __init__(self, states: Sequence[ClusterState]) -> None:
        self.states = list(states)

    def add_instance(self, instance_id: str, **kwargs: Any) -> None:
        for state in self.states:
            state.add_instance(instance_id, **kwargs)

    def remove_instance(self, instance_id: str) -> None:
        for state in self.states:
            state.remove_instance(instance_id)

    def apply_report(self, instance_id: str, report: LoadReport, now: float, taken_at: float) -> None:
        for state in self.states:
            state.apply_report(instance_id, report, now, taken_at)

    def apply_kv_events(self, instance_id: str, events: Sequence[KVEvent]) -> None:
        for state in self.states:
            state.apply_kv_events(instance_id, events)

    def set_draining(self, instance_id: str, draining: bool) -> None:
        for state in self.states:
            state.set_draining(instance_id, draining)
