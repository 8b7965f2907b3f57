"""Admission's steps in one order, for both clocks: the proxy's gate and the simulator drive this.

Contract:
- Pure (explicit `now`), generic over what waits (the proxy's futures, the simulator's requests);
  it holds the expected-wait rule, the admission queue and the tenants' shares, and reads the
  fleet's in-flight ledger (`scheduler.core.inflight`, kept by its driver).
- `decide(now, queued, free, tenant, priority, instances)`: ``queued`` and ``free`` as
  `scheduler.core.admission.fleet_queue` gives them. Observes the fleet, then admits (`Admitted`:
  ``startable`` when it takes a free slot at once) a tenant within its share or one the rule lets
  in, else returns the rule's `Refusal`. Every admitted request is `finished` exactly once.
- `may_start(tenant, instances)`: a free in-flight slot is this tenant's to take (fair share);
  `join` / `wake` / `leave` / `expire` / `deadline`: the queue's, for requests no instance takes.
- `retry_after(now, queued)`: whole seconds until the queue ahead should have drained, in
  ``[1, max_retry_after_s]``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

from scheduler.core.admission import Admission, AdmissionSettings, Refusal
from scheduler.core.admission_queue import AdmissionQueue, QueueSettings
from scheduler.core.fair_share import TenantShares
from scheduler.core.inflight import InflightLedger

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Admitted:
    startable: bool  # it takes a free batch slot at once


class AdmissionControl(Generic[T]):
    def __init__(
        self,
        settings: AdmissionSettings,
        queue: QueueSettings,
        ledger: InflightLedger,
        weight: Callable[[str | None], float] | None = None,
    ) -> None:
        self.rule = Admission(settings)
        self.queue: AdmissionQueue[T] = AdmissionQueue(queue, weight)
        self.shares = TenantShares(weight)
        self.ledger = ledger

    def observe(self, now: float, queued: int) -> int:
        """Report the fleet to the rule; the requests waiting to start (queue and engines)."""
        ahead = len(self.queue) + queued
        self.rule.observe(now, self.ledger.completed, ahead)
        return ahead

    def may_start(self, tenant: str | None, instances: int) -> bool:
        slots = self.ledger.cap * instances
        return self.shares.may_start(tenant, slots - self.ledger.total, slots)

    def decide(
        self,
        now: float,
        queued: int,
        free: float,
        tenant: str | None,
        priority: int,
        instances: int,
    ) -> Admitted | Refusal:
        self.observe(now, queued)
        startable = free > 0 and self.may_start(tenant, instances)
        ahead = self.queue.ahead(tenant, priority) + queued
        if not self.shares.within_share(tenant):
            refused = self.rule.refusal(ahead, startable)
            if refused is not None:
                return refused
        self.shares.admitted(tenant)
        return Admitted(startable)

    def finished(self, tenant: str | None) -> None:
        """A request `decide` admitted has ended (served, refused later or failed)."""
        self.shares.finished(tenant)

    def join(
        self, now: float, item: T, tenant: str | None, priority: int, since: float | None = None
    ) -> bool:
        return self.queue.join(now, item, tenant, priority, since)

    def wake(self, now: float) -> T | None:
        return self.queue.wake(now)

    def leave(self, item: T) -> None:
        self.queue.leave(item)

    def expire(self, now: float) -> list[T]:
        return self.queue.expire(now)

    def deadline(self, item: T) -> float:
        return self.queue.deadline(item)

    def capacity_lost(self, now: float) -> None:
        self.rule.capacity_lost(now)

    def retry_after(self, now: float, queued: int) -> int:
        wait = self.rule.expected_wait(self.observe(now, queued))
        cap = self.rule.settings.max_retry_after_s
        if wait is None or wait < 1:
            return 1
        return cap if wait >= cap else int(wait) + 1
