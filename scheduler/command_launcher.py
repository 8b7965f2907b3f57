"""Engines started from a command template (vLLM, SGLang, any OpenAI server): ``kvherd up --launch``.

Contract:
- `CommandGroup(command, instance, engines, env)`: the command line and ``--instance`` value are
  filled per launch (`fields_for`: ``{id}``, ``{host}``, ``{port}``, ``{port1}``..``{port3}``,
  ``{cpu}``; other braces stay) and run by `engines` (`LocalEngines`: child processes; or
  `scheduler.ray_launcher.RayLauncher`: Ray actors). `bind(...)` before the first launch.
- `launch()`: the engine in its own process group; once ``/health`` answers it is described,
  warmed from its peers' caches (`scheduler.handover.WarmUps`) and added to the fleet; one that
  exits on its own is removed. `retire(id)`: drained (its streams migrate), its hot prefixes
  handed over once idle, removed, SIGTERM then SIGKILL. `stop(timeout)`: all.
- `alive(id)`, `dead()`, `ids`, `describe(id)`, `log_hint(id)`: its `engines`'. The long story is
  in docs/operations.md.
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
from typing import TYPE_CHECKING, Protocol

from scheduler.child_processes import ChildProcesses
from scheduler.handover import WarmUps, hand_over

if TYPE_CHECKING:
    from scheduler.fleet import Fleet

log = logging.getLogger("kvherd.launch")

_PLACEHOLDER = re.compile(r"\{(id|host|port|port1|port2|port3|cpu)\}")
LOOPBACK = "127.0.0.1"
_HEALTH_POLL_S = 0.5  # an engine loads for seconds to minutes; there is nothing to await


def check_templates(command: str, instance: str) -> str | None:
    """Why `command` / `instance` cannot be launched (None: they can)."""
    from scheduler.serve_cli import parse_instance_spec

    try:
        if not shlex.split(command):
            return "--launch: empty command"
        parse_instance_spec(fill(instance, fields_for("engine-0", [1, 2, 3, 4], 0)))
    except ValueError as exc:
        return str(exc)
    return None


def fill(template: str, fields: dict[str, str]) -> str:
    """`template` with its placeholders filled; other braces (a JSON flag's) are left as they are."""
    return _PLACEHOLDER.sub(lambda m: fields[m.group(1)], template)


def fields_for(
    instance_id: str, ports: list[int], ordinal: int, host: str = LOOPBACK
) -> dict[str, str]:
    """What fills one launch's placeholders: `ports` are {port}, {port1}..{port3}; {cpu} is the
    launch's ordinal modulo this host's CPUs."""
    return {
        "id": instance_id,
        "host": host,
        "port": str(ports[0]),
        **{f"port{i}": str(p) for i, p in enumerate(ports[1:], 1)},
        "cpu": str(ordinal % (os.cpu_count() or 1)),
    }


class Engines(Protocol):
    """Where launched engines run: local child processes (`LocalEngines`) or Ray actors
    (`scheduler.ray_launcher.RayLauncher`)."""

    @property
    def ids(self) -> list[str]: ...
    def start(self, instance_id: str, argv: list[str], env: dict[str, str], ordinal: int) -> None:
        """Start `argv` (a template: `fill` per launch, where it runs) as `instance_id`."""
    async def placed(self, instance_id: str) -> dict[str, str]:
        """The fields its template was filled with (its host and ports)."""
        ...
    def alive(self, instance_id: str) -> bool: ...
    def dead(self) -> list[str]: ...
    async def describe(self, instance_id: str) -> str: ...
    def log_hint(self, instance_id: str) -> str: ...
    async def retire(self, instance_id: str) -> None:
        """SIGTERM to its process group, SIGKILL after the stop timeout; returns once gone."""
    async def stop(self, timeout: float) -> None: ...


class LocalEngines(ChildProcesses):
    """Engines as child processes of this one, each leading its own process group, on loopback
    ports from `port()`."""

    def __init__(self, log_dir: str, port: Callable[[], int], stop_timeout_s: float) -> None:
        super().__init__(log_dir, own_group=True)
        self.port = port
        self.stop_timeout_s = stop_timeout_s
        self._fields: dict[str, dict[str, str]] = {}

    def start(self, instance_id: str, argv: list[str], env: dict[str, str], ordinal: int) -> None:
        fields = fields_for(instance_id, [self.port() for _ in range(4)], ordinal)
        self._fields[instance_id] = fields
        self._start(instance_id, [fill(arg, fields) for arg in argv], env)

    async def placed(self, instance_id: str) -> dict[str, str]:
        return self._fields[instance_id]

    async def retire(self, instance_id: str) -> None:
        await self._stop_children([instance_id], self.stop_timeout_s)

    async def stop(self, timeout: float) -> None:
        await self._stop_children(self.ids, timeout)


class CommandGroup:
    def __init__(
        self,
        command: str,
        instance: str,
        engines: Engines,
        env: dict[str, str],
        stop_timeout_s: float = 30.0,
        ready_timeout_s: float = 300.0,
    ) -> None:
        if problem := check_templates(command, instance):
            raise ValueError(problem)
        self.argv = shlex.split(command)
        self.instance = instance
        self.engines = engines
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

    @property
    def ids(self) -> list[str]:
        return self.engines.ids

    def alive(self, instance_id: str) -> bool:
        return self.engines.alive(instance_id)

    def dead(self) -> list[str]:
        return self.engines.dead()

    async def describe(self, instance_id: str) -> str:
        return await self.engines.describe(instance_id)

    def log_hint(self, instance_id: str) -> str:
        return self.engines.log_hint(instance_id)

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
        self.engines.start(instance_id, self.argv, self.env, ordinal)
        task = asyncio.get_running_loop().create_task(self._join(instance_id))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return instance_id

    async def _join(self, instance_id: str) -> None:
        """Wait for the engine's health, then add it to the fleet under `instance_id`."""
        import httpx

        from scheduler.fleet import FleetError
        from scheduler.serve_cli import (
            foreign_without_tokenizer,
            parse_instance_spec,
            probe_instance,
        )

        assert self._fleet is not None
        instance = fill(self.instance, await self.engines.placed(instance_id))
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
            await self.engines.retire(instance_id)
            return
        try:
            await self._fleet.add_instance(spec)
        except FleetError as exc:
            log.error("launched %s not added: %s", instance_id, exc.message)
            await self.engines.retire(instance_id)
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
        await self.engines.retire(instance_id)

    async def stop(self, timeout: float) -> None:
        for task in self._tasks:
            task.cancel()
        await self.engines.stop(timeout)
