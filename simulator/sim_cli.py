"""`kvherd sim`: replay a trace through a simulated fleet, dispatch policies side by side.

Every policy runs on the same arrivals (a fresh fleet each). Prints a markdown table to stdout and
writes `summary.json`, `summary.csv`, `requests_<policy>.csv`, `ttft_cdf.png` and
`load_<policy>.png` to --out, and with --html FILE one page of charts (`simulator.html_report`).
Bad traces, latency-model specs or policy names exit with status 2 and one clear line on stderr.
Deterministic for a seed: run times go to `timing.json`, not `summary.json`, so two runs with the
same seed write identical summaries. The fleet's host (request
path, co-location: `simulator.host_model.HostModel`) is the `--profile` file's host section, each
host flag given overriding its knob; `summary.json` records the host simulated. With `--admission`
the proxy's admission (`simulator.admission`: the same core and flags as `kvherd serve`) refuses
and queues arrivals, and the summary gains its rows (429s by code, admission-queue waits). A trace
naming models is served by `--base-models` with `--max-loras` adapter slots per instance, each
load taking `--lora-load-ms` (`simulator.models`, `simulator.lora`).
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from scheduler.core.admission_flags import add_admission_arguments, admission_settings
from simulator.models import DEFAULT_LORA_LOAD_S

_DEFAULT_MODEL = "roofline:llama-2-70b:a100-80gb:tp4"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from simulator.latency import SPEC_HELP

    parser.add_argument(
        "trace",
        help="trace file (Mooncake/generic .jsonl, Azure/generic .csv) or a synthetic trace "
        "'synthetic:requests=N,rate=R,cv=C,input_mean=I,output_mean=O,num_groups=G,"
        "prefix_tokens=P,zipf_s=S,seed=X'",
    )
    parser.add_argument(
        "--id-block-size",
        type=int,
        default=512,
        help="tokens per hash id in the trace (default 512, Mooncake's)",
    )
    parser.add_argument(
        "--instances",
        type=int,
        default=None,
        help="number of mixed instances (default 4; 0 with --prefill/--decode-instances)",
    )
    parser.add_argument(
        "--policy",
        default="kvherd",
        help="comma-separated dispatch policies to compare (built-in names, module:attr, .yaml)",
    )
    parser.add_argument(
        "--migration-policy", default="none", help="migration policy (default none)"
    )
    parser.add_argument(
        "--latency-model", default=_DEFAULT_MODEL, help=f"{SPEC_HELP} (default {_DEFAULT_MODEL})"
    )
    parser.add_argument("--rate-scale", type=float, default=1.0, help="multiply the arrival rate")
    parser.add_argument("--max-requests", type=int, default=None, help="first K requests only")
    parser.add_argument(
        "--time-window",
        default=None,
        metavar="START:END",
        help="only requests arriving in [START, END) seconds (either side may be empty)",
    )
    parser.add_argument("--sample", type=float, default=None, help="keep this fraction (0-1]")
    parser.add_argument(
        "--diurnal",
        default=None,
        metavar="PERIOD:TROUGH",
        help="warp arrivals to a daily shape: PERIOD seconds a day, the night's rate TROUGH of "
        "the peak (0-1]; same requests, same span",
    )
    parser.add_argument("--slo-ttft", type=float, default=None, metavar="MS", help="TTFT SLO (ms)")
    parser.add_argument("--slo-tpot", type=float, default=None, metavar="MS", help="TPOT SLO (ms)")
    parser.add_argument("--seed", type=int, default=0, help="seed for policies and sampling")
    engine = parser.add_argument_group("simulated engine (defaults: from the latency model)")
    engine.add_argument("--block-size", type=int, default=None, help="KV block size (default 16)")
    engine.add_argument(
        "--num-blocks", type=int, default=None, help="KV blocks per instance (default: capacity)"
    )
    engine.add_argument("--max-num-seqs", type=int, default=None, help="default 256")
    engine.add_argument("--max-num-batched-tokens", type=int, default=None, help="default 8192")
    engine.add_argument("--max-model-len", type=int, default=None, help="default 1M tokens")
    engine.add_argument("--no-prefix-caching", action="store_true", help="disable prefix caching")
    engine.add_argument(
        "--num-cpu-blocks", type=int, default=0, help="host-DRAM KV tier per instance (blocks)"
    )
    engine.add_argument(
        "--num-disk-blocks", type=int, default=0, help="disk KV tier per instance (blocks)"
    )
    engine.add_argument(
        "--cpu-bandwidth-gbps", type=float, default=256.0, help="host DRAM link, Gbit/s (256)"
    )
    engine.add_argument(
        "--disk-bandwidth-gbps", type=float, default=32.0, help="disk link, Gbit/s (32)"
    )
    engine.add_argument(
        "--step-overhead-ms",
        type=float,
        default=0.0,
        help="serving-loop cost added to every step (default 0)",
    )
    scaling = parser.add_argument_group(
        "autoscaling (scheduler/core/autoscale.py, as kvherd up --autoscale)"
    )
    scaling.add_argument(
        "--autoscale",
        default=None,
        metavar="MIN:MAX",
        help="grow and shrink the mixed instances by load (--instances: how many at the start, "
        "default MIN); 'instance-hours held' is the cost",
    )
    scaling.add_argument(
        "--autoscale-slots",
        type=int,
        default=None,
        help="requests one instance serves at the target (default: --max-num-seqs)",
    )
    scaling.add_argument(
        "--instance-start", type=float, default=30.0, help="an added instance's cold start (s)"
    )
    scaling.add_argument(
        "--slow-start",
        type=float,
        default=0.0,
        metavar="S",
        help="ramp an added instance's share of its batch slots from a quarter to all over S "
        "seconds (0: at once, the default)",
    )
    fleet = parser.add_argument_group("router and migration")
    fleet.add_argument(
        "--routers",
        type=int,
        default=1,
        help="router replicas in front of the fleet, requests spread over them in turn; each "
        "charges only what it routed and reads every report and KV event (default 1)",
    )
    fleet.add_argument(
        "--peer-interval-ms",
        type=float,
        default=None,
        help="router replicas read each other's in-flight charges this often, as kvherd serve "
        "--peer (default: never)",
    )
    fleet.add_argument("--report-interval-ms", type=float, default=100.0, help="load report period")
    fleet.add_argument("--kv-event-delay-ms", type=float, default=5.0, help="KV event latency")
    fleet.add_argument(
        "--migration-interval-ms", type=float, default=500.0, help="migration loop period"
    )
    fleet.add_argument(
        "--migration-bandwidth-gbps",
        type=float,
        default=200.0,
        help="KV transfer bandwidth between instances in Gbit/s (default 200)",
    )
    fleet.add_argument(
        "--prefix-pull",
        action="store_true",
        help="pull a long prefix from the instance holding it when that beats recomputing or "
        "routing to the holder (estimated TTFT)",
    )
    fleet.add_argument(
        "--pull-min-tokens",
        type=int,
        default=2048,
        help="prefix tokens a holder must add before a pull is considered (default 2048)",
    )
    fleet.add_argument(
        "--pull-bandwidth-gbps",
        type=float,
        default=400.0,
        help="NIC bandwidth for prefix pulls in Gbit/s (default 400)",
    )
    admission = parser.add_argument_group(
        "the proxy's admission (off unless --admission; the same rule and flags as kvherd serve)"
    )
    admission.add_argument(
        "--admission",
        action="store_true",
        help="refuse (429) and queue requests as kvherd serve's admission would",
    )
    add_admission_arguments(admission)
    host = parser.add_argument_group(
        "host: the request path and co-location (each flag overrides the --profile file's knob)"
    )
    host.add_argument(
        "--profile",
        type=Path,
        default=None,
        metavar="FILE",
        help="a profile file (`kvherd profile`, bench/sim_fidelity.py or by hand) whose host "
        "section sets the knobs below (default: no profile, every knob 0); the latency model "
        "stays --latency-model's",
    )
    host.add_argument(
        "--request-overhead-ms",
        type=float,
        default=None,
        help="client -> proxy -> engine latency of every request (default 0)",
    )
    host.add_argument(
        "--request-overhead-per-busy-ms",
        type=float,
        default=None,
        help="extra request latency per other busy instance, for instances sharing a host's "
        "cores with the proxy and the client (default 0)",
    )
    host.add_argument(
        "--request-overhead-idle",
        default=None,
        metavar="IDLE_S:MS,...",
        help="extra request latency by how long the whole fleet has been idle at the arrival: "
        "points of a piecewise-linear function, flat past its ends, e.g. 0.03:-2,0.5:10 (hosts "
        "slow to wake idle processes; default none)",
    )
    host.add_argument(
        "--request-overhead-spread",
        default=None,
        metavar="MS,...",
        help="how the request latency varies around its typical value: quantiles of its "
        "deviation in ms, ascending and evenly spaced from the least to the greatest, each "
        "request drawing one (seeded), e.g. --request-overhead-spread=-4,-1,0,1,9 (default none)",
    )
    host.add_argument(
        "--step-slowdown-per-busy",
        type=float,
        default=None,
        metavar="FRACTION",
        help="stretch every engine step by this fraction per other busy instance, for "
        "instances sharing a host's cores (default 0; nonzero turns decode fast-forward off)",
    )
    models = parser.add_argument_group("models and LoRA adapters (a trace with a model column)")
    models.add_argument(
        "--base-models",
        default="base",
        metavar="NAME[=FIRST-LAST],...",
        help="base models and the instances (positions) serving each (default: base, on all); "
        "any other model the trace names is a LoRA adapter of its parent",
    )
    models.add_argument(
        "--max-loras", type=int, default=1, help="adapter slots per instance (vLLM's; default 1)"
    )
    models.add_argument(
        "--lora-load-ms",
        type=float,
        default=DEFAULT_LORA_LOAD_S * 1000.0,
        help=f"time to load an adapter into a slot (default {DEFAULT_LORA_LOAD_S * 1000:g})",
    )
    pd = parser.add_argument_group("prefill/decode disaggregation")
    pd.add_argument(
        "--prefill-instances", type=int, default=0, help="instances that only prefill (default 0)"
    )
    pd.add_argument(
        "--decode-instances", type=int, default=0, help="instances that only decode (default 0)"
    )
    pd.add_argument(
        "--pd-policy", default="kvherd", help="P/D pairing policy (kvherd, llmd, dynamo, ...)"
    )
    pd.add_argument(
        "--transfer-link",
        default="rdma400",
        help="link between prefill and decode instances: nvlink (450 GB/s), rdma400 (50 GB/s), "
        "rdma100 (12.5 GB/s) (default rdma400)",
    )
    pd.add_argument(
        "--transfer-bandwidth",
        type=float,
        default=None,
        metavar="GBPS",
        help="the link's bandwidth in GB/s (bytes), overriding the preset's",
    )
    pd.add_argument(
        "--transfer-latency-ms",
        type=float,
        default=None,
        help="the link's latency per transfer (one migration stage), overriding the preset's",
    )
    parser.add_argument("--out", required=True, type=Path, help="output directory")
    parser.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    parser.add_argument(
        "--html",
        type=Path,
        default=None,
        metavar="FILE",
        help="also write the report as one self-contained HTML page of charts",
    )
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    parser.add_argument(
        "--jobs", type=int, default=1, help="policies simulated in parallel processes (default 1)"
    )


def _fail(message: str) -> int:
    print(f"kvherd sim: error: {message}", file=sys.stderr)
    return 2


def _idle_points(text: str) -> tuple[tuple[float, float], ...]:
    """`--request-overhead-idle` -> (idle s, extra s) points (`HostModel` checks their order)."""
    points: list[tuple[float, float]] = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        idle, sep, extra = item.partition(":")
        try:
            point = (float(idle), float(extra) / 1000.0)
        except ValueError:
            point = (math.nan, math.nan)
        if not sep or not all(map(math.isfinite, point)) or point[0] < 0:
            raise ValueError(f"--request-overhead-idle: {item!r} is not IDLE_S:MS (IDLE_S >= 0)")
        points.append(point)
    return tuple(points)


def _spread_quantiles(text: str) -> tuple[float, ...]:
    """`--request-overhead-spread` -> quantiles in seconds (`HostModel` checks their order)."""
    if not text.strip():
        return ()
    try:
        values = [float(part) / 1000.0 for part in text.split(",")]
    except ValueError:
        values = [math.nan]
    if not all(map(math.isfinite, values)):
        raise ValueError(f"--request-overhead-spread: {text!r} is not a list of numbers (ms)")
    return tuple(values)


# Each host flag, the knob it sets and how its text becomes the knob's value (seconds).
_HOST_FLAGS: dict[str, tuple[str, Callable[[Any], Any]]] = {
    "request_overhead_ms": ("request_overhead_s", lambda ms: ms / 1000.0),
    "request_overhead_per_busy_ms": ("request_overhead_per_busy_s", lambda ms: ms / 1000.0),
    "request_overhead_idle": ("request_overhead_idle", _idle_points),
    "request_overhead_spread": ("request_overhead_spread", _spread_quantiles),
    "step_slowdown_per_busy": ("step_slowdown_per_busy", float),
}


def _host_model(args: argparse.Namespace) -> Any:
    """The fleet's host: the --profile file's host section, each host flag given overriding its
    knob. Raises `ValueError` naming the flag or the file's key at fault."""
    import dataclasses

    from simulator.host_model import HostModel, HostModelError

    host = HostModel() if args.profile is None else HostModel.from_file(args.profile)
    flag_of: dict[str, str] = {}
    changes: dict[str, Any] = {}
    for dest, (knob, convert) in _HOST_FLAGS.items():
        value = getattr(args, dest)
        if value is not None:
            flag_of[knob] = "--" + dest.replace("_", "-")
            changes[knob] = convert(value)
    try:
        return dataclasses.replace(host, **changes)
    except HostModelError as exc:
        raise ValueError(f"{flag_of.get(exc.knob, exc.knob)} {exc.problem}") from None


def _transfer(args: argparse.Namespace) -> Any:
    """The P/D handoff links from --transfer-link/-bandwidth/-latency-ms."""
    from simulator.transfer import TransferModel, link

    bandwidth = args.transfer_bandwidth
    latency = args.transfer_latency_ms
    if bandwidth is not None and not bandwidth > 0:
        raise ValueError("--transfer-bandwidth must be positive (GB/s)")
    if latency is not None and not latency >= 0:
        raise ValueError("--transfer-latency-ms must be non-negative")
    return TransferModel(
        link(
            args.transfer_link,
            None if bandwidth is None else bandwidth * 1e9,
            None if latency is None else latency / 1000.0,
        )
    )


def _window(text: str) -> tuple[float, float | None]:
    start, sep, end = text.partition(":")
    if not sep:
        raise ValueError(f"--time-window must be START:END, got {text!r}")
    return float(start or 0.0), (float(end) if end else None)


def run(args: argparse.Namespace) -> int:
    from policies.registry import (
        PolicyLoadError,
        load_dispatch_policy,
        load_migration_policy,
        load_pd_policy,
    )
    from simulator.experiment import SimSettings
    from simulator.latency import LatencyModelError, load_latency_model
    from simulator.latency.calibrated import CalibratedModel
    from simulator.synthetic import generate, parse_spec
    from simulator.traces import (
        TraceError,
        diurnal,
        head,
        load_trace,
        parse_diurnal,
        sample,
        scale_rate,
        time_window,
    )

    policies = [p.strip() for p in args.policy.split(",") if p.strip()]
    if not policies:
        return _fail("--policy names no policy")
    if len(set(policies)) != len(policies):
        return _fail("--policy lists a policy twice")
    if min(args.prefill_instances, args.decode_instances) < 0:
        return _fail("--prefill-instances and --decode-instances must be non-negative")
    disaggregated = bool(args.prefill_instances or args.decode_instances)
    scale_range = None
    if args.autoscale is not None:
        try:
            low, high = (int(x) for x in args.autoscale.split(":"))
        except ValueError:
            return _fail(f"--autoscale must be MIN:MAX, got {args.autoscale!r}")
        if disaggregated:
            return _fail("--autoscale grows mixed instances only (no P/D)")
        scale_range = (low, high)
        if args.instances is None:
            args.instances = low
    if args.instances is None:
        args.instances = 0 if disaggregated else 4
    if args.instances < 0 or args.instances + args.prefill_instances + args.decode_instances < 1:
        return _fail("--instances must be at least 1 (or give --prefill/--decode-instances)")
    try:
        transfer = _transfer(args)
    except ValueError as exc:
        return _fail(str(exc))
    if not args.step_overhead_ms >= 0:  # NaN fails too
        return _fail("--step-overhead-ms must be a non-negative number")
    try:
        host = _host_model(args)
    except ValueError as exc:
        return _fail(str(exc))
    try:
        latency = load_latency_model(args.latency_model)
        for name in policies:  # fail before a long run, not after the first policy
            load_dispatch_policy(name)
        if args.migration_policy != "none":
            load_migration_policy(args.migration_policy)
        if disaggregated:
            load_pd_policy(args.pd_policy)
    except (LatencyModelError, PolicyLoadError) as exc:
        return _fail(str(exc))
    try:
        if args.trace.startswith("synthetic:"):
            trace = generate(parse_spec(args.trace))
        else:
            trace = load_trace(args.trace, args.id_block_size)
        if args.time_window:
            trace = time_window(trace, *_window(args.time_window))
        if args.sample is not None:
            trace = sample(trace, args.sample, args.seed)
        if args.max_requests is not None:
            trace = head(trace, args.max_requests)
        trace = scale_rate(trace, args.rate_scale)
        if args.diurnal:
            trace = diurnal(trace, *parse_diurnal(args.diurnal))
    except TraceError as exc:
        return _fail(str(exc))
    except ValueError as exc:
        return _fail(str(exc))
    if not trace.requests:
        return _fail("no requests left after --time-window/--sample/--max-requests")

    engine: dict[str, int] = latency.engine if isinstance(latency, CalibratedModel) else {}
    try:
        instance = _instance_config(args, latency.kv_capacity_tokens, engine)
    except ValueError as exc:
        return _fail(str(exc))
    settings = SimSettings(
        num_instances=args.instances,
        latency=latency,
        instance=instance,
        migration_policy=args.migration_policy,
        seed=args.seed,
        slo_ttft_ms=args.slo_ttft,
        slo_tpot_ms=args.slo_tpot,
        report_interval_s=args.report_interval_ms / 1000.0,
        kv_event_delay_s=args.kv_event_delay_ms / 1000.0,
        migration_interval_s=args.migration_interval_ms / 1000.0,
        migration_bandwidth=args.migration_bandwidth_gbps * 1e9 / 8,
        host=host,
        prefill_instances=args.prefill_instances,
        decode_instances=args.decode_instances,
        pd_policy=args.pd_policy,
        transfer=transfer,
    )
    if args.prefix_pull:
        from simulator.pull import PullConfig

        if disaggregated:
            return _fail("--prefix-pull needs a fleet of mixed instances (no P/D)")
        try:
            settings.prefix_pull = PullConfig(
                args.pull_min_tokens, args.pull_bandwidth_gbps * 1e9 / 8
            )
        except ValueError as exc:
            return _fail(str(exc))
    if trace.has_models:
        from simulator.models import FleetModels, parse_base_models

        if disaggregated or args.prefix_pull or args.migration_policy != "none":
            return _fail("a trace naming models runs without P/D, --prefix-pull or migrations")
        try:
            settings.models = FleetModels(
                parse_base_models(args.base_models), args.max_loras, args.lora_load_ms / 1000.0
            )
        except ValueError as exc:
            return _fail(str(exc))
    if args.routers < 1:
        return _fail("--routers must be at least 1")
    if args.routers > 1 and scale_range is not None:
        return _fail("--routers with --autoscale: the autoscaler would see one replica's load")
    settings.routers = args.routers
    if args.peer_interval_ms is not None:
        if not args.peer_interval_ms > 0:
            return _fail("--peer-interval-ms must be positive")
        settings.peer_interval_s = args.peer_interval_ms / 1000.0
    if scale_range is None and args.slow_start:
        return _fail("--slow-start ramps instances the autoscaler adds: it needs --autoscale")
    if scale_range is not None:
        from scheduler.core.autoscale import AutoscaleSettings

        try:
            settings.autoscale = AutoscaleSettings(
                *scale_range, slots=args.autoscale_slots or instance.max_num_seqs
            )
        except ValueError as exc:
            return _fail(f"--autoscale: {exc}")
        if not args.instance_start >= 0:
            return _fail("--instance-start must be a non-negative number")
        settings.instance_start_s = args.instance_start
        if not args.slow_start >= 0:
            return _fail("--slow-start must be a non-negative number")
        settings.slow_start_s = args.slow_start
    if args.admission:
        (
            settings.admission,
            settings.admission_queue,
            settings.max_inflight_per_instance,
        ) = admission_settings(args)
    meta = {
        "trace": str(args.trace),
        "requests": len(trace),
        "trace_duration_s": trace.duration_s,
        "rate_scale": args.rate_scale,
        "instances": args.instances,
        "latency_model": latency.describe(),
        "engine": {
            "block_size": instance.block_size,
            "num_blocks": instance.num_blocks,
            "max_num_seqs": instance.max_num_seqs,
            "max_num_batched_tokens": instance.max_num_batched_tokens,
            "max_model_len": instance.max_model_len,
            "enable_prefix_caching": instance.enable_prefix_caching,
            "step_overhead_ms": args.step_overhead_ms,
            "num_cpu_blocks": instance.num_cpu_blocks,
            "num_disk_blocks": instance.num_disk_blocks,
        },
        "host_profile": None if args.profile is None else str(args.profile),
        "host": host.profile_section(),
        "migration_policy": args.migration_policy,
        "prefix_pull": (
            None
            if settings.prefix_pull is None
            else {
                "min_tokens": args.pull_min_tokens,
                "bandwidth_gbps": args.pull_bandwidth_gbps,
            }
        ),
        "seed": args.seed,
        "slo_ttft_ms": args.slo_ttft,
        "slo_tpot_ms": args.slo_tpot,
    }
    if settings.models is not None:
        meta["models"] = {
            "base_models": args.base_models,
            "max_loras": args.max_loras,
            "lora_load_ms": args.lora_load_ms,
        }
    if disaggregated:
        meta["prefill_instances"] = args.prefill_instances
        meta["decode_instances"] = args.decode_instances
        meta["pd_policy"] = args.pd_policy
        meta["transfer_link"] = transfer.default.describe()
    return _simulate(args, trace, settings, policies, meta)


def _instance_config(args: argparse.Namespace, capacity: int | None, engine: dict[str, int]) -> Any:
    from simulator.instance import InstanceConfig

    block_size = args.block_size or engine.get("block_size", 16)
    num_blocks = args.num_blocks or engine.get("num_blocks")
    if num_blocks is None:
        if capacity is None:
            raise ValueError("the latency model does not know the KV capacity; pass --num-blocks")
        num_blocks = capacity // block_size
    config = InstanceConfig(
        num_blocks=num_blocks,
        block_size=block_size,
        max_num_seqs=args.max_num_seqs or engine.get("max_num_seqs", 256),
        max_num_batched_tokens=args.max_num_batched_tokens
        or engine.get("max_num_batched_tokens", 8192),
        max_model_len=args.max_model_len or engine.get("max_model_len", 1 << 20),
        enable_prefix_caching=not args.no_prefix_caching,
        step_overhead_s=args.step_overhead_ms / 1000.0,
        num_cpu_blocks=args.num_cpu_blocks,
        num_disk_blocks=args.num_disk_blocks,
        cpu_bandwidth=args.cpu_bandwidth_gbps * 1e9 / 8,
        disk_bandwidth=args.disk_bandwidth_gbps * 1e9 / 8,
    )
    if min(config.num_blocks, config.block_size, config.max_num_seqs) < 1:
        raise ValueError("--num-blocks, --block-size and --max-num-seqs must be positive")
    if min(config.num_cpu_blocks, config.num_disk_blocks) < 0:
        raise ValueError("--num-cpu-blocks and --num-disk-blocks must be >= 0")
    if not min(config.cpu_bandwidth, config.disk_bandwidth) > 0:
        raise ValueError("--cpu-bandwidth-gbps and --disk-bandwidth-gbps must be positive")
    config.scheduler_config().validate()
    return config


def _simulate(
    args: argparse.Namespace,
    trace: Any,
    settings: Any,
    policies: list[str],
    meta: dict[str, Any],
) -> int:
    import json
    from concurrent.futures import ProcessPoolExecutor

    from tqdm import tqdm

    from simulator import report
    from simulator.experiment import SimResult, run_policy

    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    results: dict[str, dict[str, Any]] = {}
    ttfts = {}
    timing: dict[str, Any] = {}
    bar = tqdm(
        total=len(trace) * len(policies),
        unit="req",
        file=sys.stderr,
        disable=True if args.quiet else None,
        dynamic_ncols=True,
    )
    finished: dict[str, SimResult] = {}
    try:
        if args.jobs > 1 and len(policies) > 1:
            # Runs share nothing, so processes give the very results of a sequential run.
            with ProcessPoolExecutor(max_workers=min(args.jobs, len(policies))) as pool:
                futures = {
                    name: pool.submit(run_policy, trace, settings, name) for name in policies
                }
                for name, future in futures.items():
                    finished[name] = future.result()
                    bar.update(len(trace))
        else:
            for name in policies:
                bar.set_description(name)
                finished[name] = run_policy(trace, settings, name, on_progress=bar.update)
        for name in policies:
            result = finished[name]
            results[name] = result.summary
            cols = result.columns
            ttfts[name] = (cols["first_token"] - cols["arrival"]) * 1000.0
            timing[name] = {"wall_s": result.wall_s, "engine_steps": result.num_steps}
            report.write_requests_csv(out, name, cols)
            if not args.no_plots and result.load_times:
                report.plot_load(out, name, result.load_times, result.load_samples)
    finally:
        bar.close()
    report.write_json(out, meta, results)
    report.write_summary_csv(out, results)
    (out / "timing.json").write_text(json.dumps(timing, indent=2) + "\n")
    if not args.no_plots:
        report.plot_ttft_cdf(out, ttfts)
    if args.html is not None:
        from simulator.html_report import write_html

        write_html(args.html, meta, finished)
    fleet = f"{meta['instances']} instances"
    if "prefill_instances" in meta:
        fleet = (
            f"{meta['prefill_instances']} prefill + {meta['decode_instances']} decode + "
            f"{meta['instances']} mixed instances ({meta['pd_policy']} P/D, "
            f"{meta['transfer_link']['name']})"
        )
    print(
        f"{meta['requests']} requests, {fleet}, "
        f"{settings.latency.name}, rate x{meta['rate_scale']:g}"
    )
    print(report.markdown_table(results))
    for name, t in timing.items():
        print(
            f"{name}: simulated in {t['wall_s']:.2f} s ({t['engine_steps']} engine steps)",
            file=sys.stderr,
        )
    return 0
