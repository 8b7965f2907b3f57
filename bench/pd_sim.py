"""Colocated vs prefill/decode-disaggregated serving at the same GPU count, in the simulator.

For each model (DistServe's fitted OPT-13B and OPT-66B A100 profiles, the roofline Llama-2-70B on
A100 TP4) and each trace (a prefill-heavy synthetic one, the head of the Azure LLM conv trace, and
a short-prompt one where disaggregation should not help), the same arrivals, rescaled to each rate,
run on `--gpus` GPUs as all-mixed instances and as P:D splits of them (`kvherd sim`'s P/D path:
production's router and P/D policy, the first token on the prefill instance, the handoff through
the migration session on `--link`). SLO attainment = requests meeting both the TTFT and the TPOT
SLO, fixed per model and trace as DistServe's "SLO scale" does: `--ttft-scale` x the unloaded
prefill time of the trace's p90 prompt, `--tpot-scale` x the unloaded decode step at the mean
prompt length (DistServe's chatbot SLOs for OPT-13B, 0.25 s / 0.1 s, are about 3x / 5x these on
ShareGPT's prompts). DistServe's goodput = the highest rate whose attainment is at least `--attainment` (90%),
interpolated between the rates run. The verdict prints the best split's goodput over the
colocated one's, next to DistServe's published "up to 7.4x" (OSDI'24).

    python bench/pd_sim.py [--gpus 16] [--requests 400] [--cases opt-13b,opt-66b,llama-2-70b]
                           [--traces prefill-heavy,azure-conv,short] [--link nvlink] [--jobs 2]
"""

from __future__ import annotations

import argparse
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

AZURE_CONV = (
    Path(__file__).resolve().parents[2]
    / "shared"
    / "traces"
    / "azure-llm-2023"
    / "AzureLLMInferenceTrace_conv.csv"
)
DISTSERVE_CLAIM = 7.4  # OSDI'24: up to 7.4x more requests within SLO than colocated (vLLM)


@dataclass(frozen=True, slots=True)
class Case:
    name: str
    latency: str
    gpus_per_instance: int
    rates_per_gpu: tuple[float, ...]  # offered load, requests/s per GPU


# SLOs as DistServe's chatbot ones (OPT-13B 0.25 s / 0.1 s, OPT-66B 2.5 s / 0.15 s); the 70B
# like the 66B. Rate grids from well under to past the colocated fleet's capacity.
CASES = {
    "opt-13b": Case("opt-13b", "distserve:opt-13b:tp1", 1, (0.5, 1, 2, 3, 4, 6)),
    "opt-66b": Case("opt-66b", "distserve:opt-66b:tp2", 2, (0.25, 0.5, 1, 1.5, 2, 3)),
    "llama-2-70b": Case(
        "llama-2-70b",
        "roofline:llama-2-70b:a100-80gb:tp4",
        4,
        (0.1, 0.2, 0.4, 0.6, 0.8, 1.2),
    ),
}
TRACES = {
    # Long prompts, short answers (DistServe's summarization-like regime).
    "prefill-heavy": "synthetic:input_mean=1536,output_mean=64,length_sigma=0.5,max_input=4096",
    "azure-conv": "azure-conv",
    # Short prompts: prefill is cheap, a handoff buys nothing.
    "short": "synthetic:input_mean=128,output_mean=128,length_sigma=0.5",
}


def _trace(name: str, requests: int, rate: float) -> Any:
    from simulator.synthetic import generate, parse_spec
    from simulator.traces import head, load_trace, scale_rate

    spec = TRACES[name]
    if spec == "azure-conv":
        trace = head(load_trace(str(AZURE_CONV)), requests)
    else:
        trace = generate(parse_spec(f"{spec},requests={requests},rate=1,seed=0"))
    natural = (len(trace) - 1) / trace.duration_s if trace.duration_s > 0 else 1.0
    return scale_rate(trace, rate / natural)


def splits(instances: int) -> list[tuple[int, int]]:
    """P:D splits to try: prefill shares 1/4 .. 3/4 of the instances (each phase at least one)."""
    out: list[tuple[int, int]] = []
    for share in (0.25, 0.375, 0.5, 0.625, 0.75):
        p = min(max(round(instances * share), 1), instances - 1)
        if (p, instances - p) not in out:
            out.append((p, instances - p))
    return out


def slos(
    case: Case, trace_name: str, requests: int, scales: tuple[float, float]
) -> tuple[float, float]:
    """(TTFT, TPOT) SLOs in ms for a model on a trace (see the module docstring)."""
    import numpy as np

    from simulator.latency import load_latency_model

    model = load_latency_model(case.latency)
    prompts = np.array([r.input_length for r in _trace(trace_name, requests, 1.0).requests])
    p90 = int(np.percentile(prompts, 90))
    prefill = model.step_time([(p90, 0)], [])
    decode = model.step_time([], [int(prompts.mean())])
    return scales[0] * prefill * 1000.0, scales[1] * decode * 1000.0


Job = tuple[str, str, int, float, int, int, int, str, float, float]


def _run(job: Job) -> tuple[Any, ...]:
    case_name, trace_name, requests, rate, mixed, prefill, decode, link_name, ttft, tpot = job
    from simulator.experiment import SimSettings, run_policy
    from simulator.instance import InstanceConfig
    from simulator.latency import load_latency_model
    from simulator.transfer import TransferModel, link

    case = CASES[case_name]
    model = load_latency_model(case.latency)
    assert model.kv_capacity_tokens is not None
    settings = SimSettings(
        mixed,
        model,
        InstanceConfig(num_blocks=model.kv_capacity_tokens // 16),
        slo_ttft_ms=ttft,
        slo_tpot_ms=tpot,
        prefill_instances=prefill,
        decode_instances=decode,
        transfer=TransferModel(link(link_name)),
    )
    result = run_policy(_trace(trace_name, requests, rate), settings, "kvherd")
    return job, result.summary, result.wall_s


def goodput(rates: list[float], attainment: list[float], target: float) -> float:
    """The highest rate with attainment >= target, linear between the rates run (0 if none)."""
    best = 0.0
    for i, (rate, att) in enumerate(zip(rates, attainment, strict=True)):
        if att >= target:
            best = rate
            if i + 1 < len(rates) and attainment[i + 1] < target:
                nxt, att_next = rates[i + 1], attainment[i + 1]
                best = rate + (nxt - rate) * (att - target) / (att - att_next)
        else:
            break
    return best


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--gpus", type=int, default=16)
    parser.add_argument("--requests", type=int, default=400, help="trace head / synthetic size")
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--traces", default=",".join(TRACES))
    parser.add_argument("--link", default="nvlink", help="nvlink, rdma400 or rdma100")
    parser.add_argument("--attainment", type=float, default=0.9)
    parser.add_argument("--ttft-scale", type=float, default=3.0)
    parser.add_argument("--tpot-scale", type=float, default=5.0)
    parser.add_argument("--jobs", type=int, default=2)
    args = parser.parse_args()
    cases = [CASES[c] for c in args.cases.split(",")]
    traces = args.traces.split(",")
    jobs: list[Job] = []
    slo: dict[tuple[str, str], tuple[float, float]] = {}
    scales = (args.ttft_scale, args.tpot_scale)
    for case in cases:
        instances = args.gpus // case.gpus_per_instance
        configs = [(instances, 0, 0)] + [(0, p, d) for p, d in splits(instances)]
        for trace_name in traces:
            slo[case.name, trace_name] = ttft, tpot = slos(case, trace_name, args.requests, scales)
            for per_gpu in case.rates_per_gpu:
                rate = per_gpu * args.gpus
                for mixed, p, d in configs:
                    jobs.append(
                        (
                            case.name,
                            trace_name,
                            args.requests,
                            rate,
                            mixed,
                            p,
                            d,
                            args.link,
                            ttft,
                            tpot,
                        )
                    )
    began = time.perf_counter()
    results: dict[tuple[Any, ...], dict[str, Any]] = {}
    with ProcessPoolExecutor(max_workers=args.jobs) as pool:
        for job, summary, _ in pool.map(_run, jobs):
            results[job[:8]] = summary
    print(
        f"# P/D vs colocated at {args.gpus} GPUs ({args.requests} requests a run, "
        f"{args.link} handoffs, kvherd P/D policy; attainment = both SLOs met)\n"
    )
    verdicts: list[str] = []
    for case in cases:
        instances = args.gpus // case.gpus_per_instance
        configs = [(instances, 0, 0)] + [(0, p, d) for p, d in splits(instances)]
        labels = [f"{m} mixed" if m else f"{p}P:{d}D" for m, p, d in configs]
        for trace_name in traces:
            rates = [per_gpu * args.gpus for per_gpu in case.rates_per_gpu]
            ttft, tpot = slo[case.name, trace_name]
            print(
                f"## {case.name} ({case.latency}, {instances} instances), {trace_name}; "
                f"SLO TTFT {ttft:.0f} ms, TPOT {tpot:.0f} ms\n"
            )
            print("| rate (req/s) | " + " | ".join(labels) + " |")
            print("|---:|" + "---:|" * len(labels))
            curves: dict[str, list[float]] = {label: [] for label in labels}
            for rate in rates:
                cells = []
                for label, (m, p, d) in zip(labels, configs, strict=True):
                    s = results[(case.name, trace_name, args.requests, rate, m, p, d, args.link)]
                    curves[label].append(s["slo_attainment"])
                    extra = ""
                    if p:
                        extra = (
                            f" ({s['handoffs_ok']}/{s['handoffs_ok'] + s['handoffs_fallback']} h)"
                        )
                    cells.append(
                        f"{s['slo_attainment']:.0%} ttft {s['ttft_ms_p90']:.0f} "
                        f"tpot {s['tpot_ms_p90']:.0f}{extra}"
                    )
                print(f"| {rate:g} | " + " | ".join(cells) + " |")
            good = {label: goodput(rates, curves[label], args.attainment) for label in labels}
            best = max(labels[1:], key=lambda label: good[label])
            colocated = good[labels[0]]
            ratio = good[best] / colocated if colocated > 0 else float("inf")
            print(
                f"\ngoodput at {args.attainment:.0%} attainment (req/s): "
                + ", ".join(f"{label} {good[label]:.2f}" for label in labels)
            )
            verdict = (
                f"{case.name} / {trace_name}: best split {best} {good[best]:.2f} req/s vs "
                f"colocated {colocated:.2f} req/s = {ratio:.2f}x (DistServe: up to "
                f"{DISTSERVE_CLAIM}x)"
            )
            print(f"{verdict}\n")
            verdicts.append(verdict)
    print("## verdicts\n")
    for verdict in verdicts:
        print(f"- {verdict}")
    print(f"\n{len(jobs)} runs in {time.perf_counter() - began:.0f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
