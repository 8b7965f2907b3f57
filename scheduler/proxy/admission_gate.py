"""Admission on the proxy's clock: the core's expected-wait rule and queue, answered as 429s.

Contract:
- `check(tenant, priority)` refuses a new request (`Refused`: 429, ``code: queue_wait``,
  ``Retry-After``) when no dispatchable instance would start it at once and the requests queued
  ahead of it (in the admission queue, those served before it by class and fair share; plus what
  each dispatchable instance queues, `scheduler.core.admission`) would take longer than the allowed
  wait; never a tenant within its share while others have work in (`scheduler.core.fair_share`:
  the quiet tenant is not refused, the flooder is). It never refuses while some instance has a
  free batch slot. `finished(tenant)` once for every request `check` let in.
  The instances' figures are read at most every `_VIEW_TTL_S` (they change by load reports);
  in between, each admission spends one of the free slots they showed.
- `dispatch(...)`: the fleet's choice of instance; while every instance that may take it is
  saturated (`scheduler.core.inflight`), the request waits in the core's `AdmissionQueue` (by
  class and tenant: `queue_full` / `queue_timeout` 429s past its bounds), woken by `capacity_freed`;
  so does one of a tenant over its share while only the reserved slots are free (`may_start`). None when
  nothing dispatchable (and untried) is left. Retries and continuations pass `tried`; they are
  never refused by the expected wait, only by the queue's bounds.
- The core observes the fleet at every arrival and every freed capacity; a lost instance
  (`instance_lost`) makes the queue its requests form on the survivors a burst.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Collection

from kvherd.wire import OpenAIError
from scheduler.core.admission import AdmissionSettings, Refusal, fleet_queue
from scheduler.core.admission_control import AdmissionControl
from scheduler.core.admission_queue import QueueSettings
from scheduler.fleet import Fleet, FleetInstance, NoCapacityError
from scheduler.metrics import ProxyMetrics

# How long the instances' figures are reused: they change by load reports, far more slowly
# than requests arrive.
_VIEW_TTL_S = 0.02


class Refused(OpenAIError):
    """A 429 from admission: the error object plus when to come back (``Retry-After``)."""

    def __init__(
        self,
        message: str,
        code: str,
        retry_after_s: int | None,
        headers: list[tuple[bytes, bytes]] | None = None,
    ) -> None:
        super().__init__(429, message, type="rate_limit_error", code=code)
        self.retry_after_s = retry_after_s  # None: retrying cannot help
        self.headers = headers or []  # more to send (a rate limit's ``x-ratelimit-*``)


class AdmissionGate:
    def __init__(
        self,
        fleet: Fleet,
        settings: AdmissionSettings,
        queue: QueueSettings,
        metrics: ProxyMetrics,
        weight: Callable[[str | None], float] | None = None,
    ) -> None:
        self.fleet = fleet
        self.metrics = metrics
        self.control: AdmissionControl[asyncio.Future[None]] = AdmissionControl(
            settings, queue, fleet.inflight, weight
        )
        self.queue = self.control.queue
        self._queued = 0  # requests the instances queue, as of `_seen_at`
        self._free = 0.0  # batch slots free for new requests since then (math.inf: unbounded)
        self._seen_at = -1.0

    def capacity_freed(self) -> None:
        now = time.monotonic()
        while (waiter := self.control.wake(now)) is not None:
            if not waiter.done():
                waiter.set_result(None)
                break
        self._read(now)
        self.control.observe(now, self._queued)

    def instance_lost(self) -> None:
        """Its requests fail over onto the others: a burst, allowed the full wait."""
        self.control.capacity_lost(time.monotonic())
        self._seen_at = -1.0  # read the survivors afresh

    def _read(self, now: float) -> None:
        """The dispatchable instances' queues and free slots, at most every `_VIEW_TTL_S`."""
        if now - self._seen_at <= _VIEW_TTL_S:
            return
        cluster = self.fleet.cluster
        views = (cluster.get(i).view() for i in self.fleet.instances if i in cluster)
        queued, free = fleet_queue(views, self.fleet.inflight.saturated)
        self._queued, self._free, self._seen_at = queued, free, now

    def check(self, tenant: str | None = None, priority: int = 0) -> None:
        """Refuse a new request that would wait longer than the fleet allows (429)."""
        now = time.monotonic()
        self._read(now)
        decision = self.control.decide(
            now, self._queued, self._free, tenant, priority, len(self.fleet.instances)
        )
        if not isinstance(decision, Refusal):
            if decision.startable:
                self._free -= 1
            return
        self.metrics.rejected("queue_wait")
        raise Refused(
            f"the fleet is overloaded: a request would wait about "
            f"{decision.expected_wait_s:.1f}s to start (at most {decision.limit_s:g}s allowed)",
            "queue_wait",
            decision.retry_after_s,
        )

    def finished(self, tenant: str | None) -> None:
        """A request `check` let in has ended (served, refused later or failed)."""
        self.control.finished(tenant)

    async def dispatch(
        self,
        key: str,
        num_tokens: int,
        block_hashes: list[int],
        tenant: str | None,
        max_tokens: int | None,
        tried: Collection[str],
        priority: int = 0,
        only: frozenset[str] | None = None,
        adapter: str | None = None,
        block_size: int | None = None,
        slo_ttft_s: float | None = None,
    ) -> tuple[FleetInstance, int, bool] | None:
        """The instance chosen for `key`, its matched blocks and whether it queued first,
        waiting in the queue while every instance is saturated; None when nothing dispatchable
        is left."""
        deadline: float | None = None
        while True:
            if self.control.may_start(tenant, len(self.fleet.instances)):
                try:
                    instance, matched = self.fleet.dispatch(
                        key, num_tokens, block_hashes,
                        tenant=tenant, max_tokens=max_tokens, exclude=tried,
                        only=only, adapter=adapter, block_size=block_size,
                        slo_ttft_s=slo_ttft_s,
                    )  # fmt: skip
                    return instance, matched, deadline is not None
                except NoCapacityError as exc:
                    if not exc.saturated:
                        return None  # nothing dispatchable (or everything already tried)
            loop = asyncio.get_running_loop()
            waiter: asyncio.Future[None] = loop.create_future()
            now = time.monotonic()
            since = None if deadline is None else deadline - self.queue.settings.timeout_s
            if not self.control.join(now, waiter, tenant, priority, since):
                self.metrics.rejected("queue_full")
                raise Refused(
                    "every instance is saturated and the admission queue is full",
                    "queue_full",
                    self._retry_after(),
                )
            if deadline is None:
                deadline = self.control.deadline(waiter)
            self.metrics.queue_depth.set(len(self.queue))
            try:
                async with asyncio.timeout(max(0.0, deadline - now)):
                    await waiter
            except TimeoutError:
                self.metrics.rejected("queue_timeout")
                raise Refused(
                    f"no instance had room within {self.queue.settings.timeout_s}s",
                    "queue_timeout",
                    self._retry_after(),
                ) from None
            finally:
                self.control.leave(waiter)
                self.metrics.queue_depth.set(len(self.queue))

    def _retry_after(self) -> int:
        """Whole seconds until the queue ahead is expected to have drained (at least 1)."""
        now = time.monotonic()
        self._read(now)
        return self.control.retry_after(now, self._queued)
