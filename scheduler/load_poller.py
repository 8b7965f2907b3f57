"""Load polling: each instance's load, every `interval_s`, from the best source it offers.

Contract:
- A kvherd agent is polled at ``GET {url}/kvherd/v1/state`` (parsed by
  `scheduler.core.load_report.parse_agent_state`). An instance that answers that path with 404 is a plain
  vLLM/SGLang server: from then on its ``GET {url}/metrics`` is scraped (`parse_prometheus`).
- An instance that serves neither (404 on both) is asked again only every `idle_recheck_s`: a
  poll that can never succeed should not cost the proxy's event loop a request per interval.
- Each successful poll hands a `LoadReport` to `on_report(instance_id, report)`. A failed,
  unreadable or timed-out poll is skipped (the scheduler keeps its last report plus its own
  accounting; health is the health checker's business, not the poller's), counted per instance
  (`failures_total`, and `on_failure(instance_id)` for the proxy's metric), and logged at WARNING
  once `warn_after` polls in a row have failed (then every `warn_after` more), at debug before;
  the first success after a warned run says so at INFO.
- Instances are read from `targets()` at every round, so registration and removal need no calls here.
  Polls of one round run concurrently, each bounded by `timeout_s`, and send `headers` (the fleet
  token: the state route is a control route).
- Polls go over a keep-alive `scheduler.forwarding.UpstreamPool` of their own, not httpx: a
  vLLM /metrics page (~50 KB) costs about 1.5 ms of CPU through httpx and 0.3 ms through the pool,
  on the cores the engines need (issue 35).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping

import orjson

from scheduler.core.load_report import (
    LoadReport,
    LoadReportError,
    parse_agent_state,
    parse_prometheus,
)
from scheduler.forwarding import UpstreamError, UpstreamPool, UpstreamTimeout
from scheduler.periodic import PeriodicTask

log = logging.getLogger("kvherd.load")

STATE_PATH = "/kvherd/v1/state"


class PollError(Exception):
    """An answer other than 200 or 404."""


class LoadPoller:
    def __init__(
        self,
        targets: Callable[[], dict[str, str]],
        on_report: Callable[[str, LoadReport], None],
        block_size: Callable[[str], int],  # instance id -> its block size
        interval_s: float = 0.25,
        timeout_s: float = 2.0,
        idle_recheck_s: float = 30.0,
        headers: Mapping[str, str] | None = None,
        on_failure: Callable[[str], None] | None = None,
        warn_after: int = 3,
    ) -> None:
        self._targets = targets  # instance id -> base URL
        self._on_failure = on_failure
        self.warn_after = warn_after
        self.timeout_s = timeout_s
        self._failing: dict[str, int] = {}  # consecutive failed polls
        self.failures_total: dict[str, int] = {}
        self._on_report = on_report
        self._block_size = block_size
        self.interval_s = interval_s
        self._headers = [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
        self._pool = UpstreamPool(timeout_s, timeout_s, timeout_s, max_idle_per_origin=2)
        self._polled: dict[str, str] = {}  # instance id -> the base URL last polled
        self._scrape_only: set[str] = set()  # instances without the agent state endpoint
        self._no_source_until: dict[str, float] = {}  # instances with no load endpoint at all
        self.idle_recheck_s = idle_recheck_s
        self._task = PeriodicTask("kvherd-load-poller", self.poll_all, interval_s, log)

    async def _get(self, url: str, path: bytes) -> tuple[int, bytes]:
        response = await self._pool.send(url, b"GET", path, self._headers, b"", self.timeout_s)
        if response.body is not None:
            status, body = response.status, response.body
        else:  # chunked
            status, body = response.status, b"".join([c async for c in response.iter_body()])
        if status not in (200, 404):
            raise PollError(f"HTTP {status} for {path.decode()}")
        return status, body

    async def poll(self, instance_id: str, url: str) -> LoadReport | None:
        base = self._polled[instance_id] = url.rstrip("/")
        loop = asyncio.get_running_loop()
        if self._no_source_until.get(instance_id, 0.0) > loop.time():
            return None
        try:
            async with asyncio.timeout(self.timeout_s):
                if instance_id not in self._scrape_only:
                    status, body = await self._get(base, STATE_PATH.encode())
                    if status == 404:
                        log.info("instance %s has no %s: scraping /metrics", instance_id, STATE_PATH)
                        self._scrape_only.add(instance_id)
                    else:
                        report = parse_agent_state(orjson.loads(body))
                if instance_id in self._scrape_only:
                    status, body = await self._get(base, b"/metrics")
                    if status == 404:
                        self._no_source_until[instance_id] = loop.time() + self.idle_recheck_s
                        self._scrape_only.discard(instance_id)
                        return None
                    report = parse_prometheus(body.decode(), self._block_size(instance_id))
        except (TimeoutError, UpstreamError, PollError, LoadReportError, ValueError) as exc:
            self._failed(instance_id, base, exc)
            return None
        if self._failing.pop(instance_id, 0) >= self.warn_after:
            log.info("load poll of %s succeeds again", instance_id)
        self._on_report(instance_id, report)
        return report

    def _failed(self, instance_id: str, base: str, exc: Exception) -> None:
        run = self._failing[instance_id] = self._failing.get(instance_id, 0) + 1
        self.failures_total[instance_id] = self.failures_total.get(instance_id, 0) + 1
        if self._on_failure is not None:
            self._on_failure(instance_id)
        if isinstance(exc, (TimeoutError, UpstreamTimeout)):
            why = f"no answer within {self.timeout_s:g} s ({type(exc).__name__})"
        else:
            why = str(exc) or type(exc).__name__
        if run % self.warn_after == 0:
            log.warning(
                "load poll of %s (%s) failed %d times in a row: %s; routing uses the last report "
                "and the proxy's own accounting",
                instance_id,
                base,
                run,
                why,
            )
        else:
            log.debug("load poll of %s failed: %s", instance_id, why)

    def forget(self, instance_id: str) -> None:
        url = self._polled.pop(instance_id, None)
        if url is not None:
            self._pool.forget(url)  # its idle keep-alive connections
        self._scrape_only.discard(instance_id)
        self._failing.pop(instance_id, None)
        self.failures_total.pop(instance_id, None)
        self._no_source_until.pop(instance_id, None)

    async def poll_all(self) -> None:
        targets = self._targets()
        await asyncio.gather(*(self.poll(i, u) for i, u in targets.items()))

    def start(self) -> None:
        self._task.start()

    async def stop(self) -> None:
        await self._task.stop()
        await self._pool.close()
