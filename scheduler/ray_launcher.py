"""Engines as Ray actors: ``kvherd up --ray ADDRESS``'s launcher (`pip install kvherd[plan]`).

Contract:
- `RayLauncher(address, env, host, command_of, num_cpus)` connects to the Ray cluster at
  `address` ("auto", "HOST:PORT", "ray://HOST:PORT"). Each instance is one `EngineActor` asking
  for `num_cpus` (Ray places it), which fills its command template on its node (the host it binds,
  `host` or the node's address; free ports there) and starts it as its child, leading a process
  group of its own. `launch(role)`: a kvherd agent (``python -m kvherd agent``,
  `command_of(instance_id, role)`) that registers itself with the proxy. `start(id, argv, env,
  ordinal)` and `placed(id)`: any engine from ``--launch`` (`scheduler.command_launcher.Engines`),
  added by the proxy. Ray is imported only here.
- The child dies with its actor (Linux parent-death signal, SIGTERM: an agent drains as on any
  SIGTERM). `alive(id)` is False once the child exited or the actor is lost (no blocking call);
  a lost actor is not restarted by Ray: the proxy removes its instance, and the autoscaler starts
  a replacement where the fleet is below what it needs.
- `retire(id)`: the actor sends its child's group SIGTERM and waits up to `stop_timeout_s`, then
  SIGKILLs the group; then the actor is killed. `stop(timeout)` retires them all.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import Callable
from typing import Any

from kvherd.parent_death import die_with_parent
from scheduler.command_launcher import fields_for, fill

HOST = "{host}"  # placeholders in an agent command: the host it binds, the port its actor picks
PORT = "{port}"
NAMESPACE = "kvherd"


class EngineActor:
    """One engine process on a Ray worker (a threaded actor: `wait` blocks one thread): the
    command template filled on its node (`scheduler.command_launcher.fill`: its host, free ports
    there, a CPU), run by the node's python when `python`, leading a process group of its own."""

    def __init__(
        self,
        command: list[str],
        env: dict[str, str],
        host: str | None,
        instance_id: str,
        ordinal: int,
        python: bool,
    ) -> None:
        if host is None:
            import ray

            host = ray.util.get_node_ip_address()
        with contextlib.ExitStack() as held:  # four distinct free ports on this node
            socks = [held.enter_context(socket.socket()) for _ in range(4)]
            for sock in socks:
                sock.bind((host, 0))  # the engine binds them a moment later
            ports = [sock.getsockname()[1] for sock in socks]
        self.fields = fields_for(instance_id, ports, ordinal, host)
        fd, self.log_path = tempfile.mkstemp(prefix=f"kvherd-ray-{instance_id}-", suffix=".log")
        argv = [sys.executable] if python else []
        argv += [fill(part, self.fields) for part in command]
        with os.fdopen(fd, "wb") as log_file:
            self.proc = subprocess.Popen(
                argv,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env={**os.environ, **env},
                start_new_session=True,
                preexec_fn=die_with_parent,
            )
        self.where = f"pid {self.proc.pid} on {socket.gethostname()}, log {self.log_path}"

    def placed(self) -> dict[str, str]:
        return self.fields

    def describe(self) -> str:
        return self.where

    def wait(self) -> int:
        return self.proc.wait()

    def terminate(self, timeout_s: float) -> int:
        self._signal(signal.SIGTERM)
        try:
            code = self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self._signal(signal.SIGKILL)
            code = self.proc.wait()
        self._signal(signal.SIGKILL)  # its group's members may outlive it (an engine's workers)
        return code

    def _signal(self, sig: signal.Signals) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, sig)


class RayLauncher:
    """The autoscaler's `Launcher` (and `kvherd up`'s agent group) on a Ray cluster."""

    def __init__(
        self,
        address: str,
        env: dict[str, str],
        host: str | None,
        command_of: Callable[[str, str], list[str]] | None = None,
        num_cpus: float = 1.0,
        stop_timeout_s: float = 30.0,
    ) -> None:
        import ray

        self._ray: Any = ray  # (its stubs type `remote` for functions only)
        if not ray.is_initialized():
            ray.init(address=address, namespace=NAMESPACE, log_to_driver=False)
        self._actor_class = self._ray.remote(max_concurrency=4, max_restarts=0)(EngineActor)
        self.command_of = command_of
        self.env = env
        self.host = host
        self.num_cpus = num_cpus
        self.stop_timeout_s = stop_timeout_s
        self.actors: dict[str, Any] = {}  # instance id -> its actor handle
        self._exits: dict[str, Any] = {}  # instance id -> the ref `wait` resolves when it ends
        self._next = 0

    @property
    def ids(self) -> list[str]:
        return list(self.actors)

    def launch(self, role: str = "mixed") -> str:
        """One kvherd agent (`command_of`), which registers itself."""
        assert self.command_of is not None, "RayLauncher(command_of=...) launches agents"
        instance_id = f"agent-{self._next}"
        self._start(instance_id, self.command_of(instance_id, role), self.env, self._next, True)
        self._next += 1
        return instance_id

    def start(self, instance_id: str, argv: list[str], env: dict[str, str], ordinal: int) -> None:
        """One engine from a command template (`scheduler.command_launcher.Engines`)."""
        self._start(instance_id, argv, env, ordinal, False)

    def _start(
        self, instance_id: str, argv: list[str], env: dict[str, str], ordinal: int, python: bool
    ) -> None:
        actor = self._actor_class.options(
            name=f"kvherd-{instance_id}", num_cpus=self.num_cpus
        ).remote(argv, env, self.host, instance_id, ordinal, python)
        self.actors[instance_id] = actor
        self._exits[instance_id] = actor.wait.remote()

    async def placed(self, instance_id: str) -> dict[str, str]:
        fields: dict[str, str] = await self.actors[instance_id].placed.remote()
        return fields

    def alive(self, instance_id: str) -> bool:
        ref = self._exits.get(instance_id)
        if ref is None:
            return False
        ended, _ = self._ray.wait([ref], timeout=0)
        return not ended

    def dead(self) -> list[str]:
        return [i for i in self.actors if not self.alive(i)]

    async def describe(self, instance_id: str) -> str:
        return str(await self.actors[instance_id].describe.remote())

    def log_hint(self, instance_id: str) -> str:
        return f"see its log (kvherd-ray-{instance_id}-*.log in its node's temp directory)"

    async def retire(self, instance_id: str) -> None:
        actor = self.actors.pop(instance_id, None)
        self._exits.pop(instance_id, None)
        if actor is None:
            return
        with contextlib.suppress(self._ray.exceptions.RayActorError):
            await actor.terminate.remote(self.stop_timeout_s)
        self._ray.kill(actor, no_restart=True)

    async def stop(self, timeout: float) -> None:
        self.stop_timeout_s = timeout
        await asyncio.gather(*(self.retire(i) for i in list(self.actors)))
