"""``kvherd serve``: the KV-aware reverse proxy (client port) and its admin API (admin port).

Instances come from ``--instance`` (repeatable), the config file's ``instances`` list, and admin
registrations. An ``--instance`` value is a base URL, optionally followed by comma-separated
``key=value`` options: ``kv_events=tcp://H:P`` (the engine binds its PUB there: vLLM with
``tcp://*:P``), ``kv_events_bind=tcp://H:P`` (kvherd binds a SUB there for this one engine, which
connects its PUB: vLLM with ``tcp://H:P``), ``topic=T`` (its events arrive on the shared
``--kv-events-bind`` endpoint with vLLM topic T), ``replay=tcp://H:P``, ``block_size=N`` (overrides
what the instance reports), ``id=NAME``, ``role=prefill|decode|mixed`` (P/D disaggregation;
overrides the role the instance reports), ``max_num_seqs=N`` (its batch slots, for an engine that
does not report them, as vLLM does not: admission then counts what is there beyond them as
queued), ``pull_address=tcp://H:P`` (a vLLM's kvherd connector block server: ``--prefix-pull``
may pull from it; a kvherd agent reports its own), e.g.
``--instance http://10.0.0.5:8000,kv_events=tcp://10.0.0.5:5557,replay=tcp://10.0.0.5:5558``.
Without any of the three the instance is routed with the approximate prefix index. A plain vLLM's
block size is read from its ``vllm:cache_config_info`` at start-up; one that differs from its
model's stops ``kvherd serve`` with a message naming both.

``--config FILE`` (YAML) may set ``policy`` (a spec string, or ``{name, parameters}``),
``instances`` (URLs or mappings with ``url``, ``id``, ``kv_events_endpoint``, ``replay_endpoint``),
``api_keys`` (``KEY[=TENANT]`` strings) and ``allow_register`` (patterns); command-line flags
win. A file holding an llm-d style pipeline (``schedulingProfiles`` or ``scorers``) is the policy.

The admin API always requires a token: ``--admin-token`` or ``KVHERD_ADMIN_TOKEN``. Agents started
with a fleet token (``kvherd agent --fleet-token``) guard their ``/kvherd/v1/*`` control routes with
it: give the proxy the same one (``--fleet-token`` or ``KVHERD_FLEET_TOKEN``) and it sends it to
them (state polls, migration orders, stream resumes).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import logging
import os
import signal
import socket
import sys
from collections.abc import Awaitable, Callable, Coroutine, Iterator
from typing import TYPE_CHECKING, Any

from scheduler.core.admission_flags import add_admission_arguments, admission_settings

if TYPE_CHECKING:
    from scheduler.core.prefix_pull import PullSettings
    from scheduler.fleet import Fleet, InstanceSpec

log = logging.getLogger("kvherd.serve")

ADMIN_TOKEN_ENV = "KVHERD_ADMIN_TOKEN"


class _DeadlineRange(argparse.Action):
    """``FLOOR CAP`` seconds with 0 < FLOOR <= CAP (finite): anything else is a usage error."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        floor, cap = values
        if not 0 < floor <= cap < float("inf"):
            parser.error(f"{option_string}: need 0 < FLOOR <= CAP seconds, got {floor:g} {cap:g}")
        setattr(namespace, self.dest, [floor, cap])


def add_proxy_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags shared by ``kvherd serve`` and ``kvherd up``, grouped by topic in ``--help``."""
    policy = parser.add_argument_group("policies and migration")
    front = parser.add_argument_group("listening, keys and tenants")
    models = parser.add_argument_group("models, tokenizers and the KV-event index")
    health = parser.add_argument_group("retries, deadlines and health")
    logs = parser.add_argument_group("logging and tracing")
    policy.add_argument("--policy", default=None, help="dispatch policy: name, module:attr or YAML")
    policy.add_argument(
        "--policy-module",
        action="append",
        default=[],
        metavar="MODULE",
        help="a module whose policies the admin API may load as MODULE:NAME; repeatable "
        "(the admin API loads built-in names and kvherd.policies entry points regardless)",
    )
    policy.add_argument(
        "--policy-dir",
        default=None,
        metavar="DIR",
        help="the directory whose YAML pipelines the admin API may load (default: none)",
    )
    policy.add_argument(
        "--policy-param",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="dispatch policy parameter (value parsed as YAML); repeatable",
    )
    policy.add_argument(
        "--migration-policy",
        default="llumnix",
        help="live-migration policy: llumnix (default), defrag, drain, module:attr, or none "
        "(no automatic migration; draining instances are still emptied)",
    )
    policy.add_argument("--migration-interval", type=float, default=1.0, help="seconds per tick")
    policy.add_argument(
        "--peer",
        action="append",
        default=[],
        metavar="ADMIN_URL",
        help="another kvherd serve replica in front of the same instances (its admin URL, the "
        "same --admin-token): their in-flight charges count in this one's load view; repeatable",
    )
    policy.add_argument(
        "--peer-interval", type=float, default=0.1, help="seconds between reads of the peers"
    )
    policy.add_argument(
        "--no-handover",
        action="store_true",
        help="scale-in: do not have survivors pull a leaving agent's prefixes (they are lost)",
    )
    policy.add_argument(
        "--slow-start",
        type=float,
        default=0.0,
        metavar="S",
        help="scale-out: ramp a launched instance's share of its batch slots from a quarter to "
        "all over S seconds (0: at once, the default)",
    )
    policy.add_argument(
        "--pd-policy",
        default="kvherd",
        help="P/D pairing policy, used while some instance has role prefill or decode: "
        "kvherd (default), llmd, dynamo or module:attr",
    )
    parser.add_argument("--config", default=None, help="YAML config file (see kvherd serve --help)")
    front.add_argument("--host", default="127.0.0.1", help="client-facing bind address")
    front.add_argument("--port", type=int, default=8000)
    front.add_argument("--admin-host", default="127.0.0.1")
    front.add_argument("--admin-port", type=int, default=8001)
    front.add_argument("--admin-token", default=None, help=f"default: ${ADMIN_TOKEN_ENV}")
    front.add_argument(
        "--fleet-token",
        default=None,
        help="token of the agents' /kvherd/v1/* control routes (default: $KVHERD_FLEET_TOKEN)",
    )
    front.add_argument(
        "--allow-register",
        action="append",
        default=None,
        metavar="PATTERN",
        help="hosts allowed to register: CIDR, name or glob (default: loopback only); repeatable",
    )
    front.add_argument(
        "--api-key",
        action="append",
        default=[],
        metavar="SPEC",
        help="accept this bearer key: KEY[=TENANT] (tenant defaults to the key), then options as "
        "in --api-keys-file; repeatable",
    )
    front.add_argument(
        "--api-keys-file",
        default=None,
        help="file of API key specs, one a line: KEY[=TENANT] or KEY TENANT, then options "
        "weight=W priority=P",
    )
    front.add_argument(
        "--tenant-salt-secret",
        default=None,
        help="secret the tenants' cache salts are keyed with; router replicas of one fleet must "
        "share it (default: $KVHERD_TENANT_SALT_SECRET, else generated at start-up)",
    )
    front.add_argument(
        "--expose-instance", action="store_true", help="add X-Kvherd-Instance to responses"
    )
    models.add_argument(
        "--tokenizer",
        action="append",
        default=None,
        metavar="[MODEL=]DIR",
        help="the tokenizer requests are routed with: a model's (or an HF tokenizer's) "
        "directory, or 'byte'; DIR for every model, MODEL=DIR for one base model (repeatable; "
        "its adapters use it too). Needs the 'tokenizer' extra. Required in front of engines "
        "that are not kvherd agents",
    )
    models.add_argument(
        "--block-size",
        action="append",
        default=None,
        metavar="[MODEL=]N",
        help="pin the block size: N for every model, MODEL=N for one base model (repeatable); "
        "default: each model's instances' own",
    )
    models.add_argument(
        "--lora-modules",
        action="append",
        default=[],
        metavar="NAME=PATH",
        help="a LoRA adapter the proxy may load on demand (repeatable; PATH as the instances see "
        'it, or vLLM\'s JSON {"name", "path", "base_model_name"})',
    )
    models.add_argument(
        "--lora-load-on-demand",
        action="store_true",
        help="load a --lora-modules adapter no instance serves on the instance the policy picks "
        "(vLLM started with VLLM_ALLOW_RUNTIME_LORA_UPDATING=True)",
    )
    models.add_argument(
        "--models-interval", type=float, default=2.0, help="seconds between /v1/models polls"
    )
    models.add_argument("--no-kv-events", action="store_true", help="use the approximate index")
    models.add_argument(
        "--kv-events-bind",
        default=None,
        metavar="tcp://H:P",
        help="bind a SUB endpoint for engines that connect their PUB (vLLM with a host in its "
        "kv-events endpoint); each such instance names its vLLM topic with --instance ...,topic=T",
    )
    models.add_argument(
        "--kv-silence-warn",
        type=float,
        default=30.0,
        metavar="SECONDS",
        help="warn when an instance sends no KV event this long after traffic (default 30)",
    )
    pull = parser.add_argument_group(
        "prefix pulls between kvherd agents (scheduler.core.prefix_pull; off by default)"
    )
    pull.add_argument(
        "--prefix-pull",
        action="store_true",
        help="when an agent other than the policy's pick holds a much longer prefix, route "
        "there, recompute, or pull its blocks first, whichever is estimated to start sooner",
    )
    pull.add_argument(
        "--pull-min-tokens",
        type=int,
        default=2048,
        help="prefix tokens a holder must add over the pick (default 2048, llm-d's)",
    )
    pull.add_argument(
        "--pull-bandwidth-gbps",
        type=float,
        default=10.0,
        help="bandwidth between two agents in Gbit/s (default 10: TCP between hosts)",
    )
    pull.add_argument(
        "--pull-latency-ms",
        type=float,
        default=0.05,
        help="fixed cost of one pull (control round trip, copy set-up), in ms (default 0.05)",
    )
    pull.add_argument(
        "--pull-prefill-tokens-per-s",
        type=float,
        default=8000.0,
        help="the agents' prefill rate, tokens/s, to price a recompute (default 8000)",
    )
    pull.add_argument(
        "--pull-kv-bytes-per-token",
        type=float,
        default=131072.0,
        help="KV bytes per token, all layers (default 131072: Llama-3-8B in 16 bits)",
    )
    health.add_argument("--max-attempts", type=int, default=3)
    front.add_argument(
        "--max-connections",
        type=int,
        default=None,
        help="client connections held at once; more get 429 and are closed (default: half the "
        "open-file limit, which start-up raises to its hard limit, less a reserve)",
    )
    admission = parser.add_argument_group(
        "admission: in-flight bounds, the queue, the door (scheduler/core/admission.py)"
    )
    add_admission_arguments(admission)
    admission.add_argument(
        "--door",
        action="store_true",
        help="answer 429 from the request head for a tenant and class admission is refusing most "
        "of (scheduler/core/door.py; off by default: it slowed recovery after floods of long "
        "requests in the overload suite)",
    )
    health.add_argument("--connect-timeout", type=float, default=2.0)
    health.add_argument(
        "--request-timeout", type=float, default=600.0, help="seconds until the response head"
    )
    health.add_argument("--stream-idle-timeout", type=float, default=300.0)
    health.add_argument("--health-interval", type=float, default=1.0)
    health.add_argument(
        "--health-timeout", type=float, default=1.0, help="seconds an active probe may take"
    )
    health.add_argument(
        "--max-continuations",
        type=int,
        default=2,
        help="attempts to continue a stream elsewhere after its instance was lost",
    )
    health.add_argument(
        "--first-byte-deadline",
        type=float,
        nargs=2,
        action=_DeadlineRange,
        default=[10.0, 120.0],
        metavar=("FLOOR", "CAP"),
        help="seconds a stream may wait for its first chunk: derived from the instance's queue "
        "and step time, within [FLOOR, CAP]",
    )
    health.add_argument(
        "--inter-chunk-deadline",
        type=float,
        nargs=2,
        action=_DeadlineRange,
        default=[2.0, 30.0],
        metavar=("FLOOR", "CAP"),
        help="seconds between a stream's chunks: derived from the instance's step time, "
        "within [FLOOR, CAP]; past it the stream continues on another instance",
    )
    health.add_argument("--eject-after", type=int, default=3, help="consecutive failures")
    health.add_argument("--ejection-time", type=float, default=5.0, help="first ejection, seconds")
    health.add_argument("--load-interval", type=float, default=0.25)
    health.add_argument("--heartbeat-timeout", type=float, default=10.0)
    logs.add_argument("--log-level", default="info")
    logs.add_argument(
        "--otlp-endpoint",
        default=None,
        metavar="URL",
        help="export OpenTelemetry traces of the request path over OTLP/HTTP to URL "
        "(/v1/traces appended unless given; needs the kvherd[tracing] extra); default off",
    )
    logs.add_argument(
        "--otlp-sample-ratio",
        type=float,
        default=1.0,
        metavar="R",
        help="trace this share of the requests that come without a sampled traceparent "
        "(default 1: all; tracing every request costs about 3x the proxy's CPU per request)",
    )


def _tracing(url: str | None, sample_ratio: float = 1.0) -> Any:
    """The `scheduler.proxy.tracing.Tracing` for ``--otlp-endpoint`` (None: off); `ValueError`
    for a URL that is not http(s) or without the OpenTelemetry packages."""
    if url is None:
        return None
    from kvherd import otlp

    otlp.check_endpoint(url)
    if not 0.0 <= sample_ratio <= 1.0:
        raise ValueError(f"--otlp-sample-ratio must be in [0, 1], got {sample_ratio}")
    try:
        from scheduler.proxy.tracing import Tracing

        return Tracing(otlp.exporter(url), sample_ratio=sample_ratio)
    except ImportError as exc:
        raise ValueError(str(exc)) from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--instance",
        action="append",
        default=[],
        metavar="URL[,kv_events=tcp://H:P|kv_events_bind=tcp://H:P|topic=T,replay=tcp://H:P,"
        "block_size=N,id=NAME,role=prefill|decode|mixed,max_num_seqs=N]",
        help="an instance to route to; repeatable",
    )
    add_proxy_arguments(parser)


def block_size_pins(values: list[str] | None) -> tuple[int | None, dict[str, int]]:
    """``--block-size`` values: (N for every model, {MODEL: N}); ValueError for a bad one."""
    every: int | None = None
    per_model: dict[str, int] = {}
    for value in values or ():
        model, sep, number = value.rpartition("=")
        if not number.isdigit() or int(number) <= 0 or (sep and not model):
            raise ValueError(f"{value!r}: expected a positive integer N or MODEL=N")
        if not sep:
            if every is not None:
                raise ValueError(f"{value!r}: the block size of every model is already given")
            every = int(number)
        elif model in per_model:
            raise ValueError(f"{value!r}: model {model!r} already has a block size")
        else:
            per_model[model] = int(number)
    return every, per_model


def parse_instance_spec(text: str) -> dict[str, Any]:
    url, *options = text.split(",")
    if not url.startswith("http://"):
        raise ValueError(f"--instance {text!r}: expected http://host:port[,key=value...]")
    spec: dict[str, Any] = {"url": url.rstrip("/")}
    names = {
        "kv_events": "kv_events_endpoint",
        "kv_events_bind": "kv_events_bind",
        "topic": "kv_topic",
        "replay": "replay_endpoint",
        "id": "id",
        "block_size": "block_size",
        "role": "role",
        "max_num_seqs": "max_num_seqs",
        "pull_address": "pull_address",
    }
    for option in options:
        key, sep, value = option.partition("=")
        if not sep or key not in names:
            raise ValueError(f"--instance {text!r}: unknown option {option!r}")
        if key in ("block_size", "max_num_seqs"):
            if not value.isdigit() or int(value) <= 0:
                raise ValueError(f"--instance {text!r}: {key} must be a positive integer")
            spec[key] = int(value)
        elif key == "role" and value not in ("prefill", "decode", "mixed"):
            raise ValueError(f"--instance {text!r}: role must be prefill, decode or mixed")
        elif key == "pull_address" and not value.startswith("tcp://"):
            raise ValueError(f"--instance {text!r}: pull_address must be tcp://host:port")
        else:
            spec[names[key]] = value
    if "kv_events_bind" in spec and "kv_events_endpoint" in spec:
        raise ValueError(f"--instance {text!r}: give kv_events or kv_events_bind, not both")
    return spec


def load_config(path: str | None) -> dict[str, Any]:
    if path is None:
        return {}
    import yaml

    with open(path, encoding="utf-8") as handle:
        data = yaml.safe_load(handle) or {}
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a mapping")
    if "schedulingProfiles" in data or "scorers" in data:
        return {"policy": path}
    return data


def _policy_params(items: list[str]) -> dict[str, Any]:
    import yaml

    params: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--policy-param {item!r}: expected KEY=VALUE")
        params[key] = yaml.safe_load(value)
    return params


async def probe_instance(
    raw: dict[str, Any], kv_events: bool, fleet_token: str | None = None
) -> InstanceSpec:
    """Learn a static instance's id, model and block size from its state snapshot or model list."""
    import httpx

    from kvherd.fleet_token import auth_headers
    from scheduler.core.load_report import parse_prometheus
    from scheduler.fleet import FleetError, InstanceSpec
    from scheduler.model_poller import parse_models

    url = raw["url"]
    bind = raw.get("kv_events_bind")
    spec = InstanceSpec(
        instance_id=raw.get("id") or url.split("://", 1)[1],
        url=url,
        kv_events_endpoint=(bind or raw.get("kv_events_endpoint")) if kv_events else None,
        replay_endpoint=raw.get("replay_endpoint"),
        kvherd_agent=False,
        kv_events_bind=bind is not None,
        kv_topic=raw.get("kv_topic") if kv_events else None,
        role=raw.get("role"),
        max_num_seqs=raw.get("max_num_seqs"),
        pull_address=raw.get("pull_address"),
    )
    override = raw.get("block_size")
    headers = auth_headers(fleet_token)
    async with httpx.AsyncClient(timeout=5.0, trust_env=False, headers=headers) as client:
        try:
            state = await client.get(url + "/kvherd/v1/state")
            if state.status_code == 401:  # a kvherd agent whose control routes need the token
                raise FleetError(401, _token_refused(fleet_token))
            if state.status_code == 200:
                body = state.json()
                spec.kvherd_agent = True
                spec.block_size = body.get("block_size")
                spec.model = body.get("model")
                spec.instance_id = raw.get("id") or body.get("instance_id") or spec.instance_id
                spec.runtime_lora = body.get("runtime_lora") is True
                pull_address = body.get("pull_address")
                if spec.pull_address is None and isinstance(pull_address, str):
                    spec.pull_address = pull_address if pull_address.startswith("tcp://") else None
                models = (await client.get(url + "/v1/models")).json()
                spec.models = parse_models(models)
            else:
                models = (await client.get(url + "/v1/models")).json()
                spec.model = models["data"][0]["id"]
                spec.models = parse_models(models)  # base models and LoRA adapters
                # vLLM: vllm:cache_config_info{block_size=...} names the engine's block size.
                metrics = await client.get(url + "/metrics")
                if metrics.status_code == 200:
                    spec.block_size = parse_prometheus(metrics.text).block_size
            limit = models["data"][0].get("max_model_len")  # vLLM's and the agents' field
            if isinstance(limit, int) and not isinstance(limit, bool) and limit > 0:
                spec.max_model_len = limit
        except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError) as exc:
            log.warning("instance %s did not describe itself (%s); adding it as is", url, exc)
    if override is not None:  # the operator's word wins; a differing report is still warned of
        spec.block_size = int(override)
    return spec


def _pull_settings(args: argparse.Namespace) -> PullSettings | None:
    """The router's pull rule from the flags (ValueError for values it cannot price with)."""
    from scheduler.core.prefix_pull import PullSettings

    if not args.prefix_pull:
        return None
    return PullSettings(
        prefill_tokens_per_s=args.pull_prefill_tokens_per_s,
        kv_bytes_per_token=args.pull_kv_bytes_per_token,
        bandwidth=args.pull_bandwidth_gbps * 1e9 / 8,
        latency_s=args.pull_latency_ms / 1e3,
        min_gain_tokens=args.pull_min_tokens,
    )


def _token_refused(fleet_token: str | None) -> str:
    from kvherd.fleet_token import FLEET_TOKEN_ENV

    if fleet_token is None:
        return (
            "the agent guards its control routes with a fleet token and none was given: pass "
            f"the fleet's token with --fleet-token or ${FLEET_TOKEN_ENV}"
        )
    return (
        "the agent refused the fleet token (401): --fleet-token / "
        f"${FLEET_TOKEN_ENV} must be the token its agents were started with"
    )


def foreign_without_tokenizer(
    spec: InstanceSpec, named: Callable[[str | None], bool] = lambda model: False
) -> str | None:
    """Why the proxy must not route `spec` with the byte tokenizer (`named(model)`: whether a
    ``--tokenizer`` covers that model, its own or the default).

    An engine that answered ``/v1/models`` but is no kvherd agent (vLLM, SGLang) tokenizes with
    its model's tokenizer: byte-level routing tokens never match its blocks, so the proxy refuses
    to start. An instance that described itself not at all only gets a warning.
    """
    if spec.kvherd_agent or named(spec.model):
        return None
    if spec.model is None:
        log.warning(
            "instance %s is not a kvherd agent as far as the proxy can tell, and no --tokenizer "
            "was given: if it is a vLLM/SGLang server, prefix-aware routing will never match "
            "(pass --tokenizer MODEL_DIR)",
            spec.url,
        )
        return None
    return (
        f"instance {spec.url} serves {spec.model!r} and is not a kvherd agent: kvherd routes by "
        "the engine's own token ids, so give the model's tokenizer with --tokenizer DIR or "
        f"--tokenizer {spec.model}=DIR (its checkpoint or HF tokenizer directory; pip install "
        "'kvherd[tokenizer]'), or "
        "--tokenizer byte to route with the byte tokenizer anyway"
    )


class _QuietServer:
    """uvicorn.Server without its own signal handling (the caller owns the signals)."""

    @staticmethod
    def make(app: Any, host: str, port: int, log_level: str) -> Any:
        import uvicorn

        class Server(uvicorn.Server):
            @contextlib.contextmanager
            def capture_signals(self) -> Iterator[None]:
                yield

        config = uvicorn.Config(
            app,
            host=host,
            port=port,
            log_level=log_level,
            access_log=False,
            server_header=False,
            lifespan="off",
            backlog=4096,
            timeout_keep_alive=30,
        )
        return Server(config)


async def serve_fleet(
    args: argparse.Namespace,
    on_ready: Callable[[Fleet], Awaitable[None]] | None = None,
    stop: asyncio.Event | None = None,
    before_shutdown: Callable[[], Awaitable[None]] | None = None,
    handle_signals: bool = True,
    tracing: Any = None,
) -> int:
    """Run the proxy and admin servers until `stop` is set (or SIGINT/SIGTERM).

    `on_ready` runs once both servers listen; `before_shutdown` runs after the stop request while
    both still serve (``kvherd up`` stops its agents there, so they can deregister). `tracing`
    (a `scheduler.proxy.tracing.Tracing`) takes the place of ``--otlp-endpoint``'s.
    """
    from kvherd.fd_limit import connection_cap, raise_fd_limit
    from kvherd.fleet_token import auth_headers, resolve
    from policies.registry import PolicyAllowList
    from scheduler.core.deadlines import DeadlineSettings
    from scheduler.core.door import DoorSettings
    from scheduler.core.tenancy import SALT_SECRET_ENV, build_registry
    from scheduler.fleet import Fleet, FleetError, FleetSettings
    from scheduler.loop_lag import LoopLag
    from scheduler.metrics import ProxyMetrics
    from scheduler.proxy.admin import LOOPBACK_PATTERNS, RegistrationPolicy, build_admin_app
    from scheduler.proxy.lora_loader import LoraLoader, parse_lora_module
    from scheduler.proxy.model_tokenizers import ModelTokenizers, parse_tokenizer_specs
    from scheduler.proxy.proxy import Proxy, ProxyConfig, build_front

    try:
        static_instances = [parse_instance_spec(t) for t in getattr(args, "instance", [])]
        config = load_config(args.config)
        tracing = tracing or _tracing(
            getattr(args, "otlp_endpoint", None), getattr(args, "otlp_sample_ratio", 1.0)
        )
    except (OSError, ValueError) as exc:
        print(f"kvherd serve: {exc}", file=sys.stderr)
        return 2
    policy = args.policy or config.get("policy") or "kvherd"
    params = _policy_params(args.policy_param)
    if isinstance(policy, dict):
        params = {**(policy.get("parameters") or {}), **params}
        policy = policy["name"]
    token = args.admin_token or os.environ.get(ADMIN_TOKEN_ENV)
    if not token:
        print(
            "kvherd serve: the admin API needs --admin-token or $KVHERD_ADMIN_TOKEN",
            file=sys.stderr,
        )
        return 2
    fleet_token = resolve(args.fleet_token)
    try:
        tenants = build_registry(
            list(config.get("api_keys") or []) + args.api_key,
            args.api_keys_file,
            args.tenant_salt_secret,
        )
    except (OSError, ValueError) as exc:
        print(f"kvherd serve: API keys: {exc}", file=sys.stderr)
        return 2
    if tenants.enabled and tenants.salt_secret_generated:
        log.warning(
            "tenant cache salts use a secret generated at start-up: router replicas of this "
            "fleet must share one (--tenant-salt-secret or $%s), and a restart changes every "
            "tenant's salt",
            SALT_SECRET_ENV,
        )
    allow = RegistrationPolicy(
        args.allow_register or config.get("allow_register") or LOOPBACK_PATTERNS
    )
    try:  # missing packages or files fail here, never per request
        tokenizers = ModelTokenizers.load(parse_tokenizer_specs(args.tokenizer))
    except ValueError as exc:
        print(f"kvherd serve: --tokenizer: {exc}", file=sys.stderr)
        return 2
    try:
        block_size, model_block_sizes = block_size_pins(args.block_size)
    except ValueError as exc:
        print(f"kvherd serve: --block-size: {exc}", file=sys.stderr)
        return 2
    fd_limit = raise_fd_limit()  # every client and upstream connection holds a descriptor
    if args.max_connections is not None and args.max_connections < 1:
        print("kvherd serve: --max-connections must be >= 1", file=sys.stderr)
        return 2
    metrics = ProxyMetrics()
    admission, queue, max_inflight = admission_settings(args)
    try:
        prefix_pull = _pull_settings(args)
    except ValueError as exc:
        print(f"kvherd serve: --prefix-pull: {exc}", file=sys.stderr)
        return 2
    settings = FleetSettings(
        block_size=block_size,
        model_block_sizes=model_block_sizes,
        max_inflight_per_instance=max_inflight,
        failure_threshold=args.eject_after,
        base_ejection_s=args.ejection_time,
        health_interval_s=args.health_interval,
        health_timeout_s=args.health_timeout,
        load_interval_s=args.load_interval,
        heartbeat_timeout_s=args.heartbeat_timeout,
        kv_events=not args.no_kv_events,
        fleet_token=fleet_token,
        kv_events_bind=args.kv_events_bind,
        kv_silence_warn_s=args.kv_silence_warn,
        prefix_pull=prefix_pull,
        models_interval_s=args.models_interval,
        handover=not args.no_handover,
        slow_start_s=args.slow_start,
    )
    lag = LoopLag()  # the proxy's loop lag: no deadline or probe blames an instance for it
    try:
        fleet = Fleet(
            policy,
            settings,
            metrics,
            params,
            policy_allow=PolicyAllowList.of(args.policy_module, args.policy_dir),
            pd_policy_spec=args.pd_policy,
            lag_owed=lag.owed,
        )
    except FleetError as exc:
        print(f"kvherd serve: {exc.message}", file=sys.stderr)
        return 2
    from policies.registry import PolicyLoadError, load_migration_policy
    from scheduler.migration_driver import MigrationDriver
    from scheduler.peer_sync import PeerSync

    try:
        migration_policy = load_migration_policy(args.migration_policy)
    except PolicyLoadError as exc:
        print(f"kvherd serve: {exc}", file=sys.stderr)
        return 2
    # Always driven, even with "none": drains and operators' orders migrate too.
    fleet.migration = MigrationDriver(
        fleet, migration_policy, args.migration_interval, fleet_token=fleet_token
    )
    fleet.migration_spec = args.migration_policy
    try:
        lora_modules = {m.name: m for m in map(parse_lora_module, args.lora_modules)}
    except ValueError as exc:
        print(f"kvherd serve: {exc}", file=sys.stderr)
        return 2
    if lora_modules and not args.lora_load_on_demand:
        log.warning("--lora-modules without --lora-load-on-demand: the adapters are not loaded")
    lora = None
    if args.lora_load_on_demand:
        lora = LoraLoader(fleet, lora_modules, metrics, auth_headers(fleet_token))
    proxy = Proxy(
        fleet,
        tokenizers,
        tenants,
        ProxyConfig(
            max_attempts=args.max_attempts,
            queue=queue,
            connect_timeout_s=args.connect_timeout,
            request_timeout_s=args.request_timeout,
            stream_idle_timeout_s=args.stream_idle_timeout,
            expose_instance=args.expose_instance,
            fleet_token=fleet_token,
            max_continuations=args.max_continuations,
            admission=admission,
            max_connections=args.max_connections or connection_cap(fd_limit),
            door=DoorSettings() if args.door else None,
            deadlines=DeadlineSettings(
                first_byte_floor_s=args.first_byte_deadline[0],
                first_byte_cap_s=args.first_byte_deadline[1],
                inter_chunk_floor_s=args.inter_chunk_deadline[0],
                inter_chunk_cap_s=args.inter_chunk_deadline[1],
            ),
        ),
        metrics,
        lag,
        lora,
        tracing,
    )
    fleet.migration.cuts = proxy.relay.cuts  # vLLM streams migrate by the proxy's own cuts
    replica = f"{socket.gethostname()}:{args.port}"
    peers = PeerSync(fleet, replica, args.peer, token, args.peer_interval) if args.peer else None
    level = args.log_level.lower()
    front = build_front(proxy)
    admin_server = _QuietServer.make(
        build_admin_app(fleet, token, allow, proxy.limits, tokenizers, replica),
        args.admin_host,
        args.admin_port,
        level,
    )
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    signals = (signal.SIGINT, signal.SIGTERM) if handle_signals else ()

    def on_signal() -> None:
        if stop.is_set():  # a second Ctrl-C: stop without waiting for open requests
            front.force_exit = admin_server.force_exit = True
        stop.set()

    for sig in signals:
        loop.add_signal_handler(sig, on_signal)
    await fleet.start()
    proxy.lag.start()
    if fleet.migration is not None:
        fleet.migration.start()
    if peers is not None:
        peers.start()
    try:
        for raw in list(config.get("instances") or []) + static_instances:
            entry = {"url": raw} if isinstance(raw, str) else dict(raw)
            if "url" not in entry:
                raise ValueError(f"config instance {raw!r} has no url")
            try:
                spec = await probe_instance(entry, not args.no_kv_events, fleet_token)
                if refusal := foreign_without_tokenizer(spec, tokenizers.named):
                    print(f"kvherd serve: {refusal}", file=sys.stderr)
                    return 2
                await fleet.add_instance(spec)
            except FleetError as exc:
                print(f"kvherd serve: instance {entry['url']}: {exc.message}", file=sys.stderr)
                return 2
        try:
            await front.start(args.host, args.port)
        except OSError as exc:
            log.error("cannot serve on %s:%d: %s", args.host, args.port, exc)
            return 1
        serving = [asyncio.create_task(admin_server.serve(), name="kvherd-admin")]
        while not admin_server.started:
            if serving[0].done():
                break  # the admin server failed to start (e.g. port in use); its error is logged
            await asyncio.sleep(0.02)
        if admin_server.started:
            log.info(
                "kvherd proxy on http://%s:%d, admin on http://%s:%d, policy %s",
                args.host,
                args.port,
                args.admin_host,
                args.admin_port,
                policy,
            )
            # Startup objects (modules, apps, the policy) live for the whole process: keeping them
            # out of the collector's generations keeps its pauses off the request path's p99.
            gc.collect()
            gc.freeze()
            if on_ready is not None:
                ready: asyncio.Future[None] = asyncio.ensure_future(on_ready(fleet))
                ready.add_done_callback(lambda t: t.cancelled() or t.exception())
            stopper = asyncio.create_task(stop.wait())
            await asyncio.wait([stopper, *serving], return_when=asyncio.FIRST_COMPLETED)
            stopper.cancel()
        failed = any(task.done() for task in serving)
        if before_shutdown is not None:
            await before_shutdown()
        admin_server.should_exit = True
        await asyncio.gather(front.stop(), *serving, return_exceptions=True)
        return 1 if failed and not stop.is_set() else 0
    finally:
        for sig in signals:
            loop.remove_signal_handler(sig)
        if fleet.migration is not None:
            await fleet.migration.stop()
        if peers is not None:
            await peers.stop()
        await fleet.stop()
        await proxy.lag.stop()
        await proxy.pool.close()
        if lora is not None:
            await lora.close()
        if tracing is not None:
            await asyncio.to_thread(tracing.shutdown)  # flushes the spans still batched


def configure_logging(level: str) -> None:
    logging.basicConfig(
        level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    # One line per load poll and health probe would drown everything else.
    logging.getLogger("httpx").setLevel(logging.WARNING)


def run_loop(main: Coroutine[Any, Any, int]) -> int:
    """Run on uvloop where it is installed (it roughly halves the proxy's per-request cost)."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    return uvloop.run(main)


def run(args: argparse.Namespace) -> int:
    configure_logging(args.log_level)
    return run_loop(serve_fleet(args))
