"""Agents as Ray actors: ``kvherd up --ray ADDRESS``'s launcher (`pip install kvherd[plan]`).

Contract:
- `RayLauncher(address, command_of, env, num_cpus)` connects to the Ray cluster at `address`
  ("auto", "HOST:PORT", "ray://HOST:PORT"). `launch(role)` creates one `AgentActor` asking for
  `num_cpus` (Ray places it); the actor picks a free port on its node, starts ``python -m kvherd
  agent`` there as its child (`command_of(instance_id, role)`, `HOST` and `PORT` replaced by the
  host it binds, `host` or the node's address, and that port) and the agent registers itself
  with the proxy. Ray is imported only here.
- The child dies with its actor (Linux parent-death signal, SIGTERM: it drains as on any
  SIGTERM). `alive(id)` is False once the child exited or the actor is lost (no blocking call);
  a lost actor is not restarted by Ray: its agent stops heartbeating, the proxy removes it, and
  the autoscaler starts a replacement where the fleet is below what it needs.
- `retire(id)`: the actor sends its child SIGTERM (drain, migration, hand-over) and waits up to
  `stop_timeout_s`, then kills it; then the actor is killed. `stop(timeout)` retires them all.
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

HOST = "{host}"  # placeholders in an agent command: the host it binds, the port its actor picks
PORT = "{port}"
NAMESPACE = "kvherd"


class AgentActor:
    """One agent process on a Ray worker (a threaded actor: `wait` blocks one thread)."""

    def __init__(self, command: list[str], env: dict[str, str], host: str | None) -> None:
        if host is None:
            import ray

            host = ray.util.get_node_ip_address()
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind((host, 0))  # a free port on this node; the agent binds it a moment later
            port = sock.getsockname()[1]
        fd, self.log_path = tempfile.mkstemp(prefix="kvherd-ray-agent-", suffix=".log")
        argv = [sys.executable]
        argv += [part.replace(HOST, host).replace(PORT, str(port)) for part in command]
        with os.fdopen(fd, "wb") as log_file:
            self.proc = subprocess.Popen(
                argv,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env={**os.environ, **env},
                preexec_fn=die_with_parent,
            )
        self.where = f"pid {self.proc.pid} on {socket.gethostname()}, log {self.log_path}"

    def describe(self) -> str:
        return self.where

    def wait(self) -> int:
        return self.proc.wait()

    def terminate(self, timeout_s: float) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()


class RayLauncher:
    """The autoscaler's `Launcher` (and `kvherd up`'s agent group) on a Ray cluster."""

    def __init__(
        self,
        address: str,
        command_of: Callable[[str, str], list[str]],
        env: dict[str, str],
        host: str | None,
        num_cpus: float = 1.0,
        stop_timeout_s: float = 30.0,
    ) -> None:
        import ray

        self._ray: Any = ray  # (its stubs type `remote` for functions only)
        if not ray.is_initialized():
            ray.init(address=address, namespace=NAMESPACE, log_to_driver=False)
        self._actor_class = self._ray.remote(max_concurrency=4, max_restarts=0)(AgentActor)
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
        instance_id = f"agent-{self._next}"
        self._next += 1
        actor = self._actor_class.options(
            name=f"kvherd-{instance_id}", num_cpus=self.num_cpus
        ).remote(self.command_of(instance_id, role), self.env, self.host)
        self.actors[instance_id] = actor
        self._exits[instance_id] = actor.wait.remote()
        return instance_id

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
        return "see its log (kvherd-ray-agent-*.log in its node's temp directory)"

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
