"""Child processes of one command (``kvherd up``'s agents, or engines from a template).

Contract:
- `ChildProcesses(log_dir, own_group)`: `_start(id, argv, env)` launches one, its output in
  ``LOG_DIR/ID.log``, with the parent-death signal (it dies with this process). With
  ``own_group`` it leads a process group of its own and every signal goes to the whole group (an
  engine's workers share it and may outlive it).
- `ids`, `alive(id)`, `dead()`, `describe(id)` (its pid), `log_hint(id)`: what `kvherd up` and the
  autoscaler's launchers report.
- `_terminate(id)`: SIGTERM; `_stop_children(ids, timeout)`: SIGTERM, then SIGKILL whatever is left
  after `timeout`; every one is reaped when it returns.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import time

from kvherd.parent_death import die_with_parent


def _new_group() -> None:
    os.setsid()
    die_with_parent()


class ChildProcesses:
    def __init__(self, log_dir: str, own_group: bool) -> None:
        self.log_dir = log_dir
        self.own_group = own_group
        self.procs: dict[str, subprocess.Popen[bytes]] = {}  # instance id -> its process
        self.log_paths: dict[str, str] = {}

    def _start(self, instance_id: str, argv: list[str], env: dict[str, str]) -> None:
        path = os.path.join(self.log_dir, f"{instance_id}.log")
        with open(path, "wb") as log_file:  # the child keeps its own descriptor
            self.procs[instance_id] = subprocess.Popen(
                argv,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                preexec_fn=_new_group if self.own_group else die_with_parent,
            )
        self.log_paths[instance_id] = path

    @property
    def ids(self) -> list[str]:
        return list(self.procs)

    async def describe(self, instance_id: str) -> str:
        return f"pid {self.procs[instance_id].pid}"

    def log_hint(self, instance_id: str) -> str:
        return f"see {self.log_paths[instance_id]}"

    def alive(self, instance_id: str) -> bool:
        proc = self.procs.get(instance_id)
        return proc is not None and proc.poll() is None

    def dead(self) -> list[str]:
        return [i for i, proc in self.procs.items() if proc.poll() is not None]

    def _signal(self, proc: subprocess.Popen[bytes], sig: signal.Signals) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            if self.own_group:
                os.killpg(proc.pid, sig)
            elif proc.poll() is None:
                proc.send_signal(sig)

    def _terminate(self, instance_id: str) -> None:
        self._signal(self.procs[instance_id], signal.SIGTERM)

    async def _stop_children(self, ids: list[str], timeout: float) -> None:
        procs = [self.procs[i] for i in ids]
        for proc in procs:
            if proc.poll() is None:
                self._signal(proc, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while any(proc.poll() is None for proc in procs) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)  # children exit on their own schedule; no event to await
        for proc in procs:
            self._signal(proc, signal.SIGKILL)  # a group: its members may outlive its leader
            proc.wait()
