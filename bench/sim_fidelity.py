"""Simulator fidelity: the same scaled-down trace through a real local fleet and through `kvherd sim`.

Steps, all on this machine:
  1. `kvherd profile` fits the calibrated latency model of the built-in engine (model `tiny` by
     default) with the very engine configuration the agents run.
  2. For each policy: `kvherd up -n N --policy P` (real agents + proxy), `kvherd replay` of the trace
     through the proxy, then shutdown.
  3. `kvherd sim` of the same trace with the calibrated model, N instances, the same policies, plus
     the fleet's serving overheads measured by probes before the replay (not fitted to it): the
     request path (median TTFT of tiny one-token requests minus the model's step time) and the
     serving loop's per-step cost (TPOT of a lone 64-token request minus the model's decode step).
The trace is the Mooncake trace scaled down to fit the tiny model's 2,048-token context: the first
`--requests` requests that fit, every length divided by `--shrink` and the hash-id block shrunk alike
(512/shrink tokens), so the prefix-sharing structure is kept; outputs are capped at `--max-output`.
Printed side by side: TTFT p50/p90, TPOT p50 and hit rate, real vs simulated, with relative errors
(target: within 10%).

    python bench/sim_fidelity.py [--policies round_robin,kvherd] [--instances 2] [--requests 60]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

MOONCAKE = (
    Path(__file__).resolve().parents[2] / "shared" / "traces" / "mooncake" / "synthetic_trace.jsonl"
)
METRICS = (
    ("ttft_ms_p50", "TTFT p50 ms"),
    ("ttft_ms_p90", "TTFT p90 ms"),
    ("tpot_ms_p50", "TPOT p50 ms"),
)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _shrunk_trace(
    out: Path, requests: int, shrink: int, max_output: int, rate_scale: float
) -> Path:
    lines: list[dict[str, object]] = []
    with MOONCAKE.open() as f:
        for raw in f:
            if len(lines) == requests:
                break
            row = json.loads(raw)
            length = max(1, row["input_length"] // shrink)
            if length + max_output > 2000:  # keep within the tiny model's 2,048-token context
                continue
            block = 512 // shrink
            ids = row["hash_ids"][: -(-length // block)]
            lines.append(
                {
                    "timestamp": row["timestamp"] / rate_scale,
                    "input_length": length,
                    "output_length": min(row["output_length"], max_output),
                    "hash_ids": ids,
                }
            )
    path = out / "trace.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def _kvherd(*args: str) -> list[str]:
    return [sys.executable, "-m", "kvherd", *args]


def _stream(url: str, prompt: list[int], max_tokens: int) -> tuple[float, float]:
    """(TTFT, E2E) in seconds of one streamed completion."""
    body = {
        "model": "tiny",
        "prompt": prompt,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": 0.0,
        "stream": True,
    }
    model = httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]
    body["model"] = model
    start = time.perf_counter()
    first = last = 0.0
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as response:
        for line in response.iter_lines():
            if line.startswith("data:") and '"choices"' in line:
                last = time.perf_counter() - start
                first = first or last
    return first, last


def _overheads(url: str, profile: Path) -> tuple[float, float]:
    """(request overhead, step overhead) in ms, from probes the trace does not contain."""
    import statistics

    from simulator.latency import load_latency_model

    model = load_latency_model(f"calibrated:{profile}")
    ttfts = [_stream(url, list(range(10, 26)), 1)[0] for _ in range(7)]
    request = statistics.median(ttfts) - model.step_time([(16, 0)], [])
    runs = [_stream(url, list(range(30, 46)), 64) for _ in range(3)]
    tpot = statistics.median((e2e - ttft) / 63 for ttft, e2e in runs)
    step = tpot - model.step_time([], [48])
    return max(request, 0.0) * 1000.0, max(step, 0.0) * 1000.0


def _real(
    trace: Path,
    policy: str,
    args: argparse.Namespace,
    engine: list[str],
    out: Path,
    probe: list[float],
) -> dict:
    port, admin = _free_port(), _free_port()
    log = (out / f"up_{policy}.log").open("wb")
    cmd = _kvherd(
        "up",
        "-n",
        str(args.instances),
        "--model",
        args.model,
        "--policy",
        policy,
        "--port",
        str(port),
        "--admin-port",
        str(admin),
        *(f"--agent-arg={a}" for a in engine),
    )
    proc = subprocess.Popen(
        cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "KVHERD_ADMIN_TOKEN": "bench"}
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        admin_url = f"http://127.0.0.1:{admin}/admin/v1/instances"
        while True:  # ready when every agent is registered and the proxy lists a model
            if proc.poll() is not None:
                raise RuntimeError(f"kvherd up exited; see {log.name}")
            try:
                listed = httpx.get(admin_url, headers={"Authorization": "Bearer bench"}, timeout=2)
                models = httpx.get(f"{url}/v1/models", timeout=2)
                if (
                    listed.status_code == 200
                    and len(listed.json()["data"]) == args.instances
                    and models.status_code == 200
                    and models.json()["data"]
                ):
                    break
            except (httpx.HTTPError, ValueError, KeyError):
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("kvherd up did not become ready")
            time.sleep(0.5)
        if not probe:
            probe.extend(_overheads(url, out / "profile.json"))
        dest = out / f"real_{policy}"
        subprocess.run(
            _kvherd(
                "replay",
                str(trace),
                "--url",
                url,
                "--out",
                str(dest),
                "--quiet",
                "--no-plots",
                "--id-block-size",
                str(512 // args.shrink),
                "--label",
                policy,
            ),
            check=True,
            stdout=subprocess.DEVNULL,
        )
        return json.loads((dest / "summary.json").read_text())["results"][policy]
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--policies", default="round_robin,kvherd")
    parser.add_argument("--instances", type=int, default=2)
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--requests", type=int, default=60)
    parser.add_argument(
        "--shrink", type=int, default=16, help="divide lengths by this (power of 2)"
    )
    parser.add_argument("--max-output", type=int, default=32)
    parser.add_argument("--rate-scale", type=float, default=1.0)
    parser.add_argument("--num-blocks", type=int, default=512)
    parser.add_argument("--max-num-seqs", type=int, default=16)
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if not MOONCAKE.is_file():
        print(f"{MOONCAKE} not found", file=sys.stderr)
        return 2
    out = args.out or Path(tempfile.mkdtemp(prefix="kvherd-fidelity-"))
    out.mkdir(parents=True, exist_ok=True)
    trace = _shrunk_trace(out, args.requests, args.shrink, args.max_output, args.rate_scale)
    engine = [
        f"--num-gpu-blocks={args.num_blocks}",
        f"--max-num-seqs={args.max_num_seqs}",
        f"--max-num-batched-tokens={args.max_num_batched_tokens}",
        "--torch-threads=1",
    ]
    profile = out / "profile.json"
    subprocess.run(
        _kvherd(
            "profile",
            "--model",
            args.model,
            "--out",
            str(profile),
            "--device",
            "cpu",
            "--num-blocks",
            str(args.num_blocks),
            "--max-num-seqs",
            str(args.max_num_seqs),
            "--max-num-batched-tokens",
            str(args.max_num_batched_tokens),
            "--max-batch",
            str(args.max_num_seqs),
            "--max-context",
            "1024",
        ),
        check=True,
    )
    policies = args.policies.split(",")
    probe: list[float] = []
    reals = {policy: _real(trace, policy, args, engine, out, probe) for policy in policies}
    request_ms, step_ms = probe
    subprocess.run(
        _kvherd(
            "sim",
            str(trace),
            "--instances",
            str(args.instances),
            "--policy",
            ",".join(policies),
            "--latency-model",
            f"calibrated:{profile}",
            "--id-block-size",
            str(512 // args.shrink),
            "--request-overhead-ms",
            f"{request_ms:.3f}",
            "--step-overhead-ms",
            f"{step_ms:.3f}",
            "--out",
            str(out / "sim"),
            "--quiet",
            "--no-plots",
        ),
        check=True,
        stdout=subprocess.DEVNULL,
    )
    simulated = json.loads((out / "sim" / "summary.json").read_text())["results"]
    print(
        f"{args.requests} Mooncake requests shrunk {args.shrink}x, {args.instances} x {args.model}; out {out}"
    )
    print(
        f"probed overheads: request path {request_ms:.2f} ms, serving loop {step_ms:.3f} ms per step"
    )
    print("| policy | metric | real | sim | error |")
    print("|---|---|---:|---:|---:|")
    for policy in policies:
        real, sim = reals[policy], simulated[policy]
        for key, label in (*METRICS, ("prefix_hit_rate", "hit rate")):
            r, s = real[key], sim[key]
            err = (s - r) / r if r else float("nan")
            print(f"| {policy} | {label} | {r:.3g} | {s:.3g} | {err:+.1%} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
