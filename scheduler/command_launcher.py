"""Engines started from a command template (vLLM, SGLang, any OpenAI server): ``kvherd up --launch``.

Contract:
- `CommandGroup(command, instance, ...)`: `command` is a shell-style command line and `instance` an
  ``--instance`` value (`scheduler.serve_cli.parse_instance_spec`), both formatted per launch with
  ``{id}`` (``engine-N``), ``{port}``, ``{port1}``..``{port3}`` (fresh loopback ports: e.g. the
  engine's KV-event PUB, replay ROUTER and block server) and ``{cpu}`` (the launch's ordinal modulo
  the host's CPUs); other braces stay (a JSON flag). `bind(fleet, kv_events, fleet_token,
  tokenizer_named)` before the first launch.
- `launch()` starts the engine in its own process group (it dies with this process) and a task that
  polls ``GET /health`` until 200, then describes it (`probe_instance`) and adds it to the fleet (no
  heartbeats expected), warming up from its peers' caches first (`scheduler.handover.WarmUps`,
  unless ``--no-handover``); one whose model no ``--tokenizer`` covers is stopped instead (logged).
  One that later exits on its own is removed from the fleet (the autoscaler then replaces it).
- `retire(id)`: it is drained (no new requests; the migration driver moves its streams: stream cuts
  for vLLM), once nothing is in flight on it (at most ``stop_timeout_s``) survivors pull its hot
  prefixes (`scheduler.handover`, unless ``--no-handover``), then it is removed from the fleet and
  its process group gets SIGTERM (SIGKILL after ``stop_timeout_s``). `stop(timeout)`: all.
- `alive(id)`, `dead()`, `ids`, `describe(id)`, `log_hint(id)`: `scheduler.child_processes`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import shlex
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from scheduler.child_processes import ChildProcesses
from scheduler.handover import WarmUps, hand_over

if TYPE_CHECKING:
    from scheduler.fleet import Fleet

log = logging.getLogger("kvherd.launch")

_PLACEHOLDER = re.compile(r"\{(id|port|port1|port2|port3|cpu)\}")
_HEALTH_POLL_S = 0.5  # an engine loads for seconds to minutes; there is nothing to await


def check_templates(command: str, instance: str) -> str | None:
    """Why `command` / `instance` cannot be launched (None: they can)."""
    from scheduler.serve_cli import parse_instance_spec

    try:
        if not shlex.split(command):
            return "--launch: empty command"
        parse_instance_spec(fill(instance, _fields("engine-0", [1, 2, 3, 4], 0)))
    except ValueError as exc:
        return str(exc)
    return None


def fill(template: str, fields: dict[str, str]) -> str:
    """`template` with its placeholders filled; other braces (a JSON flag's) are left as they are."""
    return _PLACEHOLDER.sub(lambda m: fields[m.group(1)], template)


def _fields(instance_id: str, ports: list[int], ordinal: int) -> dict[str, str]:
    return {
        "id": instance_id,
        "port": str(ports[0]),
        **{f"port{i}": str(p) for i, p in enumerate(ports[1:], 1)},
        "cpu": str(ordinal % (os.cpu_count() or 1)),
    }


class CommandGroup(ChildProcesses):
    def __init__(
        self,
        command: str,
        instance: str,
        port: Callable[[], int],
        env: dict[str, str],
        log_dir: str,
        stop_timeout_s: float = 30.0,
        ready_timeout_s: float = 300.0,
    ) -> None:
        if problem := check_templates(command, instance):
            raise ValueError(problem)
        super().__init__(log_dir, own_group=True)
        self.argv = shlex.split(command)
        self.instance = instance
        self.port = port
        self.env = env
        self.stop_timeout_s = stop_timeout_s
        self.ready_timeout_s = ready_timeout_s
        self._added: set[str] = set()  # those in the fleet
        self._tasks: set[asyncio.Task[None]] = set()
        self._next = 0
        self._fleet: Fleet | None = None
        self._kv_events = True
        self._fleet_token: str | None = None
        self._named: Callable[[str | None], bool] = lambda model: False

    def bind(
        self,
        fleet: Fleet,
        kv_events: bool,
        fleet_token: str | None,
        tokenizer_named: Callable[[str | None], bool],
    ) -> None:
        self._fleet = fleet
        self._warm_ups = WarmUps(fleet)
        self._kv_events = kv_events
        self._fleet_token = fleet_token
        self._named = tokenizer_named

    def launch(self, role: str = "mixed") -> str:
        if self._fleet is None:
            raise RuntimeError("CommandGroup.bind(fleet, ...) first")
        ordinal = self._next
        self._next += 1
        instance_id = f"engine-{ordinal}"
        fields = _fields(instance_id, [self.port() for _ in range(4)], ordinal)
        argv = [fill(arg, fields) for arg in self.argv]
        instance = fill(self.instance, fields)
        self._start(instance_id, argv, self.env)
        task = asyncio.get_running_loop().create_task(self._join(instance_id, instance))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return instance_id

    async def _join(self, instance_id: str, instance: str) -> None:
        """Wait for the engine's health, then add it to the fleet under `instance_id`."""
        import httpx

        from scheduler.fleet import FleetError
        from scheduler.serve_cli import (
            foreign_without_tokenizer,
            parse_instance_spec,
            probe_instance,
        )

        assert self._fleet is not None
        raw = {**parse_instance_spec(instance), "id": instance_id}
        deadline = time.monotonic() + self.ready_timeout_s
        async with httpx.AsyncClient(timeout=2.0, trust_env=False) as client:
            while self.alive(instance_id) and time.monotonic() < deadline:
                with contextlib.suppress(httpx.HTTPError):
                    if (await client.get(raw["url"] + "/health")).status_code == 200:
                        break
                await asyncio.sleep(_HEALTH_POLL_S)
            else:
                return  # dead or late: the autoscaler stops counting it (and stops it)
        spec = await probe_instance(raw, self._kv_events, self._fleet_token)
        if refusal := foreign_without_tokenizer(spec, self._named):
            log.error("launched %s not added: %s", instance_id, refusal)
            self._terminate(instance_id)
            return
        try:
            await self._fleet.add_instance(spec)
        except FleetError as exc:
            log.error("launched %s not added: %s", instance_id, exc.message)
            self._terminate(instance_id)
            return
        self._added.add(instance_id)
        if self._fleet.settings.handover:
            self._warm_ups.start(instance_id)
        log.info("launched %s serves at %s", instance_id, spec.url)
        while self.alive(instance_id):
            await asyncio.sleep(_HEALTH_POLL_S)  # a child's exit has no event on this loop
        if instance_id in self._added:  # it died on its own: out of the fleet (the autoscaler
            self._added.discard(instance_id)  # replaces it if the fleet is then too small)
            log.warning("launched %s exited (%s)", instance_id, self.log_hint(instance_id))
            await self._fleet.remove_instance(instance_id)

    async def retire(self, instance_id: str) -> None:
        fleet = self._fleet
        if fleet is not None and instance_id in self._added and instance_id in fleet.instances:
            fleet.instances[instance_id].leaving = True  # (a warm-up ending lets it in else)
            fleet.set_draining(instance_id, True)
            deadline = time.monotonic() + self.stop_timeout_s
            while fleet.inflight.count(instance_id) and time.monotonic() < deadline:
                await asyncio.sleep(0.05)  # its streams end or are moved; no event to await
            if fleet.settings.handover:
                await hand_over(fleet, instance_id)
            await fleet.remove_instance(instance_id)
        self._added.discard(instance_id)
        await self._stop_children([instance_id], self.stop_timeout_s)

    async def stop(self, timeout: float) -> None:
        for task in self._tasks:
            task.cancel()
        await self._stop_children(self.ids, timeout)
