"""Registration of an agent with the global scheduler's admin API.

The contract the scheduler implements (all bodies JSON; every call carries
``Authorization: Bearer $KVHERD_ADMIN_TOKEN`` when that variable is set):

- ``POST {scheduler}/admin/v1/instances`` with
  ``{"instance_id", "url", "kv_events_endpoint", "replay_endpoint", "model", "block_size"}``
  registers (or re-registers, idempotently) an instance. ``url`` is the agent's base URL (no trailing
  slash); the two endpoints are ZMQ addresses a subscriber connects to, or null when the agent
  publishes no KV events. Success: any 2xx.
- ``POST {scheduler}/admin/v1/instances/{instance_id}/heartbeat`` every `heartbeat_s` seconds
  (default 2) with a load summary ``{"instance_id", "num_running", "num_waiting", "kv_usage",
  "free_blocks", "freeness", "last_kv_event_seq", "draining"}`` the scheduler may use or ignore.
  A 404 means the scheduler forgot the instance (it restarted): the agent registers again.
  When the agent starts draining (SIGTERM) it sends one heartbeat at once (`Registrar.announce`)
  so that the scheduler stops routing to it and migrates its running requests away without
  waiting for the next interval (Llumnix-style scale-in).
- ``POST {scheduler}/admin/v1/instances/{instance_id}/handover`` once drained (no open request
  left), before shutting down: the scheduler has survivors pull its hot prefixes (best effort).
- ``DELETE {scheduler}/admin/v1/instances/{instance_id}`` on shutdown (best effort, once).

Failures (connection refused, timeouts, 5xx, 401) are logged and retried with exponential backoff
capped at ten heartbeat intervals (30 s at most); they never stop the agent from serving.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Awaitable, Callable
from typing import Any

import httpx

log = logging.getLogger(__name__)

ADMIN_TOKEN_ENV = "KVHERD_ADMIN_TOKEN"
HANDOVER_TIMEOUT_S = 120.0  # the most a drained agent waits for its prefixes to be pulled


class Registrar:
    def __init__(
        self,
        scheduler_url: str,
        registration: dict[str, Any],
        load_summary: Callable[[], Awaitable[dict[str, Any]]],
        *,
        heartbeat_s: float = 2.0,
        max_backoff_s: float | None = None,
        token: str | None = None,
    ) -> None:
        self.base = scheduler_url.rstrip("/")
        self.registration = registration
        self.instance_id = str(registration["instance_id"])
        self._load_summary = load_summary
        self.heartbeat_s = heartbeat_s
        # Retry at least every ten heartbeats (and every 30 s), so a restarted scheduler hears
        # from its agents soon.
        self.max_backoff_s = max_backoff_s or min(30.0, 10 * heartbeat_s)
        token = token if token is not None else os.environ.get(ADMIN_TOKEN_ENV)
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._client = httpx.AsyncClient(headers=headers, timeout=5.0)
        self._task: asyncio.Task[None] | None = None
        self.registered = False

    @property
    def _instances_url(self) -> str:
        return f"{self.base}/admin/v1/instances"

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="kvherd-registration")

    async def _register(self) -> bool:
        response = await self._client.post(self._instances_url, json=self.registration)
        if response.is_success:
            log.info("registered with scheduler %s as %s", self.base, self.instance_id)
            return True
        log.warning("scheduler refused registration: %s %s", response.status_code, response.text)
        return False

    async def _heartbeat(self) -> bool:
        url = f"{self._instances_url}/{self.instance_id}/heartbeat"
        response = await self._client.post(url, json=await self._load_summary())
        if response.status_code == 404:
            log.warning("scheduler does not know %s any more; registering again", self.instance_id)
            self.registered = False
            return False
        if not response.is_success:
            log.warning("heartbeat refused: %s %s", response.status_code, response.text)
            return False
        return True

    async def announce(self) -> None:
        """One heartbeat now (e.g. "draining" changed); best effort, never raises."""
        if not self.registered:
            return
        try:
            await self._heartbeat()
        except httpx.HTTPError as exc:
            log.warning("scheduler %s unreachable: %s", self.base, exc)

    async def hand_over(self, timeout_s: float = HANDOVER_TIMEOUT_S) -> None:
        """Ask the scheduler to hand this drained agent's hot prefixes to survivors (it pulls
        them from this agent's block server, so the agent must still serve); best effort."""
        if not self.registered:
            return
        url = f"{self._instances_url}/{self.instance_id}/handover"
        try:
            response = await self._client.post(url, timeout=timeout_s)
        except httpx.HTTPError as exc:
            log.warning("hand-over failed: %r", exc)
            return
        if response.is_success:
            log.info("handed over: %s", response.text)
        else:
            log.warning("hand-over refused: %s %s", response.status_code, response.text)

    async def _run(self) -> None:
        backoff = self.heartbeat_s
        while True:
            try:
                if not self.registered:
                    self.registered = await self._register()
                ok = self.registered and await self._heartbeat()
            except httpx.HTTPError as exc:
                log.warning("scheduler %s unreachable: %s", self.base, exc)
                ok = False
            except Exception:  # never let registration take the agent down
                log.exception("registration loop error")
                ok = False
            if ok:
                backoff = self.heartbeat_s
                await asyncio.sleep(self.heartbeat_s)
            else:
                await asyncio.sleep(backoff)
                backoff = min(self.max_backoff_s, backoff * 2)

    async def close(self) -> None:
        """Stop heartbeating and deregister (best effort)."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        try:
            response = await self._client.delete(f"{self._instances_url}/{self.instance_id}")
            if response.is_success:
                log.info("deregistered %s from %s", self.instance_id, self.base)
            else:
                log.warning("deregistration refused: %s", response.status_code)
        except httpx.HTTPError as exc:
            log.warning("deregistration failed: %s", exc)
        finally:
            await self._client.aclose()
