"""The autoscaler in the simulator on a day-shaped trace, against the fixed fleet `kvherd plan` sizes.

What it does: the trace (default: a synthetic conversation trace of shared prefixes whose
prompts every fleet size can serve; Mooncake's longest prompts miss any TTFT target a fleet size
could fix) warped to one day over its span (``--diurnal SPAN:TROUGH``: the night's rate
``--trough`` of the peak); ``kvherd plan`` finds the fewest fixed instances that meet
``--attainment`` of requests within ``--ttft`` s; ``kvherd sim`` runs that fixed fleet, and
``kvherd sim --autoscale 1:MAX`` (``MAX`` the planned count) once per ``--slots`` value (the
requests one instance serves at the target: the controller's only sizing knob). Prints
instance-hours held and SLO attainment per run.

Run: ``python bench/autoscale_sim.py [--max-requests K] [--jobs 2]`` (``--json FILE`` keeps the
rows). Simulated time only: the figures do not depend on this machine's load.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
TRACE = (
    "synthetic:requests=40000,rate=48,input_mean=1500,output_mean=150,num_groups=40,"
    "prefix_tokens=1024,seed=1"
)
LATENCY = "roofline:llama-2-7b:a100-80gb"


def trace_args(args: argparse.Namespace, span_s: float) -> list[str]:
    out = [args.trace, "--latency-model", LATENCY, "--diurnal", f"{span_s}:{args.trough}"]
    if args.max_requests:
        out += ["--max-requests", str(args.max_requests)]
    return out


def trace_span_s(spec: str, max_requests: int | None) -> float:
    from simulator.synthetic import generate, parse_spec
    from simulator.traces import head, load_trace

    trace = generate(parse_spec(spec)) if spec.startswith("synthetic:") else load_trace(spec, 512)
    if max_requests:
        trace = head(trace, max_requests)
    times = [r.arrival_s for r in trace.requests]
    return max(times) - min(times)


def kvherd(*argv: str) -> None:
    done = subprocess.run([sys.executable, "-m", "kvherd", *argv], capture_output=True, text=True)
    if done.returncode not in (0, 1):  # plan answers 1 when nothing meets the SLOs
        raise RuntimeError(f"kvherd {' '.join(argv)}:\n{done.stdout}\n{done.stderr}")


def simulate(name: str, args: argparse.Namespace, span_s: float, *extra: str) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as out:
        kvherd("sim", *trace_args(args, span_s), "--slo-ttft", str(1000 * args.ttft),
               "--out", out, "--no-plots", *extra)  # fmt: skip
        summary = json.loads((Path(out) / "summary.json").read_text())["results"]["kvherd"]
    keys = ("instance_hours", "slo_attainment", "ttft_ms_p50", "ttft_ms_p99", "instances_max",
            "scale_outs", "scale_ins", "prefix_hit_rate")  # fmt: skip
    return {"run": name, **{k: summary.get(k) for k in keys}}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trace", default=TRACE, help="a trace file or synthetic spec")
    parser.add_argument("--max-requests", type=int, default=None)
    parser.add_argument("--trough", type=float, default=0.2)
    parser.add_argument("--ttft", type=float, default=1.0, help="per-request TTFT target, s")
    parser.add_argument("--attainment", type=float, default=0.95)
    parser.add_argument("--slots", default="16,32,64,128", help="--autoscale-slots values to try")
    parser.add_argument(
        "--instance-start",
        type=float,
        default=5.0,
        help="an added instance's cold start, s (5 of an 832 s day: about 9 minutes of a real one)",
    )
    parser.add_argument("--max-instances", type=int, default=32, help="the plan's search bound")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    span = trace_span_s(args.trace, args.max_requests)
    with tempfile.TemporaryDirectory() as out:
        planned = Path(out) / "plan.json"
        kvherd("plan", *trace_args(args, span), "--slo", f"attainment={args.attainment}",
               "--request-ttft", str(args.ttft), "--instances", f"1:{args.max_instances}",
               "--workers", str(args.jobs), "--json", str(planned))  # fmt: skip
        plan = json.loads(planned.read_text())
    best = plan.get("cheapest")
    if not best:
        print(f"no fixed fleet of at most {args.max_instances} meets the SLO")
        return 1
    fixed = int(best["instances"])
    start = str(args.instance_start)
    runs: list[tuple[str, tuple[str, ...]]] = [
        (f"fixed {fixed} (kvherd plan)", ("--instances", str(fixed)))
    ]
    runs += [
        (
            f"autoscale 1:{fixed}, {s} slots",
            ("--autoscale", f"1:{fixed}", "--autoscale-slots", s, "--instance-start", start),
        )
        for s in args.slots.split(",")
    ]
    with ThreadPoolExecutor(args.jobs) as pool:
        rows = list(pool.map(lambda run: simulate(run[0], args, span, *run[1]), runs))
    print(f"{args.trace} ({args.max_requests or 'all'} requests), one day over {span:.0f} s, "
          f"trough {args.trough}; SLO: {args.attainment:.0%} of requests within "
          f"{args.ttft} s TTFT; {LATENCY}; cold start {args.instance_start} s")  # fmt: skip
    print("| run | instance-hours | SLO attainment | TTFT p50 / p99 ms | instances at most | "
          "scale-outs / -ins | hit rate |")  # fmt: skip
    print("|---|---:|---:|---|---:|---|---:|")
    for r in rows:
        scaled = f"{r['scale_outs']} / {r['scale_ins']}" if r["scale_outs"] is not None else "-"
        print(f"| {r['run']} | {r['instance_hours']:.2f} | {r['slo_attainment']:.1%} | "
              f"{r['ttft_ms_p50']:.0f} / {r['ttft_ms_p99']:.0f} | "
              f"{r['instances_max'] or fixed} | {scaled} | {r['prefix_hit_rate']:.1%} |")  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
