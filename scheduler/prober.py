"""Active health probes: each instance's ``/health``, fed to the outlier detector.

Contract:
- `ActiveProber` (async) GETs each instance's ``/health`` every ``interval_s``: a failed probe counts as
  a failure, a passed probe as a success (`scheduler.core.outliers.OutlierDetector`), so an instance
  that is down is ejected even with no traffic and a recovered one comes back without waiting for a
  lucky request. A draining agent (503 ``{"status": "draining"}``) passes: it is alive and still
  serving, or handing over, its open requests; ejecting it would fail them over mid-migration.
- A probe's timeout, like the request path's deadlines, does not count the time the proxy's own
  event loop was late (`lag_owed(since)`: `scheduler.loop_lag.LoopLag.owed`, given by
  ``kvherd serve``): the probe waits on for as long as the loop owed, and one still unanswered after
  ``max_extension`` times its timeout of the loop's lag is inconclusive (neither failure nor
  success), so a saturated proxy never ejects a healthy instance by its probes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
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
        max_extension: float = 4.0,
        lag_owed: Callable[[float], float] | None = None,
    ) -> None:
        self._targets = targets  # instance id -> base URL, read at every round (membership changes)
        self._on_result = on_result
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.max_extension = max_extension
        # The proxy's loop lag since a monotonic time; nothing is owed without a proxy.
        self.lag_owed: Callable[[float], float] = lag_owed or (lambda since: 0.0)
        # httpx's own timeout only bounds a probe the loop lag has extended to its limit.
        self._client = httpx.AsyncClient(
            timeout=timeout_s * (1 + max_extension) + 1.0, trust_env=False
        )
        self._task = PeriodicTask("kvherd-health-prober", self.probe_all, interval_s, log)

    async def probe(self, instance_id: str, url: str) -> bool | None:
        """True/False as reported to `on_result`; None when the loop's lag left it inconclusive."""
        since = time.monotonic()
        get = asyncio.ensure_future(self._client.get(url.rstrip("/") + "/health"))
        budget = self.timeout_s
        try:
            while True:
                done, _ = await asyncio.wait({get}, timeout=max(0.0, budget - _elapsed(since)))
                if done:
                    ok = _alive(get.result())
                    break
                owed = self.lag_owed(since)
                if owed > self.max_extension * self.timeout_s:
                    return None  # the proxy was the one not answering: no evidence either way
                if _elapsed(since) - owed >= self.timeout_s:
                    ok = False  # the instance had its whole timeout
                    break
                budget = self.timeout_s + owed
        except httpx.HTTPError:
            ok = False
        finally:
            if not get.done():
                get.cancel()
                with contextlib.suppress(asyncio.CancelledError, httpx.HTTPError):
                    await get
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


def _elapsed(since: float) -> float:
    return time.monotonic() - since


def _alive(response: httpx.Response) -> bool:
    if response.status_code == 200:
        return True
    if response.status_code != 503:
        return False
    try:
        body = response.json()
    except ValueError:
        return False
    return isinstance(body, dict) and body.get("status") == "draining"
