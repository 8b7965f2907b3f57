"""Router replicas as one, on the proxy's clock: each polls its peers' in-flight charges.

Contract:
- `own_charges(fleet, replica)`: this replica's ``GET /admin/v1/charges`` answer, its own
  accounting only (`scheduler.core.peer_charges` says the shape), never what peers told it.
- `PeerSync(fleet, replica, peers, token, interval_s)`: every `interval_s` (a `PeriodicTask`) it
  asks every peer's admin URL at once, with the admin token the replicas share, feeds what they
  answer to `PeerCharges` (a silent peer ages out after `ttl_s`, default 5 intervals and at least
  1 s) and sets every instance's peer charge in the cluster (instances this replica does not
  know are skipped). A failed or malformed answer is counted
  (``kvherd_peer_sync_failures_total{peer}``) and logged once per run of failures.
- ``kvherd_peer_replicas`` is the number of peers whose charges count now.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import astuple
from typing import TYPE_CHECKING, Any

import httpx
from prometheus_client import Counter, Gauge

from scheduler.core.peer_charges import NO_CHARGE, PeerCharges, parse_charges
from scheduler.periodic import PeriodicTask

if TYPE_CHECKING:
    from scheduler.fleet import Fleet

log = logging.getLogger("kvherd.peers")


def own_charges(fleet: Fleet, replica: str) -> dict[str, Any]:
    charges = {}
    for instance_id in fleet.instances:
        charges[instance_id] = list(astuple(fleet.cluster.get(instance_id).own_charge()))
    return {"replica": replica, "charges": charges}


class PeerSync:
    def __init__(
        self,
        fleet: Fleet,
        replica: str,
        peers: Sequence[str],
        token: str,
        interval_s: float = 0.1,
        ttl_s: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.fleet = fleet
        self.peers = [p.rstrip("/") for p in peers]
        self.clock = clock
        self.core = PeerCharges(replica, ttl_s or max(1.0, 5 * interval_s))
        self._client = httpx.AsyncClient(
            headers={"Authorization": f"Bearer {token}"}, timeout=1.0, trust_env=False
        )
        self._failing: set[str] = set()
        self._task = PeriodicTask("kvherd-peer-sync", self.round, interval_s, log)
        registry = fleet.metrics.registry
        self._failures = Counter(
            "kvherd_peer_sync_failures", "Peer replicas' charges that could not be read",
            ["peer"], registry=registry,
        )  # fmt: skip
        self._fresh = Gauge(
            "kvherd_peer_replicas", "Peer replicas whose in-flight charges count now",
            registry=registry,
        )  # fmt: skip

    def start(self) -> None:
        self._task.start()

    async def stop(self) -> None:
        await self._task.stop()
        await self._client.aclose()

    async def round(self) -> None:
        await asyncio.gather(*(self._ask(peer) for peer in self.peers))
        now = self.clock()
        totals = self.core.totals(now)
        cluster = self.fleet.cluster
        for instance_id in self.fleet.instances:
            cluster.set_peer_charge(instance_id, totals.get(instance_id, NO_CHARGE))
        self._fresh.set(len(self.core.fresh_peers(now)))

    async def _ask(self, peer: str) -> None:
        try:
            response = await self._client.get(f"{peer}/admin/v1/charges")
            response.raise_for_status()
            replica, charges = parse_charges(response.json())
        except (httpx.HTTPError, ValueError) as exc:
            self._failures.labels(peer).inc()
            if peer not in self._failing:
                log.warning("peer replica %s: %r; its charges age out", peer, exc)
                self._failing.add(peer)
            return
        self._failing.discard(peer)
        self.core.update(replica, self.clock(), charges)
