"""Simulator speed and memory: wall time and peak RSS per policy run, linearity, extrapolation.

Scenarios (each policy run in a fresh subprocess, so peak RSS is that run's own):
  azure     Azure LLM inference conv trace (19,366 requests) on 4 instances, llama-2-7b / A100.
  mooncake  Mooncake synthetic trace (3,993 requests, 15k-token prompts) on 16 instances,
            llama-2-70b / 4x A100.
  linear    the Azure trace at 1/4, 1/2 and all of its requests: seconds per request must stay flat.
  million   a synthetic 1M-request trace on 256 instances; `--million-sample K` runs its first K
            requests and extrapolates linearly to 1M (the printout says so).
`--baseline COMMIT` pairs the current tree with that commit's code, checked out into a temporary
git worktree (removed on exit); a commit from the days of the mypyc build (it has a setup.py) is
compiled in place first (`setup.py build_ext --inplace`), so the current tree is measured against
the compiled form it replaced. The order rotates from round to round (`--pairs` rounds); printed:
each run as a JSON line on stderr, then medians of wall and sim CPU s, the speed-up as the median
of per-round ratios, and whether the runs agree on engine steps and mean TTFT (an older commit may
legitimately differ, and the printout says so). The child runner uses only what the simulator
offers since 4e94c9a (SimSettings, run_policy, load_trace, head, synthetic generate), so it drives
that tree too; it reports the form that ran ("compiled" or "plain" in trees of the mypyc days).
`--step-by-step` also runs every azure/mooncake policy with the decode fast-forward off (one
`schedule()` per engine step, the simulator before the fast-forward) and prints the speed-up; both
runs must report the same steps and mean TTFT.
Wall time is what the targets name; sim CPU s (the run's own process time) is the steadier
figure on a shared machine. Reference printed side by side: Vidur on the same Azure run (~50 s,
~4 GB, the issue's figures for these machines; Vidur is not installed here) and the targets
(<= 5 s and <= 500 MB per policy run, 1M requests in <= 10 min).

    python bench/sim_speed.py [--scenarios azure,mooncake,linear,million] [--policies round_robin,kvherd]
                              [--baseline COMMIT] [--pairs 3]
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

TRACES = Path(__file__).resolve().parents[2] / "shared" / "traces"
AZURE = TRACES / "azure-llm-2023" / "AzureLLMInferenceTrace_conv.csv"
MOONCAKE = TRACES / "mooncake" / "synthetic_trace.jsonl"
MILLION = (
    "synthetic:requests=1000000,rate=2000,input_mean=1024,output_mean=128,num_groups=5000,"
    "prefix_tokens=512,max_input=8192,seed=0"
)
AZURE_MODEL = "roofline:llama-2-7b:a100-80gb"
MOONCAKE_MODEL = "roofline:llama-2-70b:a100-80gb:tp4"
VIDUR_AZURE = {"wall_s": 50.0, "peak_rss_mb": 4096.0}


def _one(
    trace_spec: str,
    instances: int,
    policy: str,
    latency: str,
    max_requests: int | None,
    fast_forward: bool = True,
) -> None:
    """Child mode: one policy run; prints a JSON line with its figures."""
    from simulator.experiment import SimSettings, run_policy
    from simulator.instance import InstanceConfig
    from simulator.latency import load_latency_model
    from simulator.synthetic import generate, parse_spec
    from simulator.traces import head, load_trace

    start = time.perf_counter()
    if trace_spec.startswith("synthetic:"):
        spec = parse_spec(trace_spec)
        if max_requests is not None:  # the first K requests of the very same trace
            spec = type(spec)(
                **{**{f: getattr(spec, f) for f in spec.__slots__}, "requests": max_requests}
            )
        trace = generate(spec)
    else:
        trace = load_trace(trace_spec)
        if max_requests is not None:
            trace = head(trace, max_requests)
    load_s = time.perf_counter() - start
    model = load_latency_model(latency)
    assert model.kv_capacity_tokens is not None
    settings = SimSettings(
        instances,
        model,
        InstanceConfig(num_blocks=model.kv_capacity_tokens // 16),
        fast_forward=fast_forward,
    )
    cpu_start = time.process_time()
    result = run_policy(trace, settings, policy)
    cpu_s = time.process_time() - cpu_start
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0
    form_module = sys.modules.get("kvherd.compiled")  # only in trees of the mypyc days
    print(
        json.dumps(
            {
                "requests": len(trace),
                "load_s": load_s,
                "sim_s": result.wall_s,
                "sim_cpu_s": cpu_s,
                "peak_rss_mb": peak_mb,
                "steps": result.num_steps,
                "completed": result.summary["completed"],
                "ttft_ms_mean": result.summary["ttft_ms_mean"],
                "form": getattr(form_module, "FORM", "plain"),
            }
        )
    )


def _spawn(
    trace: str,
    instances: int,
    policy: str,
    latency: str,
    max_requests: int | None,
    fast_forward: bool = True,
    tree: Path | None = None,
) -> dict[str, float]:
    """One child run; `tree` (a --baseline checkout) replaces the import path with that tree's."""
    cmd = [sys.executable, __file__, "--child", trace, str(instances), policy, latency]
    cmd += [str(max_requests or 0), str(int(fast_forward))]
    env = {k: v for k, v in os.environ.items() if k != "KVHERD_PURE_PYTHON"}
    env.update({"PYTHONPATH": str(tree)} if tree is not None else {})
    done = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise SystemExit(f"child run failed ({' '.join(cmd)}):\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


@contextlib.contextmanager
def _checkout(commit: str) -> Iterator[Path]:
    """`commit` in a temporary git worktree of this repository, removed on exit."""
    tree = Path(tempfile.mkdtemp(prefix="sim-speed-baseline-")) / "tree"
    git = ["git", "-C", str(REPO), "worktree"]
    subprocess.run([*git, "add", "--detach", str(tree), commit], check=True, capture_output=True)
    try:
        if (tree / "setup.py").is_file():  # the mypyc days: measure the compiled form it shipped
            build = [sys.executable, "setup.py", "-q", "build_ext", "--inplace"]
            subprocess.run(build, cwd=tree, check=True, capture_output=True)
        yield tree
    finally:
        subprocess.run([*git, "remove", "--force", str(tree)], check=True, capture_output=True)
        tree.parent.rmdir()


def _row(name: str, policy: str, r: dict[str, float], note: str = "") -> str:
    total = r["load_s"] + r["sim_s"]
    return (
        f"| {name} | {policy} | {int(r['requests']):,} | {total:.1f} | {r['sim_cpu_s']:.1f} "
        f"| {r['sim_s'] / r['requests'] * 1e3:.2f} "
        f"| {r['peak_rss_mb']:.0f} | {int(r['steps']):,} | {note} |"
    )


def _rounds(
    forms: list[str],
    baseline: Path | None,
    rounds: int,
    name: str,
    policy: str,
    trace: str,
    instances: int,
    latency: str,
    k: int | None,
    note: Callable[[dict[str, float]], str] = lambda r: "",
) -> None:
    """Interleaved rounds of `forms` ("current", "baseline"), the order
    rotating each round; prints each form's medians (with `note` of them), the speed-ups and the
    agreement."""
    runs: dict[str, list[dict[str, float]]] = {form: [] for form in forms}
    for r in range(rounds):
        for form in forms[r % len(forms) :] + forms[: r % len(forms)]:
            tree = baseline if form == "baseline" else None
            run = _spawn(trace, instances, policy, latency, k, tree=tree)
            runs[form].append(run)
            print(json.dumps({"scenario": name, "round": r, "as": form, **run}), file=sys.stderr)
    medians = {
        form: {key: statistics.median(float(r[key]) for r in rs) for key in rs[0] if key != "form"}
        for form, rs in runs.items()
    }
    for form in forms:
        label = f"{form}, {runs[form][0]['form']}"
        print(_row(name, f"{policy} ({label})", medians[form], note(medians[form])), flush=True)
    notes = []
    for fast, slow in itertools.combinations(forms, 2):
        cpu = [s["sim_cpu_s"] / f["sim_cpu_s"] for f, s in zip(runs[fast], runs[slow], strict=True)]
        wall = [
            (s["load_s"] + s["sim_s"]) / (f["load_s"] + f["sim_s"])
            for f, s in zip(runs[fast], runs[slow], strict=True)
        ]
        notes.append(
            f"{fast}/{slow} {statistics.median(cpu):.2f}x sim CPU ({statistics.median(wall):.2f}x wall)"
        )
    outcome = {form: {(r["steps"], r["ttft_ms_mean"]) for r in rs} for form, rs in runs.items()}
    current = [form for form in forms if form != "baseline"]
    if any(len(outcome[form]) > 1 for form in forms):
        agree = "runs of one form DIFFER (not deterministic)"
    elif len({o for form in current for o in outcome[form]}) > 1:
        agree = "the current runs DIFFER in steps or mean TTFT"
    else:
        agree = "same steps and mean TTFT"
        if baseline is not None:
            (steps, ttft), (b_steps, b_ttft) = outcome[current[0]].pop(), outcome["baseline"].pop()
            agree += (
                "; the baseline agrees"
                if (steps, ttft) == (b_steps, b_ttft)
                else f"; the baseline differs: {int(b_steps):,} steps, TTFT {b_ttft:.2f} ms "
                f"against {int(steps):,}, {ttft:.2f} ms (its code differs)"
            )
    print(
        f"| {name} | {policy}: median of {rounds} rounds | | | | | | | {'; '.join(notes)}; {agree} |"
    )


def _runs(
    step_by_step: bool,
    name: str,
    policy: str,
    trace: str,
    instances: int,
    latency: str,
    k: int | None,
) -> None:
    """One policy run (and, with `step_by_step`, the same run without the fast-forward)."""
    r = _spawn(trace, instances, policy, latency, k)
    print(_row(name, policy, r), flush=True)
    if step_by_step:
        slow = _spawn(trace, instances, policy, latency, k, fast_forward=False)
        same = slow["steps"] == r["steps"] and slow["ttft_ms_mean"] == r["ttft_ms_mean"]
        note = f"fast-forward {slow['sim_s'] / r['sim_s']:.2f}x faster; same results: {same}"
        print(_row(name, f"{policy} (step by step)", slow, note), flush=True)


def _measure(args: argparse.Namespace, baseline: Path | None) -> None:
    scenarios = args.scenarios.split(",")
    policies = args.policies.split(",")
    forms = ["current"] + (["baseline"] if baseline is not None else [])

    def scenario(
        name: str, policy: str, trace: str, instances: int, latency: str, k: int | None
    ) -> None:
        if len(forms) > 1:
            _rounds(forms, baseline, args.pairs, name, policy, trace, instances, latency, k)
        else:
            _runs(args.step_by_step, name, policy, trace, instances, latency, k)

    print(
        "| scenario | policy | requests | wall s (load+sim) | sim CPU s | sim ms/request "
        "| peak RSS MB | engine steps | note |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|---|")
    if "azure" in scenarios and AZURE.is_file():
        k = None if args.fraction >= 1 else int(19366 * args.fraction)
        for policy in policies:
            scenario("azure conv, 4 inst", policy, str(AZURE), 4, AZURE_MODEL, k)
        v = VIDUR_AZURE
        print(
            f"| azure conv, 4 inst | Vidur (issue's figure) | 19,366 | ~{v['wall_s']:.0f} "
            f"| | | ~{v['peak_rss_mb']:.0f} | | not run here |"
        )
        print("| target | | | <= 5 | | | <= 500 | | |")
    if "mooncake" in scenarios and MOONCAKE.is_file():
        k = None if args.fraction >= 1 else int(3993 * args.fraction)
        for policy in policies:
            scenario("mooncake, 16 inst", policy, str(MOONCAKE), 16, MOONCAKE_MODEL, k)
    if "linear" in scenarios and AZURE.is_file():
        for frac in (0.25, 0.5, 1.0):
            k = int(19366 * frac * args.fraction)
            r = _spawn(str(AZURE), 4, policies[0], "roofline:llama-2-7b:a100-80gb", k)
            print(_row(f"azure first {frac:.0%}", policies[0], r), flush=True)
    if "million" in scenarios:

        def extrapolated(r: dict[str, float]) -> str:
            per_request = (r["load_s"] + r["sim_s"]) / r["requests"]
            cpu_per_request = (r["load_s"] + r["sim_cpu_s"]) / r["requests"]
            return (
                f"first {int(r['requests']):,} of 1M; 1M extrapolated: "
                f"{per_request * 1e6 / 60:.1f} min ({cpu_per_request * 1e6 / 60:.1f} min of CPU)"
            )

        name, model = "synthetic 1M, 256 inst", "roofline:llama-2-7b:a100-80gb"
        for policy in policies:
            if len(forms) > 1:
                _rounds(
                    forms,
                    baseline,
                    args.pairs,
                    name,
                    policy,
                    MILLION,
                    256,
                    model,
                    args.million_sample,
                    extrapolated,
                )
            else:
                r = _spawn(MILLION, 256, policy, model, args.million_sample)
                print(_row(name, policy, r, extrapolated(r)), flush=True)
        print("| target | | 1,000,000 | <= 600 | | | | | |")


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child = sys.argv[2:]
        _one(child[0], int(child[1]), child[2], child[3], int(child[4]) or None, child[5] == "1")
        return 0
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--scenarios", default="azure,mooncake,linear,million")
    parser.add_argument("--policies", default="round_robin,kvherd")
    parser.add_argument("--million-sample", type=int, default=20000)
    parser.add_argument(
        "--fraction", type=float, default=1.0, help="run this fraction of azure/mooncake"
    )
    parser.add_argument(
        "--baseline",
        metavar="COMMIT",
        help="also run each scenario but linear from COMMIT's code (a temporary worktree)",
    )
    parser.add_argument("--pairs", type=int, default=3, help="rounds with --baseline")
    parser.add_argument(
        "--step-by-step",
        action="store_true",
        help="also run azure/mooncake with the decode fast-forward off, side by side",
    )
    args = parser.parse_args()
    with _checkout(args.baseline) if args.baseline else contextlib.nullcontext() as baseline:
        _measure(args, baseline)
    return 0


if __name__ == "__main__":
    sys.exit(main())
