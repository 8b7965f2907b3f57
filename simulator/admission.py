"""The proxy's admission on the simulator's clock: the same core objects, their refusals counted.

Contract:
- `SimAdmission` drives `scheduler.core.admission_control.AdmissionControl` (expected wait, queue,
  fair share) over its own `InflightLedger`, as `scheduler.proxy.admission_gate` does on the
  proxy's clock: `check(now, views, request_id, tenant, priority, tokens)` at every arrival (the 429
  code, ``queue_wait``, or None to admit; the wait ahead by class and fair share, weights from
  `tenant_weights`; first the tenant's `tenant_limits`, `scheduler.core.rate_limit`:
  ``rate_limit_requests`` / ``rate_limit_tokens``, `tokens` its prompt and output, known here so
  never corrected; `ended(request_id)` once an admitted request is done); routing skips the
  `saturated` instances; a request no unsaturated instance can take joins the queue (`wait`:
  False when it is full, ``queue_full``), leaves it when capacity frees (`freed(now)`, the next)
  or at its deadline (`expire(now)`: ``queue_timeout``); `dispatched` / `released` / `moved`
  keep the ledger, whose completions the rule measures the service rate by.
- Unlike the proxy it reads the views at every arrival (no reuse window): a simulation's
  decisions are exact, and the proxy's 20 ms reuse only saves CPU.
- `stats`: refusals by code (and by tenant), requests queued, their admission-queue waits (s).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from policies.views import InstanceView
from scheduler.core.admission import AdmissionSettings, Refusal, fleet_queue
from scheduler.core.admission_control import AdmissionControl
from scheduler.core.admission_queue import QueueSettings
from scheduler.core.inflight import InflightLedger
from scheduler.core.rate_limit import RateLimiter, RateLimits

T = TypeVar("T")


@dataclass(slots=True)
class AdmissionStats:
    refused: dict[str, int] = field(default_factory=dict)  # by code: queue_wait, queue_full, ...
    refused_by_tenant: dict[str | None, int] = field(default_factory=dict)
    queued: int = 0
    queue_waits_s: list[float] = field(default_factory=list)

    def refuse(self, code: str, tenant: str | None = None) -> None:
        self.refused[code] = self.refused.get(code, 0) + 1
        self.refused_by_tenant[tenant] = self.refused_by_tenant.get(tenant, 0) + 1


class SimAdmission(Generic[T]):
    def __init__(
        self,
        settings: AdmissionSettings,
        queue: QueueSettings,
        max_inflight_per_instance: int,
        tenant_weights: Mapping[str, float] | None = None,
        tenant_limits: Mapping[str, RateLimits] | None = None,
    ) -> None:
        weights = dict(tenant_weights or {})

        def weight(tenant: str | None) -> float:
            return 1.0 if tenant is None else weights.get(tenant, 1.0)

        self.ledger = InflightLedger(max_inflight_per_instance)
        self.control: AdmissionControl[T] = AdmissionControl(settings, queue, self.ledger, weight)
        self.limiter = RateLimiter()
        for name, limits in (tenant_limits or {}).items():
            self.limiter.set_limits(0.0, name, limits)
        self._tenant_of: dict[str, str | None] = {}  # admitted requests, until `ended`
        self.stats = AdmissionStats()
        self._joined: dict[T, tuple[float, str | None]] = {}  # when, and whose

    @property
    def saturated(self) -> set[str]:
        return self.ledger.saturated

    def check(
        self,
        now: float,
        views: Iterable[InstanceView],
        request_id: str,
        tenant: str | None = None,
        priority: int = 0,
        tokens: int = 0,
    ) -> str | None:
        limited = self.limiter.limits(tenant) is not None
        if limited:
            assert tenant is not None
            exceeded = self.limiter.admit(now, tenant)
            if exceeded is None:
                exceeded = self.limiter.reserve(now, tenant, tokens)
                if exceeded is not None:
                    self.limiter.give_back(now, tenant, True, 0)
            if exceeded is not None:
                code = f"rate_limit_{exceeded.kind}"
                self.stats.refuse(code, tenant)
                return code
        views = list(views)
        queued, free = fleet_queue(views, self.ledger.saturated)
        decision = self.control.decide(now, queued, free, tenant, priority, len(views))
        if not isinstance(decision, Refusal):
            self._tenant_of[request_id] = tenant
            return None
        if limited:
            assert tenant is not None
            self.limiter.give_back(now, tenant, True, tokens)
        self.stats.refuse("queue_wait", tenant)
        return "queue_wait"

    def wait(self, now: float, item: T, tenant: str | None = None, priority: int = 0) -> bool:
        if not self.control.join(now, item, tenant, priority):
            self.stats.refuse("queue_full", tenant)
            return False
        self._joined[item] = (now, tenant)
        self.stats.queued += 1
        return True

    def deadline(self, item: T) -> float:
        return self.control.deadline(item)

    def freed(self, now: float) -> T | None:
        """The next to go (`AdmissionQueue.wake`), when a request finished and its room came free."""
        item = self.control.wake(now)
        if item is not None:
            self.stats.queue_waits_s.append(now - self._joined.pop(item)[0])
        return item

    def expire(self, now: float) -> list[T]:
        gone = self.control.expire(now)
        for item in gone:
            joined, tenant = self._joined.pop(item)
            self.stats.refuse("queue_timeout", tenant)
            self.stats.queue_waits_s.append(now - joined)
        return gone

    def may_start(self, tenant: str | None, instances: int) -> bool:
        """Whether `tenant` may take a free in-flight slot now (`TenantShares.may_start`)."""
        return self.control.may_start(tenant, instances)

    def ended(self, request_id: str) -> None:
        """An admitted request is done (served, or refused from the queue); else a no-op."""
        if request_id in self._tenant_of:
            self.control.finished(self._tenant_of.pop(request_id))

    def dispatched(self, instance_id: str, request_id: str) -> None:
        self.ledger.attach(instance_id, request_id)

    def released(self, request_id: str) -> None:
        self.ledger.release(request_id)

    def moved(self, request_id: str, dst: str) -> None:
        self.ledger.move(request_id, dst)
