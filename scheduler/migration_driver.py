"""Live migration for ``kvherd serve``: the pure `MigrationLoop` on a timer, orders sent to agents.

Contract:
- Every ``interval_s`` the driver ticks the `MigrationLoop` with the fleet's current `ClusterView`;
  accepted orders go to `migration.executor.MigrationExecutor`, which POSTs ``{"request_id",
  "dst"}`` to the source agent's ``/kvherd/v1/migrate``.
- Draining instances are always emptied: while any instance drains, the `drain` policy's orders
  come first, whatever the automatic policy (``none`` included, which otherwise plans nothing).
- `migrate(request_id, dst)` is an operator's order (``POST /admin/v1/migrate``): the source is
  where the router placed the request; it counts as in flight for the loop until it ends, and
  returns the agent's `MigrationOutcome` (None when the source could not be asked).
- When an order ends, the loop is told (`on_done`) and, if the migration committed, the fleet moves
  the request's load charges and in-flight count to the destination (`Fleet.request_migrated`), so
  the next decisions see the new placement before any load report does. The client's stream is
  the agents' and the proxy's business: a streamed request's source ends its stream with a
  migration notice and the proxy reattaches at the destination; a non-streamed one is relayed by
  its source.
- An order whose source is not a kvherd agent (vLLM) is the proxy's own stop-and-copy
  (`scheduler.proxy.stream_cuts`, set as `cuts` by ``kvherd serve``): the stream is cut and
  continued at the destination, whose dispatch places the request there.
- Request ids in orders are the agents' own, which are the ``X-Request-Id`` the proxy forwarded
  (the router's key for the request). Orders carry the fleet token when there is one.
- Metrics on the proxy's registry: ``kvherd_migrations_started_total``,
  ``kvherd_migrations_total{outcome}`` (``committed``, an abort reason, or ``failed`` when the
  source could not be asked), ``kvherd_migration_bytes_total{kind}`` (``sent``, ``skipped``:
  shared from the destination's prefix cache), ``kvherd_migration_downtime_seconds`` and
  ``kvherd_migration_reattachments_total`` (streams the proxy continued at a new instance).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from typing import Any, Protocol

import httpx
from prometheus_client import CollectorRegistry, Counter, Histogram

from kvherd.fleet_token import auth_headers
from kvherd.wire import OpenAIError
from migration.core.protocol import MigrationOutcome, MigrationStatus
from migration.executor import MigrationExecutor
from policies.base import MigrationPolicy
from policies.migrate_drain import DrainMigration
from policies.views import ClusterView, MigrationOrder
from scheduler.core.migration_loop import InFlightMigration, MigrationLoop
from scheduler.periodic import PeriodicTask

log = logging.getLogger("kvherd.migration")


class _Spec(Protocol):
    @property
    def kvherd_agent(self) -> bool: ...


class _Instance(Protocol):
    @property
    def url(self) -> str: ...
    @property
    def spec(self) -> _Spec: ...


class _Cuts(Protocol):
    async def migrate(self, key: str, dst: str) -> MigrationOutcome: ...


class _Router(Protocol):
    def instance_of(self, key: str) -> str | None: ...


class _Cluster(Protocol):
    def view(self, now: float) -> ClusterView: ...


class _Metrics(Protocol):
    registry: CollectorRegistry


class MigrationHost(Protocol):
    """What the driver needs of the fleet it migrates in (`scheduler.fleet.Fleet` is one)."""

    @property
    def instances(self) -> Mapping[str, _Instance]: ...
    @property
    def router(self) -> _Router: ...
    @property
    def cluster(self) -> _Cluster: ...
    @property
    def metrics(self) -> _Metrics: ...
    def clock(self) -> float: ...
    def request_migrated(self, key: str, dst: str) -> None: ...


class WithDrain:
    """`policy`, preceded by the `drain` policy's orders while any instance drains."""

    def __init__(self, policy: MigrationPolicy) -> None:
        self.policy = policy
        self.name = policy.name
        self._drain = DrainMigration()

    def plan(self, cluster: ClusterView) -> list[MigrationOrder]:
        if not any(inst.draining for inst in cluster.instances):
            return self.policy.plan(cluster)
        orders = self._drain.plan(cluster)
        moving = {order.request_id for order in orders}
        return orders + [o for o in self.policy.plan(cluster) if o.request_id not in moving]


class MigrationMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.started = Counter(
            "kvherd_migrations_started",
            "Migrations ordered (by the migration policy or an operator).",
            registry=registry,
        )
        self.ended = Counter(
            "kvherd_migrations",
            "Migrations ended, by outcome: committed, the abort reason, or failed (no answer).",
            ["outcome"],
            registry=registry,
        )
        self.bytes = Counter(
            "kvherd_migration_bytes",
            "KV bytes of migrations: sent, or skipped (shared from the destination's cache).",
            ["kind"],
            registry=registry,
        )
        self.reattached = Counter(
            "kvherd_migration_reattachments",
            "Client streams the proxy continued at their migrated request's new instance.",
            registry=registry,
        )
        self.downtime = Histogram(
            "kvherd_migration_downtime_seconds",
            "Time a committed migration kept its request from making progress.",
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0),
            registry=registry,
        )

    def record(self, outcome: MigrationOutcome | None) -> None:
        if outcome is None:
            self.ended.labels("failed").inc()
            return
        committed = outcome.status is MigrationStatus.COMMITTED
        reason = outcome.reason.value if outcome.reason is not None else outcome.status.value
        self.ended.labels("committed" if committed else reason).inc()
        self.bytes.labels("sent").inc(outcome.bytes_sent)
        if committed:
            self.bytes.labels("skipped").inc(outcome.bytes_skipped)
            self.downtime.observe(outcome.downtime_s)


class MigrationDriver:
    def __init__(
        self,
        fleet: MigrationHost,
        policy: MigrationPolicy,
        interval_s: float = 1.0,
        max_in_flight: int = 4,
        order_timeout_s: float = 120.0,
        fleet_token: str | None = None,
    ) -> None:
        self.fleet = fleet
        self.metrics = MigrationMetrics(fleet.metrics.registry)
        self._client = httpx.AsyncClient(
            timeout=order_timeout_s, trust_env=False, headers=auth_headers(fleet_token)
        )
        self.executor = MigrationExecutor(self._client, self._url_of, self._on_done)
        self.cuts: _Cuts | None = None  # the proxy's migrations of vLLM streams
        self._cutting: set[asyncio.Task[MigrationOutcome]] = set()
        self.loop = MigrationLoop(
            WithDrain(policy),
            self._execute,
            interval_s=interval_s,
            max_in_flight=max_in_flight,
            order_timeout_s=order_timeout_s,
        )
        self._task = PeriodicTask(
            "kvherd-migration", self._tick_round, interval_s, log, wait_first=True
        )

    def set_policy(self, policy: MigrationPolicy) -> None:
        self.loop.set_policy(WithDrain(policy))

    def _url_of(self, instance_id: str) -> str | None:
        inst = self.fleet.instances.get(instance_id)
        return None if inst is None else inst.url

    def _cut_by_proxy(self, order: MigrationOrder) -> bool:
        source = self.fleet.instances.get(order.src)
        return self.cuts is not None and source is not None and not source.spec.kvherd_agent

    def _execute(self, order: MigrationOrder) -> None:
        self.metrics.started.inc()
        if not self._cut_by_proxy(order):
            self.executor.execute(order)
            return
        task = asyncio.get_running_loop().create_task(self._cut(order))
        self._cutting.add(task)
        task.add_done_callback(self._cutting.discard)

    async def _cut(self, order: MigrationOrder) -> MigrationOutcome:
        assert self.cuts is not None
        outcome = await self.cuts.migrate(order.request_id, order.dst)
        self._on_done(order, outcome, placed=True)
        return outcome

    def _on_done(self, order: Any, outcome: MigrationOutcome | None, placed: bool = False) -> None:
        """`placed`: the request's dispatch at the destination already moved its accounting."""
        now = self.fleet.clock()
        self.metrics.record(outcome)
        committed = outcome is not None and outcome.status is MigrationStatus.COMMITTED
        self.loop.on_done(order.request_id, committed, now)
        if committed and not placed:
            self.fleet.request_migrated(order.request_id, order.dst)
            log.info("migrated %s from %s to %s", order.request_id, order.src, order.dst)
        elif outcome is not None:
            log.info(
                "migration of %s aborted: %s",
                order.request_id,
                outcome.reason.value if outcome.reason else outcome.detail,
            )

    async def migrate(self, request_id: str, dst: str) -> MigrationOutcome | None:
        """An operator's order: move `request_id` from where it runs to instance `dst`."""
        src = self.fleet.router.instance_of(request_id)
        if src is None:
            raise OpenAIError(404, f"no request {request_id!r} in flight", param="request_id")
        if dst not in self.fleet.instances:
            raise OpenAIError(404, f"unknown instance {dst!r}", param="to")
        if dst == src:
            raise OpenAIError(400, f"request {request_id!r} already runs on {dst!r}", param="to")
        if request_id in self.loop.in_flight:
            raise OpenAIError(
                409, f"request {request_id!r} is already migrating", param="request_id"
            )
        order = MigrationOrder(request_id, src, dst, "operator")
        # In flight for the loop too, so the policy does not move the request meanwhile.
        self.loop.in_flight[request_id] = InFlightMigration(order, self.fleet.clock())
        if self._cut_by_proxy(order):
            self.metrics.started.inc()
            return await self._cut(order)
        self.metrics.started.inc()
        outcome = await self.executor.migrate(order)
        self._on_done(order, outcome)
        return outcome

    def tick(self) -> None:
        now = self.fleet.clock()
        self.loop.tick(self.fleet.cluster.view(now), now)

    async def _tick_round(self) -> None:
        self.tick()

    def start(self) -> None:
        self._task.start()

    async def stop(self) -> None:
        await self._task.stop()
        for task in list(self._cutting):
            task.cancel()
        await self.executor.close()
        await self._client.aclose()
