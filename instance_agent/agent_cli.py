"""`kvherd agent`: run one engine instance as a fleet member (OpenAI API, metrics, KV events).

Contract:
- Serves `server.create_app` with uvicorn (uvloop, httptools) on ``--host``/``--port``.
- ``--kv-events-endpoint tcp://*:PORT`` publishes KV events (ZMQ PUB, vLLM wire format); the replay
  ROUTER binds ``--kv-events-replay-endpoint`` (default: the same host, PORT + 1). ``tcp://HOST:*``
  binds ephemeral ports (reported in the log and to the scheduler).
- ``--scheduler URL`` registers with the scheduler's admin API (see `registration`), heartbeats and
  deregisters on shutdown; the bearer token comes from ``$KVHERD_ADMIN_TOKEN``.
- Live migration (``/kvherd/v1/migrate`` and the destination endpoints, see `migration_routes`) is
  always mounted; KV bytes move over gloo from ``--advertise-host``.
- The control routes (``/kvherd/v1/*``: migration, stream follow and resume, the state with its
  block hashes) require ``Authorization: Bearer FLEET_TOKEN`` when a fleet token is given
  (``--fleet-token`` or ``$KVHERD_FLEET_TOKEN``); this agent sends it to other agents too. Without
  one they are open, which is allowed only on a loopback bind: an agent bound to any other address
  without a token refuses to start unless ``--no-fleet-token`` says the network is trusted.
- SIGTERM drains: new requests get 503, open requests finish (aborted after ``--drain-timeout``
  seconds), then the process exits 0. With ``--scheduler``, the scheduler hears "draining" at once
  and migrates the running requests to other instances, so the drain takes a migration, not the
  rest of every generation; then it asks the scheduler to have survivors pull its hot prefixes
  (the hand-over) before it exits. SIGINT stops at once (uvicorn's usual behaviour).
- ``--role prefill|decode|mixed`` (P/D disaggregation, default mixed) is reported in the state
  snapshot and the registration; a prefill agent hands requests to their decode instance after
  the first token (`pd_handoff`), and a decode agent takes up to `DECODE_MAX_INCOMING` incoming
  migrations at once (others: one, like Llumnix).
- KV tiers: ``--num-cpu-blocks N`` keeps blocks the GPU pool evicts in host memory, and
  ``--disk-kv-dir DIR --num-disk-blocks N`` below that in one preallocated, memory-mapped file per
  agent (``DIR/kvherd-kv-<instance id>.bin``); a prompt whose prefix sits on a lower tier loads it
  back instead of recomputing it. The KV events name each block's tier (``medium``).
- LoRA: ``--lora-modules NAME=DIR [NAME=DIR ...]`` (repeatable, vLLM's syntax) serves PEFT adapters
  of the model; a request whose ``model`` is NAME runs with it, and ``/v1/models`` lists them with
  ``parent`` (the served model name) as vLLM does. ``--max-loras N``: adapter slots (default one
  per adapter). A malformed flag or a bad adapter directory refuses to start, naming it.
  ``--allow-runtime-lora`` adds vLLM's load/unload routes (`lora_routes`) and says so on registration.
- Warm restart: the disk tier survives the agent. Its manifest (``DIR/kvherd-kv-<instance
  id>.json``, see `kv_manifest`) lists the file's blocks; an agent started on the same folder
  with the same instance id (the default, HOSTNAME:PORT, needs the same port), model, dtype, block
  size and number of disk blocks starts with them on disk and publishes their stores
  (``medium="STORAGE"``) as its first KV event batch, replay included, before serving; any other
  setting discards them with a WARNING naming what changed.
"""

from __future__ import annotations

import argparse
import gc
import ipaddress
import logging
import os
import re
import socket
from typing import Any

log = logging.getLogger("kvherd.agent")

DECODE_MAX_INCOMING = 4  # handoffs a decode agent receives at once (from several prefill agents)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="tiny", help="'tiny', 'small' or a checkpoint directory")
    parser.add_argument("--served-model-name", default=None, help="model name clients send")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument(
        "--pull-port",
        type=int,
        default=0,
        help="port of the block server other agents pull prefixes from (default: any free one)",
    )
    parser.add_argument(
        "--otlp-endpoint",
        default=None,
        metavar="URL",
        help="export OpenTelemetry spans of each request's queue, prefill and decode here over "
        "OTLP/HTTP (for requests that come with a traceparent; needs kvherd[tracing]); default off",
    )
    parser.add_argument(
        "--pull-timeout",
        type=float,
        default=10.0,
        help="seconds a prefix pull may take before it is given up and the prefix recomputed",
    )
    parser.add_argument("--instance-id", default=None, help="default: HOSTNAME:PORT")
    parser.add_argument(
        "--advertise-host", default=None, help="host the scheduler reaches this agent at"
    )
    parser.add_argument("--kv-events-endpoint", default=None, help="ZMQ PUB bind address")
    parser.add_argument("--kv-events-replay-endpoint", default=None, help="ZMQ ROUTER bind address")
    parser.add_argument("--kv-events-topic", default="", help="topic frame of every KV event batch")
    parser.add_argument(
        "--kv-events-buffer", type=int, default=10_000, help="batches kept for replay"
    )
    parser.add_argument("--scheduler", default=None, help="scheduler base URL to register with")
    parser.add_argument(
        "--fleet-token",
        default=None,
        help="token the /kvherd/v1/* control routes require (default: $KVHERD_FLEET_TOKEN)",
    )
    parser.add_argument(
        "--no-fleet-token",
        action="store_true",
        help="serve the control routes without a token on a non-loopback bind (trusted networks)",
    )
    parser.add_argument(
        "--role",
        choices=("prefill", "decode", "mixed"),
        default="mixed",
        help="P/D disaggregation: what the proxy sends here (default mixed: both phases)",
    )
    parser.add_argument("--heartbeat-interval", type=float, default=2.0)
    parser.add_argument("--drain-timeout", type=float, default=600.0)
    engine = parser.add_argument_group("engine")
    engine.add_argument("--seed", type=int, default=0, help="weights seed of random-init presets")
    engine.add_argument("--block-size", type=int, default=16)
    engine.add_argument("--num-gpu-blocks", type=int, default=None)
    engine.add_argument("--kv-cache-bytes", type=int, default=256 * 1024 * 1024)
    engine.add_argument("--max-num-seqs", type=int, default=64)
    engine.add_argument("--max-num-batched-tokens", type=int, default=2048)
    engine.add_argument("--max-model-len", type=int, default=None)
    engine.add_argument("--no-prefix-caching", action="store_true")
    engine.add_argument(
        "--num-cpu-blocks", type=int, default=0, help="host-memory KV tier, in blocks (0: none)"
    )
    engine.add_argument("--disk-kv-dir", default=None, help="folder of the disk KV tier's file")
    engine.add_argument(
        "--num-disk-blocks", type=int, default=0, help="disk KV tier, in blocks (0: none)"
    )
    engine.add_argument(
        "--lora-modules",
        action="extend",
        nargs="+",
        default=[],
        metavar="NAME=DIR",
        help="a PEFT LoRA adapter to serve as model NAME (repeatable)",
    )
    engine.add_argument(
        "--max-loras", type=int, default=None, help="LoRA adapter slots (default: one per adapter)"
    )
    parser.add_argument(
        "--allow-runtime-lora",
        action="store_true",
        help="serve vLLM's POST /v1/load_lora_adapter and /v1/unload_lora_adapter",
    )
    engine.add_argument("--device", default=None)
    engine.add_argument("--dtype", default="auto")
    engine.add_argument(
        "--torch-threads", type=int, default=None, help="intra-op CPU threads (default: torch's)"
    )
    parser.add_argument("--log-level", default="info")
    parser.add_argument("--access-log", action="store_true")


def _replay_default(endpoint: str) -> str:
    match = re.fullmatch(r"(.*):(\d+)", endpoint)
    if match:
        return f"{match.group(1)}:{int(match.group(2)) + 1}"
    return endpoint  # a wildcard port binds another ephemeral port


def _advertised(endpoint: str | None, host: str) -> str | None:
    """A bound ZMQ address as a peer should connect to it (wildcard host replaced)."""
    if endpoint is None:
        return None
    return re.sub(r"^tcp://(\*|0\.0\.0\.0|\[::\]|::)(?=:)", f"tcp://{host}", endpoint)


def parse_lora_modules(specs: list[str], served_name: str) -> dict[str, str]:
    """``NAME=DIR`` flags as {name: directory}; `ValueError` naming a malformed or clashing one."""
    modules: dict[str, str] = {}
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--lora-modules {spec!r}: expected NAME=DIR")
        if name in modules or name == served_name:
            raise ValueError(f"--lora-modules {spec!r}: the name {name!r} is already served")
        modules[name] = path
    return modules


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def run(args: argparse.Namespace) -> int:
    import uvicorn
    import zmq

    from instance_agent.engine.llm_engine import EngineConfig, LLMEngine
    from instance_agent.engine_loop import EngineLoop
    from instance_agent.kv_publisher import KVEventPublisher
    from instance_agent.lora_routes import create_lora_router
    from instance_agent.metrics import AgentMetrics
    from instance_agent.migration_routes import (
        MigrationService,
        MigrationSettings,
        create_migration_router,
    )
    from instance_agent.pd_handoff import PDHandoffs
    from instance_agent.prefix_pull import PrefixPulls
    from instance_agent.registration import Registrar
    from instance_agent.server import Agent, DrainingServer, create_app
    from kvherd.fd_limit import raise_fd_limit
    from kvherd.fleet_token import FLEET_TOKEN_ENV, resolve

    raise_fd_limit()  # every client, peer and KV event socket holds a descriptor

    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    fleet_token = resolve(args.fleet_token)
    if fleet_token is None and not _is_loopback(args.host) and not args.no_fleet_token:
        log.error(
            "refusing to serve the control routes on %s without a fleet token: give "
            "--fleet-token or $%s (or --no-fleet-token on a trusted network)",
            args.host,
            FLEET_TOKEN_ENV,
        )
        return 2
    wildcard = args.host in ("0.0.0.0", "::", "")
    advertise_host = args.advertise_host or (socket.gethostname() if wildcard else args.host)
    instance_id = args.instance_id or f"{socket.gethostname()}:{args.port}"
    served_name = args.served_model_name or args.model
    if (args.num_disk_blocks > 0) != (args.disk_kv_dir is not None):
        log.error("a disk KV tier needs both --disk-kv-dir and --num-disk-blocks")
        return 2
    if min(args.num_cpu_blocks, args.num_disk_blocks) < 0:
        log.error("--num-cpu-blocks and --num-disk-blocks must be >= 0")
        return 2
    try:
        lora_modules = parse_lora_modules(args.lora_modules, served_name)
    except ValueError as exc:
        log.error("%s", exc)
        return 2
    disk_kv_file = (
        os.path.join(
            args.disk_kv_dir, f"kvherd-kv-{re.sub(r'[^A-Za-z0-9_.-]', '_', instance_id)}.bin"
        )
        if args.disk_kv_dir is not None
        else None
    )

    config = EngineConfig(
        model=args.model,
        seed=args.seed,
        block_size=args.block_size,
        num_gpu_blocks=args.num_gpu_blocks,
        kv_cache_bytes=args.kv_cache_bytes,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        enable_prefix_caching=not args.no_prefix_caching,
        device=args.device,
        dtype=args.dtype,
        num_cpu_blocks=args.num_cpu_blocks,
        disk_kv_file=disk_kv_file,
        num_disk_blocks=args.num_disk_blocks,
        lora_modules=lora_modules,
        max_loras=args.max_loras,
    )
    if args.torch_threads is not None:
        import torch

        torch.set_num_threads(args.torch_threads)
    try:
        engine = LLMEngine(config)
    except (ValueError, OSError) as exc:  # a bad --model or engine setting: say so, no traceback
        log.error("cannot start the engine: %s", exc)
        return 2
    publisher = None
    if args.kv_events_endpoint:
        replay = args.kv_events_replay_endpoint or _replay_default(args.kv_events_endpoint)
        try:
            publisher = KVEventPublisher(
                args.kv_events_endpoint,
                replay,
                topic=args.kv_events_topic,
                buffer_steps=args.kv_events_buffer,
            )
        except zmq.ZMQError as exc:
            log.error(
                "cannot bind KV event sockets %s / %s: %s", args.kv_events_endpoint, replay, exc
            )
            return 2
        log.info("KV events on %s (replay %s)", publisher.endpoint, publisher.replay_endpoint)
    bm = engine.block_manager
    metrics = AgentMetrics(
        served_name,
        {
            "block_size": str(bm.block_size),
            "num_gpu_blocks": str(bm.num_blocks),
            "enable_prefix_caching": str(config.enable_prefix_caching),
            "cache_dtype": str(config.dtype),
        },
    )
    engine_loop = EngineLoop(engine, publisher=publisher, metrics=metrics)
    if args.otlp_endpoint is not None:
        from kvherd import otlp

        try:
            otlp.check_endpoint(args.otlp_endpoint)
            from instance_agent.tracing import AgentTracing

            engine_loop.tracing = AgentTracing(otlp.exporter(args.otlp_endpoint), instance_id)
        except (ValueError, ImportError) as exc:
            log.error("%s", exc)
            return 2
    try:
        pulls = PrefixPulls(
            engine_loop, args.host, advertise_host, args.pull_port, args.pull_timeout, fleet_token
        )
    except OSError as exc:
        log.error("cannot bind the prefix-pull block server on port %d: %s", args.pull_port, exc)
        return 2
    agent = Agent(
        engine_loop=engine_loop,
        metrics=metrics,
        instance_id=instance_id,
        served_model_name=served_name,
        model_root=args.model,
        role=args.role,
        pulls=pulls,
        runtime_lora=args.allow_runtime_lora,
    )
    if args.scheduler:

        async def load_summary() -> dict[str, Any]:
            state = await agent.state()
            return {
                "instance_id": instance_id,
                **{
                    k: state[k]
                    for k in (
                        "num_running",
                        "num_waiting",
                        "kv_usage",
                        "free_blocks",
                        "freeness",
                        "last_kv_event_seq",
                        "draining",
                        "role",
                    )
                },
            }

        agent.registrar = Registrar(
            args.scheduler,
            {
                "instance_id": instance_id,
                "url": f"http://{advertise_host}:{args.port}",
                "kv_events_endpoint": _advertised(
                    publisher.endpoint if publisher else None, advertise_host
                ),
                "replay_endpoint": _advertised(
                    publisher.replay_endpoint if publisher else None, advertise_host
                ),
                "model": served_name,
                "block_size": bm.block_size,
                "role": args.role,
                "pull_address": pulls.address,
                "runtime_lora": args.allow_runtime_lora,
            },
            load_summary,
            heartbeat_s=args.heartbeat_interval,
        )

    # A decode instance takes handoffs from several prefill instances at once.
    settings = (
        MigrationSettings(max_incoming=DECODE_MAX_INCOMING) if args.role == "decode" else None
    )
    migration = MigrationService(
        engine_loop,
        instance_id,
        advertise_host,
        settings,
        fleet_token=fleet_token,
        served_model=served_name,
    )
    agent.handoffs = PDHandoffs(migration, fleet_token, args.role)
    routers = [create_migration_router(migration)]
    if args.allow_runtime_lora:
        routers.append(create_lora_router(agent, fleet_token))
    app = create_app(agent, routers=routers, fleet_token=fleet_token)
    uv_config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        loop="uvloop",
        http="httptools",
        log_level=args.log_level.lower(),
        access_log=args.access_log,
        timeout_graceful_shutdown=5,
    )
    server = DrainingServer(uv_config, agent, args.drain_timeout)
    try:
        server.run()
    finally:
        if publisher is not None:
            publisher.close()
        pulls.close()
        if engine_loop.tracing is not None:
            engine_loop.tracing.shutdown()
        engine.close()
    # Everything is closed; skip the interpreter's final garbage collection over the model and
    # the web stack, which takes seconds and only delays the exit an orchestrator waits for.
    gc.disable()
    gc.freeze()
    return 0
