"""Live migration for ``kvherd serve``: the pure `MigrationLoop` on a timer, orders sent to agents.

Contract:
- Every ``interval_s`` the driver ticks the `MigrationLoop` with the fleet's current `ClusterView`;
  accepted orders go to `migration.executor.MigrationExecutor`, which POSTs ``{"request_id",
  "dst"}`` to the source agent's ``/kvherd/v1/migrate``.
- When an order ends, the loop is told (`on_done`) and, if the migration committed, the router moves
  the request's load charges to the destination (`Router.on_migrated`), so the next decisions see
  the new placement before any load report does. The client's stream is not touched: the source
  agent keeps relaying it.
- Request ids in orders are the agents' own, which are the ``X-Request-Id`` the proxy forwarded
  (the router's key for the request).
- ``--migration-policy none`` (the default) creates no driver at all.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import TYPE_CHECKING, Any

import httpx

from migration.executor import MigrationExecutor
from migration.protocol import MigrationOutcome, MigrationStatus
from policies.base import MigrationPolicy
from scheduler.migration_loop import MigrationLoop

if TYPE_CHECKING:
    from scheduler.fleet import Fleet

log = logging.getLogger("kvherd.migration")


class MigrationDriver:
    def __init__(
        self,
        fleet: Fleet,
        policy: MigrationPolicy,
        interval_s: float = 1.0,
        max_in_flight: int = 4,
        order_timeout_s: float = 120.0,
    ) -> None:
        self.fleet = fleet
        self._client = httpx.AsyncClient(timeout=order_timeout_s, trust_env=False)
        self.executor = MigrationExecutor(self._client, self._url_of, self._on_done)
        self.loop = MigrationLoop(
            policy,
            self.executor.execute,
            interval_s=interval_s,
            max_in_flight=max_in_flight,
            order_timeout_s=order_timeout_s,
        )
        self._task: asyncio.Task[None] | None = None

    def _url_of(self, instance_id: str) -> str | None:
        inst = self.fleet.instances.get(instance_id)
        return None if inst is None else inst.url

    def _on_done(self, order: Any, outcome: MigrationOutcome | None) -> None:
        now = self.fleet.clock()
        committed = outcome is not None and outcome.status is MigrationStatus.COMMITTED
        self.loop.on_done(order.request_id, committed, now)
        if committed:
            self.fleet.router.on_migrated(order.request_id, order.dst, now)
            log.info("migrated %s from %s to %s", order.request_id, order.src, order.dst)
        elif outcome is not None:
            log.info(
                "migration of %s aborted: %s",
                order.request_id,
                outcome.reason.value if outcome.reason else outcome.detail,
            )

    def tick(self) -> None:
        now = self.fleet.clock()
        self.loop.tick(self.fleet.cluster.view(now), now)

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.loop.interval_s)
            try:
                self.tick()
            except Exception:  # a policy bug must not stop the proxy
                log.exception("migration tick failed")

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="kvherd-migration")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        await self.executor.close()
        await self._client.aclose()
