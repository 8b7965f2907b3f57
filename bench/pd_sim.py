"""Colocated vs prefill/decode-disaggregated serving at the same GPU count, in the simulator.

For each model (DistServe's fitted OPT-13B (TP1) and OPT-66B (TP4, DistServe's vLLM setting) A100
profiles, the roofline Llama-2-70B on A100 TP4) and each trace (a prefill-heavy synthetic one like
LongBench summarization, the head of the Azure LLM conv trace like ShareGPT chat, and a
short-prompt one like HumanEval code completion), the same arrivals, rescaled to each rate, run on
`--gpus` GPUs in three or four colocated forms and as P:D splits of them (`kvherd sim`'s P/D path:
production's router and P/D policy, the first token on the prefill instance, the handoff through
the migration session on `--link`):

- ``chunked``: kvherd's default engine (chunked prefill, 8,192-token step budget);
- ``chunk-512``: Sarathi-style chunked prefill with a 512-token budget (DeepSpeed-MII's approach,
  DistServe's second baseline);
- ``no-chunk``: no chunked prefill, a prompt joins a step only whole (vLLM of DistServe's time,
  its first baseline); step budget = max model length (8,192). Decodes still ride along in a
  prefill step (the engine's unified budget), where vLLM then ran prefill-only steps first;
- ``no-chunk vllm`` (OPT only): the same priced by DistServe's fitted profile of vLLM's own
  kernels instead of DistServe's (as DistServe's simulator prices its vLLM baseline).

P/D instances run kvherd's default engine and P/D policy, whose conditional disaggregation keeps
prompts of <= 256 uncached tokens on their decode instance; on the short trace the splits also run
with every request handed off (``all``, DistServe's way). Every instance has the case's fixed
parallelism: unlike DistServe, no per-phase intra-/inter-op search, and a handoff is kvherd's
(the migration session on the prefill engine's thread, between its steps, at most
`MAX_HANDOFFS_OUT` at once), not DistServe's asynchronous pull; P/D cells show the handoffs' mean
first token -> commit time.

SLO attainment = the share of all requests in the trace (failed or unfinished ones count as
misses) meeting both the TTFT and the TPOT SLO, TPOT = (last token - first token) / (output - 1),
as DistServe computes it. SLOs are DistServe's published ones where it ran the closest workload
(chatbot OPT-13B 0.25 s / 0.1 s and OPT-66B 0.4 s / 0.1 s, code completion OPT-66B 0.125 s /
0.2 s, summarization OPT-66B 15 s / 0.15 s; its artifact's plotting script), else derived:
`--ttft-scale` x the unloaded prefill time of the trace's p90 prompt and `--tpot-scale` x the
unloaded decode step at the mean prompt length. Goodput = DistServe's: the highest rate with
attainment >= `--attainment` (90%), linear between rates run; the rate grid (per GPU, per case;
x4 on the short trace) is refined by `--refine` bisections of each curve's first crossing. The
summary puts the best split's goodput over each colocated form's next to DistServe's published
ratio for the closest setting. About 500 runs, ~12 min on two busy cores (one case at a time with
`--cases` is 3-5 min).

    python bench/pd_sim.py [--gpus 16] [--requests 300] [--cases opt-13b,opt-66b,llama-2-70b]
                           [--traces prefill-heavy,azure-conv,short] [--link nvlink] [--jobs 2]
"""

from __future__ import annotations

import argparse
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

AZURE_CONV = (
    Path(__file__).resolve().parents[2]
    / "shared"
    / "traces"
    / "azure-llm-2023"
    / "AzureLLMInferenceTrace_conv.csv"
)
NO_CHUNK_MAX_MODEL_LEN = 8192  # covers every request of the three traces


@dataclass(frozen=True, slots=True)
class Case:
    name: str
    latency: str
    gpus_per_instance: int
    rates_per_gpu: tuple[float, ...]  # offered load, requests/s per GPU


CASES = {
    "opt-13b": Case("opt-13b", "distserve:opt-13b:tp1", 1, (0.5, 1, 2, 4, 8, 16)),
    # TP4 as DistServe's vLLM baseline (at TP2 an instance holds 11,600 KV tokens: memory binds).
    "opt-66b": Case("opt-66b", "distserve:opt-66b:tp4", 4, (0.0625, 0.125, 0.25, 0.5, 1, 2)),
    "llama-2-70b": Case(
        "llama-2-70b", "roofline:llama-2-70b:a100-80gb:tp4", 4, (0.05, 0.1, 0.2, 0.4, 0.8, 1.6)
    ),
}
TRACES = {
    # Long prompts, short answers (LongBench summarization: 1,738 in / 91 out on average).
    "prefill-heavy": "synthetic:input_mean=1536,output_mean=64,length_sigma=0.5,max_input=4096",
    # Chat (ShareGPT: 755 / 200; this head of Azure conv: 928 / 260).
    "azure-conv": "azure-conv",
    # Short prompts (HumanEval: 171 / 98): prefill is cheap, a handoff buys little.
    "short": "synthetic:input_mean=128,output_mean=128,length_sigma=0.5",
}
# A trace's rates: the case's grid times this (short requests cost a fraction of the others).
RATE_SCALE = {"short": 4.0}


@dataclass(frozen=True, slots=True)
class Published:
    """DistServe's SLOs and goodput ratios (90% attainment, OSDI'24 §6.2) for one setting."""

    setting: str
    ttft_ms: float | None  # None: not published for it (SLOs derived)
    tpot_ms: float | None
    vs_vllm: float | None
    vs_mii: float | None


PUBLISHED = {
    ("opt-13b", "azure-conv"): Published("chatbot OPT-13B (ShareGPT)", 250, 100, 2.0, 1.6),
    ("opt-66b", "azure-conv"): Published("chatbot OPT-66B (ShareGPT)", 400, 100, 4.6, 7.4),
    ("opt-66b", "prefill-heavy"): Published(
        "summarization OPT-66B (LongBench)", 15000, 150, 4.3, 1.8
    ),
    ("opt-66b", "short"): Published("code completion OPT-66B (HumanEval)", 125, 200, 5.7, 1.6),
    # Fig. 1: 13B, 512 in / 64 out, one colocated GPU vs 2P+1D, per GPU (no SLO values given).
    ("opt-13b", "prefill-heavy"): Published("Fig. 1 synthetic 13B 512/64", None, None, 2.1, None),
}


@dataclass(frozen=True, slots=True)
class Config:
    label: str
    mixed: int
    prefill: int
    decode: int
    chunked: bool = True
    budget: int = 8192
    # Hand every request off (DistServe's way) instead of kvherd's conditional disaggregation,
    # which keeps prompts of <= 256 uncached tokens on their decode instance.
    always_handoff: bool = False
    # A DistServe profile of another engine (``vllm``: vLLM's own fitted kernels, as DistServe's
    # simulator prices its vLLM baseline); "" for the case's latency model.
    engine: str = ""

    @property
    def colocated(self) -> bool:
        return self.mixed > 0


def configs(case: Case, instances: int, trace_name: str) -> list[Config]:
    out = [
        Config("chunked", instances, 0, 0),
        Config("chunk-512", instances, 0, 0, budget=512),
        Config("no-chunk", instances, 0, 0, chunked=False, budget=NO_CHUNK_MAX_MODEL_LEN),
    ]
    if case.latency.startswith("distserve:"):
        out.append(
            Config(
                "no-chunk vllm",
                instances,
                0,
                0,
                chunked=False,
                budget=NO_CHUNK_MAX_MODEL_LEN,
                engine="vllm",
            )
        )
    out += [Config(f"{p}P:{d}D", 0, p, d) for p, d in splits(instances)]
    if trace_name == "short":  # conditional disaggregation hands off almost none of these
        out += [
            Config(f"{p}P:{d}D all", 0, p, d, always_handoff=True) for p, d in splits(instances)
        ]
    return out


def splits(instances: int) -> list[tuple[int, int]]:
    """P:D splits to try: prefill shares 1/4 .. 3/4 of the instances (each phase at least one)."""
    out: list[tuple[int, int]] = []
    for share in (0.25, 0.375, 0.5, 0.625, 0.75):
        p = min(max(round(instances * share), 1), instances - 1)
        if (p, instances - p) not in out:
            out.append((p, instances - p))
    return out


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


def slos(
    case: Case, trace_name: str, requests: int, scales: tuple[float, float]
) -> tuple[float, float, str]:
    """(TTFT ms, TPOT ms, where they come from) for a model on a trace (module docstring)."""
    import numpy as np

    from simulator.latency import load_latency_model

    published = PUBLISHED.get((case.name, trace_name))
    if published is not None and published.ttft_ms is not None and published.tpot_ms is not None:
        return published.ttft_ms, published.tpot_ms, "DistServe"
    model = load_latency_model(case.latency)
    prompts = np.array([r.input_length for r in _trace(trace_name, requests, 1.0).requests])
    p90 = int(np.percentile(prompts, 90))
    prefill = model.step_time([(p90, 0)], [])
    decode = model.step_time([], [int(prompts.mean())])
    return scales[0] * prefill * 1000.0, scales[1] * decode * 1000.0, "derived"


Job = tuple[str, str, int, float, Config, str, float, float]


def _run(job: Job) -> tuple[Job, dict[str, Any]]:
    case_name, trace_name, requests, rate, config, link_name, ttft_slo, tpot_slo = job
    import numpy as np

    from simulator.experiment import SimSettings, run_policy
    from simulator.instance import InstanceConfig
    from simulator.latency import load_latency_model
    from simulator.transfer import TransferModel, link

    case = CASES[case_name]
    model = load_latency_model(case.latency + (f":{config.engine}" if config.engine else ""))
    assert model.kv_capacity_tokens is not None
    instance = InstanceConfig(
        num_blocks=model.kv_capacity_tokens // 16,
        max_num_batched_tokens=config.budget,
        enable_chunked_prefill=config.chunked,
    )
    if not config.chunked:  # a whole prompt must fit one step
        instance.max_model_len = NO_CHUNK_MAX_MODEL_LEN
    settings = SimSettings(
        config.mixed,
        model,
        instance,
        prefill_instances=config.prefill,
        decode_instances=config.decode,
        transfer=TransferModel(link(link_name)),
    )
    if config.always_handoff:  # (the registry takes a {name, parameters} spec too)
        pd_spec = {"name": "kvherd", "parameters": {"local_prefill_tokens": 0}}
        settings.pd_policy = cast(str, pd_spec)
    trace = _trace(trace_name, requests, rate)
    result = run_policy(trace, settings, "kvherd")
    cols = result.columns
    ttft = (cols["first_token"] - cols["arrival"]) * 1000.0
    out = cols["output_tokens"]
    tpot = np.zeros(len(out))
    multi = out > 1
    tpot[multi] = (
        (cols["last_token"][multi] - cols["first_token"][multi]) * 1000.0 / (out[multi] - 1)
    )
    total = len(trace.requests)  # failed and unfinished requests miss both SLOs
    s = result.summary
    return job, {
        "both": float(((ttft <= ttft_slo) & (tpot <= tpot_slo)).sum()) / total,
        "ttft": float((ttft <= ttft_slo).sum()) / total,
        "tpot": float((tpot <= tpot_slo).sum()) / total,
        "ttft_p90": float(np.percentile(ttft, 90)) if len(ttft) else float("nan"),
        "tpot_p90": float(np.percentile(tpot[multi], 90)) if multi.any() else float("nan"),
        "handoffs": (
            s.get("handoffs_ok", 0),
            s.get("handoffs_ok", 0) + s.get("handoffs_fallback", 0),
        ),
        "hold_ms": s.get("handoff_downtime_ms_mean", float("nan")),
        "wall_s": result.wall_s,
    }


def goodput(rates: list[float], attainment: list[float], target: float) -> float:
    """The highest rate with attainment >= target before the first rate below it, linear between
    the two (DistServe's first crossing); 0 if the lowest rate misses it."""
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


def crossing(rates: list[float], attainment: list[float], target: float) -> float | None:
    """The midpoint of the first pass-then-miss bracket (the next rate to run), or None."""
    for i in range(len(rates) - 1):
        if attainment[i] >= target > attainment[i + 1]:
            return (rates[i] + rates[i + 1]) / 2
        if attainment[i] < target:
            return None
    return None


def _fmt_goodput(value: float, rates: list[float]) -> str:
    if value >= rates[-1]:
        return f">={value:.2f}"
    if value == 0.0:
        return f"<{rates[0]:.2f}"
    return f"{value:.2f}"


def _ratio(best: float, base: float) -> str:
    return f"{best / base:.2f}x" if base > 0 else "n/a"


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--gpus", type=int, default=16)
    parser.add_argument("--requests", type=int, default=300, help="trace head / synthetic size")
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--traces", default=",".join(TRACES))
    parser.add_argument("--link", default="nvlink", help="nvlink, rdma400 or rdma100")
    parser.add_argument("--attainment", type=float, default=0.9)
    parser.add_argument("--ttft-scale", type=float, default=3.0)
    parser.add_argument("--tpot-scale", type=float, default=5.0)
    parser.add_argument("--refine", type=int, default=1, help="bisections of each crossing")
    parser.add_argument("--jobs", type=int, default=2)
    args = parser.parse_args()
    cases = [CASES[c] for c in args.cases.split(",")]
    traces = args.traces.split(",")
    scales = (args.ttft_scale, args.tpot_scale)
    slo: dict[tuple[str, str], tuple[float, float, str]] = {}
    # (case, trace, config label) -> {rate: result}
    curves: dict[tuple[str, str, str], dict[float, dict[str, Any]]] = {}
    jobs: list[Job] = []
    for case in cases:
        for trace_name in traces:
            slo[case.name, trace_name] = ttft, tpot, _ = slos(
                case, trace_name, args.requests, scales
            )
            for config in configs(case, args.gpus // case.gpus_per_instance, trace_name):
                curves[case.name, trace_name, config.label] = {}
                for per_gpu in case.rates_per_gpu:
                    rate = per_gpu * args.gpus * RATE_SCALE.get(trace_name, 1.0)
                    jobs.append(
                        (case.name, trace_name, args.requests, rate, config, args.link, ttft, tpot)
                    )
    began = time.perf_counter()
    runs = 0
    with ProcessPoolExecutor(max_workers=args.jobs) as pool:
        for round_ in range(args.refine + 1):
            runs += len(jobs)
            for job, result in pool.map(_run, jobs):
                curves[job[0], job[1], job[4].label][job[3]] = result
            if round_ == args.refine:
                break
            refined: list[Job] = []
            for job in {(j[0], j[1], j[4].label): j for j in jobs}.values():
                points = curves[job[0], job[1], job[4].label]
                rates = sorted(points)
                mid = crossing(rates, [points[r]["both"] for r in rates], args.attainment)
                if mid is not None:
                    refined.append((job[0], job[1], job[2], mid, *job[4:]))
            jobs = refined
    print(
        f"# P/D vs colocated at {args.gpus} GPUs ({args.requests} requests a run, "
        f"{args.link} handoffs, kvherd P/D policy; attainment = both SLOs met, share of all "
        f"requests)\n"
    )
    summary: list[str] = []
    for case in cases:
        instances = args.gpus // case.gpus_per_instance
        for trace_name in traces:
            labels = [c.label for c in configs(case, instances, trace_name)]
            ttft, tpot, source = slo[case.name, trace_name]
            scale = RATE_SCALE.get(trace_name, 1.0)
            grid = [per_gpu * args.gpus * scale for per_gpu in case.rates_per_gpu]
            print(
                f"## {case.name} ({case.latency}, {instances} instances), {trace_name}; "
                f"SLO TTFT {ttft:.0f} ms, TPOT {tpot:.0f} ms ({source})\n"
            )
            print("cells: both-SLO attainment (TTFT-only / TPOT-only), p90 TTFT / TPOT ms\n")
            print("| rate (req/s) | " + " | ".join(labels) + " |")
            print("|---:|" + "---:|" * len(labels))
            for rate in grid:
                cells = []
                for label in labels:
                    r = curves[case.name, trace_name, label][rate]
                    extra = ""
                    if "P:" in label:  # handoffs ok / expected, first token -> commit
                        extra = f" [{r['handoffs'][0]}/{r['handoffs'][1]} h {r['hold_ms']:.0f} ms]"
                    cells.append(
                        f"{r['both']:.0%} ({r['ttft']:.0%}/{r['tpot']:.0%}) "
                        f"{r['ttft_p90']:.0f}/{r['tpot_p90']:.0f}{extra}"
                    )
                print(f"| {rate:g} | " + " | ".join(cells) + " |")
            good: dict[str, float] = {}
            for label in labels:
                points = curves[case.name, trace_name, label]
                rates = sorted(points)
                good[label] = goodput(rates, [points[r]["both"] for r in rates], args.attainment)
            print(
                f"\ngoodput at {args.attainment:.0%} attainment (req/s, grid refined): "
                + ", ".join(f"{label} {_fmt_goodput(good[label], grid)}" for label in labels)
                + "\n"
            )
            pd_labels = [label for label in labels if "P:" in label]
            best = max(pd_labels, key=lambda label: good[label])
            published = PUBLISHED.get((case.name, trace_name))
            claim = "none"
            if published is not None:
                parts = [
                    f"{published.vs_vllm}x vs vLLM" if published.vs_vllm else "",
                    f"{published.vs_mii}x vs DeepSpeed-MII" if published.vs_mii else "",
                ]
                claim = f"{published.setting}: " + ", ".join(p for p in parts if p)
            vllm = vs_vllm = "n/a"
            if "no-chunk vllm" in good:
                vllm = _fmt_goodput(good["no-chunk vllm"], grid)
                vs_vllm = _ratio(good[best], good["no-chunk vllm"])
            summary.append(
                f"| {case.name} | {trace_name} | {ttft:.0f} / {tpot:.0f} ({source}) | "
                f"{_fmt_goodput(good['chunked'], grid)} | "
                f"{_fmt_goodput(good['chunk-512'], grid)} | "
                f"{_fmt_goodput(good['no-chunk'], grid)} | {vllm} | "
                f"{best} {_fmt_goodput(good[best], grid)} | "
                f"{_ratio(good[best], good['chunked'])} | "
                f"{_ratio(good[best], good['chunk-512'])} | "
                f"{_ratio(good[best], good['no-chunk'])} | {vs_vllm} | {claim} |"
            )
    print("## summary (goodput in req/s at the same GPU count)\n")
    print(
        "| model | trace | SLO TTFT / TPOT ms | colocated chunked | colocated chunk-512 | "
        "colocated no-chunk | colocated no-chunk, vLLM kernels | best P:D | vs chunked | "
        "vs chunk-512 | vs no-chunk | vs no-chunk vLLM | DistServe, closest setting |"
    )
    print("|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    for row in summary:
        print(row)
    print(f"\n{runs} runs in {time.perf_counter() - began:.0f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
