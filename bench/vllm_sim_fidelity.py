"""Simulator fidelity on vLLM: one Mooncake trace through two real vLLM servers and through `kvherd sim`.

Steps: two vLLM CPU servers of a tiny Llama (prefix caching, KV events, 16 batch slots); `kvherd
profile --url` fits the latency model of one of them from outside while it is idle, and the
median extra time of one-token requests through `kvherd serve` joins its request path; for each
policy a fresh pair behind `kvherd serve` replays the head of the Mooncake sample (prompts shrunk
`--shrink`x, outputs capped) with `kvherd replay`; then one `kvherd sim` of the same trace on two
instances with that profile (`--latency-model calibrated:P --profile P`) and vLLM's engine limits.
Prints, per policy, real and simulated TTFT mean / p50 / p99 and the per-request median of sim /
real TTFT. Needs ``KVHERD_VLLM_PYTHON`` (a vLLM CPU 0.32 interpreter).

Run: ``KVHERD_VLLM_PYTHON=V/bin/python python bench/vllm_sim_fidelity.py [--requests 200]``.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "support"))
_support = importlib.import_module("vllm_fleet")  # tests/support's


def _bench(name: str) -> Any:
    """bench/NAME.py, by path: bench/vllm_fleet.py has the test helpers' module name."""
    spec = importlib.util.spec_from_file_location(f"bench_{name}", ROOT / "bench" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


fidelity = _bench("sim_fidelity")  # the shrunk trace and the per-request pairing
peers = _bench("vllm_fleet")  # kvherd serve in front of two vLLM servers

METRICS = (
    ("ttft_ms_mean", "TTFT mean ms"),
    ("ttft_ms_p50", "TTFT p50 ms"),
    ("ttft_ms_p99", "TTFT p99 ms"),
)


def _kvherd(*args: str) -> None:
    command = [sys.executable, "-m", "kvherd", *args]
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL, cwd=ROOT)


def _pair(python: str, model: Path, work: Path) -> Any:
    specs = [_support.VllmSpec(name) for name in ("a", "b")]
    return _support.vllm_servers(python, model, specs, work)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--shrink", type=int, default=8, help="prompt lengths divided by this")
    parser.add_argument("--max-output", type=int, default=48)
    parser.add_argument("--rate-scale", type=float, default=1.0)
    parser.add_argument("--policies", default="round_robin,kvherd")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    python = os.environ.get("KVHERD_VLLM_PYTHON")
    if not python:
        print("set KVHERD_VLLM_PYTHON to a vLLM CPU interpreter", file=sys.stderr)
        return 2
    args.model = "tiny"
    policies = args.policies.split(",")
    out = args.out or Path(tempfile.mkdtemp(prefix="kvherd-vllm-fidelity-"))
    out.mkdir(parents=True, exist_ok=True)
    trace = fidelity._shrunk_trace(out, args)
    id_block = str(512 // args.shrink)
    model = _support.build_tiny_llama(out / "tiny_llama")
    profile = out / "vllm-profile.json"
    with _pair(python, model, out) as (a, b):
        _kvherd("profile", "--url", a.url, "--out", str(profile), "--max-context", "2048")
        with peers.kvherd(a, b, model) as proxy:
            path_s = _proxy_path_s(a.url, proxy.url)
    fitted = json.loads(profile.read_text())
    engine = fitted["engine"]
    direct_s = fitted["host"]["request_overhead_s"]
    fitted["host"]["request_overhead_s"] = direct_s + path_s
    profile = out / "vllm-profile-through-kvherd.json"
    profile.write_text(json.dumps(fitted, indent=1) + "\n")
    print(
        f"request path: {direct_s * 1e3:.1f} ms direct (fit) + {path_s * 1e3:.1f} ms through kvherd"
    )
    for policy in policies:
        flags = ("--policy", policy, "--expose-instance")
        with _pair(python, model, out) as (a, b), peers.kvherd(a, b, model, *flags) as proxy:
            _kvherd(
                "replay", str(trace), "--url", proxy.url, "--out", str(out / f"real_{policy}"),
                "--quiet", "--no-plots", "--id-block-size", id_block, "--label", policy,
            )  # fmt: skip
    _kvherd(
        "sim", str(trace), "--instances", "2", "--policy", ",".join(policies),
        "--latency-model", f"calibrated:{profile}", "--profile", str(profile),
        "--id-block-size", id_block, "--block-size", str(engine["block_size"]),
        "--max-num-seqs", "16", "--max-model-len", str(engine["max_model_len"]),
        "--out", str(out / "sim"), "--quiet", "--no-plots",
    )  # fmt: skip
    simulated = json.loads((out / "sim" / "summary.json").read_text())["results"]
    print(
        f"{len(trace.read_text().splitlines())} Mooncake requests shrunk {args.shrink}x, "
        f"2 vLLM servers; out {out}"
    )
    print("\n| policy | metric | real | sim | error |\n|---|---|---:|---:|---:|")
    for policy in policies:
        real = json.loads((out / f"real_{policy}" / "summary.json").read_text())["results"][policy]
        for key, label in METRICS:
            err = (simulated[policy][key] - real[key]) / real[key]
            print(
                f"| {policy} | {label} | {real[key]:.4g} | {simulated[policy][key]:.4g} | {err:+.1%} |"
            )
        csv_name = f"requests_{policy}.csv"
        ratio = fidelity._paired_ttft_ratio(
            [out / f"real_{policy}" / csv_name], out / "sim" / csv_name
        )
        print(
            f"| {policy} | TTFT per request, median sim/real | | {ratio:.3f} | {ratio - 1:+.1%} |"
        )
    return 0


def _proxy_path_s(direct: str, proxy: str, rounds: int = 30) -> float:
    """Median time one-token completions take through the proxy less straight to the server
    (fresh 16-token prompts, sequential, alternating): the path the profile does not see."""
    rng = random.Random(7)
    times: dict[str, list[float]] = {direct: [], proxy: []}
    with httpx.Client(timeout=60, trust_env=False) as client:
        for _ in range(rounds):
            for url in (direct, proxy):
                body = {
                    "model": _support.SERVED_MODEL,
                    "prompt": [rng.randrange(3, 200) for _ in range(16)],
                    "max_tokens": 1,
                }
                start = time.perf_counter()
                client.post(f"{url}/v1/completions", json=body).raise_for_status()
                times[url].append(time.perf_counter() - start)
    return max(0.0, statistics.median(times[proxy]) - statistics.median(times[direct]))


if __name__ == "__main__":
    sys.exit(main())
