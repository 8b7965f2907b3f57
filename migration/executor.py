"""Carries out the scheduler's migration orders by calling the source agents over HTTP.

Contract:
- `MigrationExecutor.execute(order)` never blocks: it starts a task that POSTs
  ``{"request_id", "dst"}`` to the source agent's ``/kvherd/v1/migrate`` (instance ids are mapped
  to base URLs by `url_of`) and hands the `MigrationOutcome` — or None when the source could not be
  asked or answered nonsense — to `on_done(order, outcome)`. That is where the scheduler calls
  `MigrationLoop.on_done` and, on commit, `Router.on_migrated`.
- An order whose source or destination has no known URL is reported done at once (outcome None).
- `close()` waits for the migrations in flight (each bounded by the HTTP timeout).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any, Protocol

import httpx

from migration.core.protocol import MessageError, MigrationOutcome

log = logging.getLogger(__name__)


class Order(Protocol):
    """What the executor needs of an order (`policies.views.MigrationOrder` fits)."""

    @property
    def request_id(self) -> str: ...

    @property
    def src(self) -> str: ...

    @property
    def dst(self) -> str: ...


class MigrationExecutor:
    def __init__(
        self,
        client: httpx.AsyncClient,
        url_of: Callable[[str], str | None],
        on_done: Callable[[Any, MigrationOutcome | None], None],
    ) -> None:
        self.client = client
        self.url_of = url_of
        self.on_done = on_done
        self._tasks: set[asyncio.Task[None]] = set()

    def execute(self, order: Order) -> None:
        task = asyncio.get_running_loop().create_task(self._run(order))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def migrate(self, order: Order) -> MigrationOutcome | None:
        """POST the order to its source agent; None if that failed."""
        src_url, dst_url = self.url_of(order.src), self.url_of(order.dst)
        if src_url is None or dst_url is None:
            log.warning(
                "migration of %s: unknown instance %s or %s", order.request_id, *_ids(order)
            )
            return None
        try:
            response = await self.client.post(
                f"{src_url.rstrip('/')}/kvherd/v1/migrate",
                json={"request_id": order.request_id, "dst": dst_url},
            )
            if response.status_code != 200:
                log.warning(
                    "migration of %s: %s answered HTTP %d: %s",
                    order.request_id,
                    order.src,
                    response.status_code,
                    response.text[:200],
                )
                return None
            return MigrationOutcome.from_json(response.json())
        except (httpx.HTTPError, ValueError, MessageError) as e:
            log.warning("migration of %s via %s failed: %r", order.request_id, order.src, e)
            return None

    async def close(self) -> None:
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _run(self, order: Order) -> None:
        outcome = await self.migrate(order)
        try:
            self.on_done(order, outcome)
        except Exception:  # a bad callback must not kill the event loop's task bookkeeping
            log.exception("migration on_done callback failed for %s", order.request_id)


def _ids(order: Order) -> tuple[str, str]:
    return order.src, order.dst
