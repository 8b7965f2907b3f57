"""Active health probes: each instance's ``/health``, fed to the outlier detector.

Contract:
- `ActiveProber` (async) GETs each instance's ``/health`` every ``interval_s``: a failed probe counts as
  a failure, a passed probe as a success (`scheduler.core.outliers.OutlierDetector`), so an instance
  that is down is ejected even with no traffic and a recovered one comes back without waiting for a
  lucky request.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import httpx

from scheduler.periodic import PeriodicTask

log = logging.getLogger("kvherd.health")


class ActiveProber:
    """Periodic ``GET {url}/health`` for every instance; results go to `on_result`."""

    def __init__(
        self,
        targets: Callable[[], dict[str, str]],
        on_result: Callable[[str, bool], None],
        interval_s: float = 2.0,
        timeout_s: float = 2.0,
    ) -> None:
        self._targets = targets  # instance id -> base URL, read at every round (membership changes)
        self._on_result = on_result
        self.interval_s = interval_s
        self._client = httpx.AsyncClient(timeout=timeout_s, trust_env=False)
        self._task = PeriodicTask("kvherd-health-prober", self.probe_all, interval_s, log)

    async def probe(self, instance_id: str, url: str) -> bool:
        try:
            response = await self._client.get(url.rstrip("/") + "/health")
            ok = response.status_code == 200
        except httpx.HTTPError:
            ok = False
        self._on_result(instance_id, ok)
        return ok

    async def probe_all(self) -> None:
        targets = self._targets()
        await asyncio.gather(*(self.probe(i, u) for i, u in targets.items()))

    def start(self) -> None:
        self._task.start()

    async def stop(self) -> None:
        await self._task.stop()
        await self._client.aclose()
