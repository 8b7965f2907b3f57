"""``kvherd up``: N local agents plus the proxy, in one command.

Starts the proxy and its admin API in this process, then N ``kvherd agent`` child processes on free
loopback ports below the kernel's ephemeral range (`agent_port`), each publishing KV events
(ephemeral ZMQ ports) and registering with the admin API.
Waits until all N are registered and healthy, prints the URLs (and the admin token when it was
generated), and runs until Ctrl-C or SIGTERM. Stopping is orderly: agents get SIGTERM (they drain
and deregister), any still alive after ``--stop-timeout`` seconds get SIGKILL, then the proxy stops.
Agents also die with this process if it is killed outright (Linux parent-death signal), so no agent
is ever orphaned.

The admin token is ``--admin-token``, else ``$KVHERD_ADMIN_TOKEN``, else a fresh random one. The
fleet token that guards the agents' ``/kvherd/v1/*`` control routes is ``--fleet-token``, else
``$KVHERD_FLEET_TOKEN``, else a fresh random one; the agents get it by their environment, the proxy
sends it.

Other engines: ``--launch COMMAND`` starts each instance from a command template instead (a vLLM or
SGLang server: `scheduler.command_launcher`), added to the fleet by the proxy once healthy.

P/D disaggregation: ``--prefill N --decode M`` starts N agents with ``--role prefill`` and M with
``--role decode`` (``-n K`` adds K mixed ones; without --prefill/--decode, -n defaults to 2).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import secrets
import socket
import sys
import tempfile
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from kvherd.fleet_token import FLEET_TOKEN_ENV, resolve
from scheduler.child_processes import ChildProcesses
from scheduler.serve_cli import ADMIN_TOKEN_ENV, add_proxy_arguments

if TYPE_CHECKING:
    from scheduler.autoscaler import AutoscaleLoop
    from scheduler.command_launcher import CommandGroup
    from scheduler.fleet import Fleet
    from scheduler.ray_launcher import RayLauncher


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "-n",
        "--num-instances",
        type=int,
        default=None,
        help="mixed agents to start (default 2, or 0 with --prefill/--decode)",
    )
    parser.add_argument("--prefill", type=int, default=0, help="agents with --role prefill")
    parser.add_argument("--decode", type=int, default=0, help="agents with --role decode")
    parser.add_argument("--model", default="tiny", help="'tiny', 'small' or a checkpoint directory")
    parser.add_argument(
        "--agent-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="extra argument for every agent (e.g. --agent-arg=--max-num-seqs=8); repeatable",
    )
    scaling = parser.add_argument_group(
        "autoscaling (--autoscale): agents started and removed by load, scheduler/autoscaler.py"
    )
    scaling.add_argument("--autoscale", action="store_true", help="grow and shrink the fleet")
    scaling.add_argument("--min", type=int, default=1, help="fewest agents (default 1)")
    scaling.add_argument("--max", type=int, default=4, help="most agents (default 4)")
    scaling.add_argument(
        "--target-utilization",
        type=float,
        default=0.75,
        help="requests in flight per agent's batch slot to size the fleet for (default 0.75)",
    )
    scaling.add_argument(
        "--autoscale-slots",
        type=int,
        default=None,
        help="batch slots of one agent (default: what the agents report)",
    )
    scaling.add_argument(
        "--scale-in-delay", type=float, default=10.0, help="seconds of low load before one goes"
    )
    scaling.add_argument(
        "--scale-cooldown", type=float, default=5.0, help="seconds after a change before the next"
    )
    scaling.add_argument(
        "--ray",
        metavar="ADDRESS",
        default=None,
        help="start each agent as a Ray actor on the cluster at ADDRESS ('auto', HOST:PORT), "
        "placed by Ray (scheduler/ray_launcher.py)",
    )
    scaling.add_argument(
        "--ray-num-cpus", type=float, default=1.0, help="CPUs each agent's actor asks Ray for"
    )
    engines = parser.add_argument_group(
        "other engines (--launch): vLLM, SGLang or any OpenAI server, scheduler/command_launcher.py"
    )
    engines.add_argument(
        "--launch",
        metavar="COMMAND",
        default=None,
        help="start each instance with COMMAND instead of a kvherd agent (with --ray, in a Ray "
        "actor); {id}, {host} (where it runs), {port}, {port1}..{port3} (fresh ports there) and "
        "{cpu} are filled in per instance",
    )
    engines.add_argument(
        "--launch-instance",
        metavar="INSTANCE",
        default="http://{host}:{port}",
        help="how the proxy reaches a launched instance, as an --instance value with the same "
        "placeholders (e.g. http://{host}:{port},kv_events=tcp://{host}:{port1})",
    )
    parser.add_argument("--log-dir", default=None, help="agent logs (default: a temp directory)")
    parser.add_argument("--startup-timeout", type=float, default=300.0)
    parser.add_argument("--stop-timeout", type=float, default=30.0)
    add_proxy_arguments(parser)


def _ephemeral_floor() -> int:
    with (
        contextlib.suppress(OSError, ValueError, IndexError),
        open("/proc/sys/net/ipv4/ip_local_port_range") as f,
    ):
        return int(f.read().split()[0])
    return 32768  # Linux's default


def agent_port(handed: set[int]) -> int:
    """A loopback port for an agent: free now, not in `handed` (added to it), below the kernel's
    ephemeral range. A port bind(0) picks is in that range, free only until the agent binds it
    seconds of imports later, and any outgoing connection may take it meanwhile; below it only
    another explicit bind competes."""
    floor = _ephemeral_floor()
    ports = range(15000, floor) if floor > 16000 else range(1024, max(floor, 2048))
    for _ in range(1000):
        port = random.choice(ports)
        if port in handed:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
        handed.add(port)
        return port
    raise RuntimeError(f"no free loopback port in {ports.start}-{ports.stop - 1}")


def agent_command(args: argparse.Namespace, instance_id: str, host: str, port: str, role: str) -> list[str]:
    """The ``kvherd agent`` arguments (after the interpreter) for one agent of this fleet."""
    return [
        "-m", "kvherd", "agent",
        "--model", args.model,
        "--host", host,
        "--port", port,
        "--instance-id", instance_id,
        "--kv-events-endpoint", f"tcp://{host}:*",
        "--kv-events-replay-endpoint", f"tcp://{host}:*",
        "--scheduler", f"http://{_admin_host(args)}:{args.admin_port}",
        "--role", role,
        *args.agent_arg,
    ]  # fmt: skip


def _admin_host(args: argparse.Namespace) -> str:
    host = args.admin_host
    return "127.0.0.1" if host in ("0.0.0.0", "::", "") else host


class AgentGroup(ChildProcesses):
    """The child agents: start, watch, stop (all, or one: the autoscaler's `Launcher`)."""

    def __init__(
        self, args: argparse.Namespace, token: str, fleet_token: str, log_dir: str
    ) -> None:
        super().__init__(log_dir, own_group=False)
        self.args = args
        self.token = token
        self.fleet_token = fleet_token
        self._handed = {args.port, args.admin_port}
        self._next = 0

    def launch(self, role: str = "mixed") -> str:
        instance_id = f"agent-{self._next}"
        self._next += 1
        env = {**os.environ, ADMIN_TOKEN_ENV: self.token, FLEET_TOKEN_ENV: self.fleet_token}
        port = str(agent_port(self._handed))
        cmd = [sys.executable, *agent_command(self.args, instance_id, "127.0.0.1", port, role)]
        self._start(instance_id, cmd, env)
        return instance_id

    async def retire(self, instance_id: str) -> None:
        await self._stop_children([instance_id], self.args.stop_timeout)

    async def stop(self, timeout: float) -> None:
        await self._stop_children(self.ids, timeout)


async def _up(args: argparse.Namespace) -> int:
    from kvherd.tokenizer import tokenizer_spec_for_model
    from scheduler.serve_cli import serve_fleet

    # The proxy tokenizes like the agents: the checkpoint's tokenizer, or the byte tokenizer.
    args.tokenizer = args.tokenizer or [tokenizer_spec_for_model(args.model)]
    token = args.admin_token or os.environ.get(ADMIN_TOKEN_ENV)
    generated = not token
    token = token or secrets.token_urlsafe(24)
    args.admin_token = token
    args.fleet_token = resolve(args.fleet_token) or secrets.token_urlsafe(24)
    log_dir = args.log_dir or tempfile.mkdtemp(prefix="kvherd-up-")
    os.makedirs(log_dir, exist_ok=True)
    agents: AgentGroup | RayLauncher | CommandGroup
    commands: CommandGroup | None = None
    loopback = _admin_host(args) in ("127.0.0.1", "localhost", "::1")
    ray_host = "127.0.0.1" if loopback else None  # a loopback proxy: a one-node cluster
    tokens = {ADMIN_TOKEN_ENV: token, FLEET_TOKEN_ENV: args.fleet_token}
    if args.launch:
        from scheduler.command_launcher import CommandGroup, Engines, LocalEngines

        engines: Engines
        if args.ray:
            from scheduler.ray_launcher import RayLauncher

            engines = RayLauncher(args.ray, tokens, ray_host, num_cpus=args.ray_num_cpus,
                                  stop_timeout_s=args.stop_timeout)  # fmt: skip
            env = tokens  # (the actor adds its node's environment)
        else:
            handed = {args.port, args.admin_port}
            engines = LocalEngines(log_dir, lambda: agent_port(handed), args.stop_timeout)
            env = {**os.environ, **tokens}
        agents = CommandGroup(
            args.launch,
            args.launch_instance,
            engines,
            env,
            stop_timeout_s=args.stop_timeout,
            ready_timeout_s=args.startup_timeout,
        )
        commands = agents
    elif args.ray:
        from scheduler.ray_launcher import HOST, PORT, RayLauncher

        agents = RayLauncher(
            args.ray,
            tokens,
            ray_host,
            lambda instance_id, role: agent_command(args, instance_id, HOST, PORT, role),
            num_cpus=args.ray_num_cpus,
            stop_timeout_s=args.stop_timeout,
        )
    else:
        agents = AgentGroup(args, token, args.fleet_token, log_dir)
    stop = asyncio.Event()
    failure: list[str] = []

    async def on_ready(fleet: Fleet) -> None:
        if commands is not None:  # launched engines are added by the proxy, not self-registered
            commands.bind(fleet, not args.no_kv_events, args.fleet_token, tokenizer_named(args))
        for role in args.roles:
            agents.launch(role)
        deadline = time.monotonic() + args.startup_timeout
        while fleet.num_dispatchable() < args.num_instances:
            dead = agents.dead()
            if dead or time.monotonic() > deadline or stop.is_set():
                if dead:
                    failure.append(f"{dead[0]} exited; {agents.log_hint(dead[0])}")
                elif not stop.is_set():
                    failure.append(f"agents not ready after {args.startup_timeout}s ({log_dir})")
                stop.set()
                return
            await asyncio.sleep(0.1)  # registrations arrive through the admin API
        host = "127.0.0.1" if args.host in ("0.0.0.0", "::") else args.host
        lines = [
            f"kvherd up: {args.num_instances} agents ready (model {args.model})",
            f"  OpenAI API  http://{host}:{args.port}/v1",
            f"  admin API   http://{args.admin_host}:{args.admin_port}/admin/v1/instances",
            f"  metrics     http://{host}:{args.port}/metrics",
        ]
        if generated:
            lines.append(f"  admin token {token}  (set {ADMIN_TOKEN_ENV} to choose one)")
        for instance_id in agents.ids:
            inst = fleet.instances[instance_id]
            where = await agents.describe(instance_id)
            lines.append(f"  agent       {instance_id} {inst.url} ({where})")
        if not args.ray:
            lines.append(f"  agent logs  {log_dir}")
        if args.autoscale:
            scaler = await _autoscaler(args, fleet, agents)
            scaling.append(asyncio.create_task(scaler.run()))
            slots = scaler.core.settings.slots
            lines.append(f"  autoscale   {args.min}..{args.max} agents, {slots} batch slots each")
        lines.append("Ctrl-C or SIGTERM stops everything.")
        print("\n".join(lines), flush=True)

    scaling: list[asyncio.Task[None]] = []

    async def before_shutdown() -> None:
        for task in scaling:
            task.cancel()
        await agents.stop(args.stop_timeout)

    try:
        code = await serve_fleet(
            args, on_ready=on_ready, stop=stop, before_shutdown=before_shutdown
        )
    finally:
        await agents.stop(args.stop_timeout)
    if failure:
        print(f"kvherd up: {failure[0]}", file=sys.stderr)
        return 1
    return code


def tokenizer_named(args: argparse.Namespace) -> Callable[[str | None], bool]:
    """Whether a ``--tokenizer`` covers a model (its own or the default)."""
    from scheduler.proxy.model_tokenizers import ModelTokenizers, parse_tokenizer_specs

    return ModelTokenizers.load(parse_tokenizer_specs(args.tokenizer)).named


async def _autoscaler(
    args: argparse.Namespace, fleet: Fleet, agents: AgentGroup | RayLauncher | CommandGroup
) -> AutoscaleLoop:
    from scheduler.autoscaler import AutoscaleLoop
    from scheduler.core.autoscale import AutoscaleSettings

    deadline = time.monotonic() + 10.0
    while not args.autoscale_slots and time.monotonic() < deadline:
        if all(fleet.cluster.get(i).report_time is not None for i in agents.ids):
            break
        await asyncio.sleep(0.05)  # the agents' first load reports state their batch slots
    reported = sorted(fleet.cluster.get(i).view().batch_slots for i in agents.ids)
    slots = args.autoscale_slots or reported[len(reported) // 2] or 8
    settings = AutoscaleSettings(
        min_instances=args.min,
        max_instances=args.max,
        slots=slots,
        target_utilization=args.target_utilization,
        scale_out_cooldown_s=args.scale_cooldown,
        scale_in_delay_s=args.scale_in_delay,
        scale_in_cooldown_s=args.scale_cooldown,
    )
    scaler = AutoscaleLoop(fleet, agents, settings, start_timeout_s=args.startup_timeout)
    scaler.owned.update(agents.ids)
    return scaler


def _launch_error(args: argparse.Namespace) -> str | None:
    """Why the --launch flags cannot work, before anything starts."""
    from scheduler.command_launcher import check_templates

    if args.prefill or args.decode:
        return "--launch starts mixed instances: not with --prefill or --decode"
    return check_templates(args.launch, args.launch_instance)


def run(args: argparse.Namespace) -> int:
    from scheduler.serve_cli import configure_logging, run_loop

    if args.launch and (message := _launch_error(args)):
        print(f"kvherd up: {message}", file=sys.stderr)
        return 2
    if args.autoscale:
        if args.prefill or args.decode:
            print("kvherd up: --autoscale starts mixed agents only", file=sys.stderr)
            return 2
        try:
            from scheduler.core.autoscale import AutoscaleSettings

            AutoscaleSettings(args.min, args.max, target_utilization=args.target_utilization)
        except ValueError as exc:
            print(f"kvherd up: --autoscale: {exc}", file=sys.stderr)
            return 2
        if args.num_instances is None:
            args.num_instances = args.min
    if args.num_instances is None:
        args.num_instances = 0 if args.prefill or args.decode else 2
    if min(args.num_instances, args.prefill, args.decode) < 0:
        print("kvherd up: -n, --prefill and --decode must not be negative", file=sys.stderr)
        return 2
    args.roles = (
        ["prefill"] * args.prefill + ["decode"] * args.decode + ["mixed"] * args.num_instances
    )
    if not args.roles:
        print("kvherd up: start at least one agent (-n, --prefill, --decode)", file=sys.stderr)
        return 2
    args.num_instances = len(args.roles)
    configure_logging(args.log_level)
    return run_loop(_up(args))
