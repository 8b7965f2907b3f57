"""Migration loop: asks the migration policy for orders each tick and tracks those in flight.

Contract:
- `tick(cluster, now)` runs at most once per `interval_s` of the caller's clock (earlier calls
  return []): it expires orders older than `order_timeout_s`, asks the policy for a plan, drops
  orders that cannot be right now — the request is already migrating, source or destination is not
  registered or not healthy, the destination is draining or does not decode (a prefill-only
  instance of a P/D fleet never takes a running request), source == destination, the request is
  not running on the source as far as the view shows, or a limit would be exceeded
  (`max_in_flight` overall, `max_per_instance` per source and per destination) — and hands each
  accepted order to the `execute` callback supplied by the server or the simulator. It returns
  the accepted orders.
- The executor reports back with `on_done(request_id, ok, now)`; until then the request and its
  instances count as busy. A timed-out order is forgotten (counted in `stats`), so a lost reply
  cannot block migrations forever.
- Pure: no clock, no I/O, no threads; `execute` must not block (it starts the migration).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from policies.base import MigrationPolicy
from policies.views import ClusterView, MigrationOrder


@dataclass(frozen=True, slots=True)
class InFlightMigration:
    order: MigrationOrder
    started: float


@dataclass(slots=True)
class MigrationStats:
    issued: int = 0
    succeeded: int = 0
    failed: int = 0
    timed_out: int = 0
    rejected: int = 0  # orders the policy proposed that the loop dropped


class MigrationLoop:
    def __init__(
        self,
        policy: MigrationPolicy,
        execute: Callable[[MigrationOrder], None],
        interval_s: float = 1.0,
        max_in_flight: int = 4,
        max_per_instance: int = 1,
        order_timeout_s: float = 60.0,
    ) -> None:
        if interval_s < 0 or max_in_flight < 1 or max_per_instance < 1 or order_timeout_s <= 0:
            raise ValueError("invalid migration loop limits")
        self.policy = policy
        self.execute = execute
        self.interval_s = interval_s
        self.max_in_flight = max_in_flight
        self.max_per_instance = max_per_instance
        self.order_timeout_s = order_timeout_s
        self.in_flight: dict[str, InFlightMigration] = {}
        self.stats = MigrationStats()
        self._last_tick = float("-inf")

    def set_policy(self, policy: MigrationPolicy) -> None:
        self.policy = policy

    def _busy(self) -> dict[str, int]:
        """Migrations per instance, as source or destination."""
        count: dict[str, int] = {}
        for flight in self.in_flight.values():
            for instance_id in (flight.order.src, flight.order.dst):
                count[instance_id] = count.get(instance_id, 0) + 1
        return count

    def _acceptable(
        self, order: MigrationOrder, cluster: ClusterView, busy: dict[str, int]
    ) -> bool:
        if order.request_id in self.in_flight or order.src == order.dst:
            return False
        if order.src not in cluster or order.dst not in cluster:
            return False
        src, dst = cluster[order.src], cluster[order.dst]
        if not src.healthy or not dst.dispatchable or not dst.decodes:
            return False
        if src.running and all(r.request_id != order.request_id for r in src.running):
            return False
        return (
            busy.get(order.src, 0) < self.max_per_instance
            and busy.get(order.dst, 0) < self.max_per_instance
        )

    def tick(self, cluster: ClusterView, now: float) -> list[MigrationOrder]:
        if now - self._last_tick < self.interval_s:
            return []
        self._last_tick = now
        for request_id, flight in list(self.in_flight.items()):
            if now - flight.started > self.order_timeout_s:
                del self.in_flight[request_id]
                self.stats.timed_out += 1
        accepted: list[MigrationOrder] = []
        busy = self._busy()
        for order in self.policy.plan(cluster):
            if len(self.in_flight) >= self.max_in_flight or not self._acceptable(
                order, cluster, busy
            ):
                self.stats.rejected += 1
                continue
            self.in_flight[order.request_id] = InFlightMigration(order, now)
            busy[order.src] = busy.get(order.src, 0) + 1
            busy[order.dst] = busy.get(order.dst, 0) + 1
            self.stats.issued += 1
            accepted.append(order)
            self.execute(order)
        return accepted

    def on_done(self, request_id: str, ok: bool, now: float) -> MigrationOrder | None:
        """The executor finished (or gave up on) an order; returns it, or None if unknown."""
        flight = self.in_flight.pop(request_id, None)
        if flight is None:
            return None
        if ok:
            self.stats.succeeded += 1
        else:
            self.stats.failed += 1
        return flight.order
