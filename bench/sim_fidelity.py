"""Simulator fidelity: the same scaled-down trace through a real local fleet and through `kvherd sim`.

Steps, all on this machine:
  1. `kvherd profile` fits the calibrated latency model of the built-in engine with the very
     engine configuration the agents run (block size, pool, batch limits, one torch thread), timing
     whole engine steps in the stepping thread's CPU time (robust to other load on the machine).
  2. Serving probes on a probe fleet (`kvherd up`, round_robin) with the replay client, never the
     trace: isolated one-token requests through the proxy give the request path (client -> proxy
     -> agent -> first token back, minus the model's step); bursts of k streaming requests sent
     to one agent itself (the others idle) give its serving loop's cost per step beyond the
     engine step, fitted as `step_s + per_sequence_s * k` and written into the profile's
     ``serving`` section. Each probe runs `--probe-rounds` times; the spread is printed.
  3. For each policy, `--repeats` fresh fleets (`kvherd up -n N --policy P`, agents checked
     against the profile's engine through /kvherd/v1/state), each replaying the trace with
     `kvherd replay` after a short warm-up.
  4. One `kvherd sim` of the same trace: that profile, N instances, the same engine limits, the
     probed request path, the proxy's load-report period.
The trace is the Mooncake trace scaled down to fit the model's context: the first `--requests`
requests that fit, every length divided by `--shrink` and the hash-id block shrunk alike
(512/shrink tokens), so the prefix-sharing structure is kept; outputs are capped at `--max-output`.
Printed per policy: TTFT p50/p90, TPOT p50 and hit rate, the real runs' median and their spread
(min..max over the repeats, as +-% of the median), the simulated value and its error against the
real median (target: within 10%). An error inside the real spread is indistinguishable from the
fleet's own run-to-run noise.

    python bench/sim_fidelity.py [--policies round_robin,kvherd] [--instances 2] [--requests 60]
        [--model tiny] [--shrink 16] [--repeats 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the repository's packages, wherever the bench is started from

MOONCAKE = ROOT.parent / "shared" / "traces" / "mooncake" / "synthetic_trace.jsonl"
METRICS = (
    ("ttft_ms_p50", "TTFT p50 ms"),
    ("ttft_ms_p90", "TTFT p90 ms"),
    ("tpot_ms_p50", "TPOT p50 ms"),
    ("prefix_hit_rate", "hit rate"),
)
# The proxy's default load-poll period (`kvherd serve --load-interval`): the sim's report period.
LOAD_INTERVAL_MS = 250.0
CONTEXT = {"tiny": 2048, "small": 4096}
PROBE_PROMPT = 16  # tokens of every probe prompt (one hash id each, never shared)
PROBE_DECODE = 32  # decode steps a step probe measures


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _kvherd(*args: str) -> list[str]:
    return [sys.executable, "-m", "kvherd", *args]


def _shrunk_trace(out: Path, args: argparse.Namespace) -> Path:
    context = CONTEXT.get(args.model, 2048)
    block = 512 // args.shrink
    lines: list[dict[str, object]] = []
    with MOONCAKE.open() as f:
        for raw in f:
            if len(lines) == args.requests:
                break
            row = json.loads(raw)
            length = max(1, row["input_length"] // args.shrink)
            output = min(row["output_length"], args.max_output)
            if length + output > context - 16:  # within the model's context
                continue
            lines.append(
                {
                    "timestamp": row["timestamp"] / args.rate_scale,
                    "input_length": length,
                    "output_length": output,
                    "hash_ids": row["hash_ids"][: -(-length // block)],
                }
            )
    path = out / "trace.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


@contextmanager
def _fleet(
    policy: str, args: argparse.Namespace, profile: dict[str, Any], log: Path
) -> Iterator[tuple[str, list[str]]]:
    """A running `kvherd up` fleet whose agents run the profile's engine; yields the proxy URL
    and the agents' URLs."""
    port, admin = _free_port(), _free_port()
    engine = profile["engine"]
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
        f"--load-interval={LOAD_INTERVAL_MS / 1000.0}",
        f"--agent-arg=--block-size={engine['block_size']}",
        f"--agent-arg=--num-gpu-blocks={engine['num_blocks']}",
        f"--agent-arg=--max-num-seqs={engine['max_num_seqs']}",
        f"--agent-arg=--max-num-batched-tokens={engine['max_num_batched_tokens']}",
        f"--agent-arg=--max-model-len={engine['max_model_len']}",
        f"--agent-arg=--torch-threads={profile['torch_threads']}",
        "--agent-arg=--device=cpu",
    )
    with log.open("wb") as log_file:
        proc = subprocess.Popen(
            cmd,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            cwd=ROOT,
            env={**os.environ, "KVHERD_ADMIN_TOKEN": "bench"},
        )
        url = f"http://127.0.0.1:{port}"
        try:
            agents = _wait_ready(proc, url, admin, args.instances, log)
            _check_engine(agents, engine)
            yield url, agents
        finally:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _wait_ready(
    proc: subprocess.Popen[bytes], url: str, admin: int, n: int, log: Path
) -> list[str]:
    """Poll until every agent is registered and the proxy lists a model; the agents' URLs."""
    deadline = time.monotonic() + 300
    admin_url = f"http://127.0.0.1:{admin}/admin/v1/instances"
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"kvherd up exited; see {log}")
        try:
            listed = httpx.get(admin_url, headers={"Authorization": "Bearer bench"}, timeout=2)
            models = httpx.get(f"{url}/v1/models", timeout=2)
            if listed.status_code == 200 and models.status_code == 200:
                agents = [inst["url"] for inst in listed.json()["data"]]
                if len(agents) == n and models.json()["data"]:
                    return agents
        except (httpx.HTTPError, ValueError, KeyError):
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"kvherd up did not become ready; see {log}")
        time.sleep(0.5)  # agents load their model on their own schedule; nothing to await


def _check_engine(agents: list[str], engine: dict[str, int]) -> None:
    """The simulated instances copy the profile's engine: refuse a fleet that runs another one."""
    for agent in agents:
        state = httpx.get(f"{agent}/kvherd/v1/state", timeout=10).json()
        seen = {"block_size": state["block_size"], "num_blocks": state["total_blocks"]}
        want = {key: engine[key] for key in seen}
        if seen != want:
            raise RuntimeError(f"agent {agent} runs {seen}, the profile measured {want}")


def _probe_trace(groups: list[tuple[float, int, int]], first_index: int) -> Any:
    """(arrival s, requests, output tokens) groups -> a trace of unshared 16-token prompts."""
    from simulator.traces import Trace, TraceRequest

    requests: list[TraceRequest] = []
    for arrival, count, output in groups:
        for _ in range(count):
            index = first_index + len(requests)
            requests.append(TraceRequest(index, arrival, PROBE_PROMPT, output, (index,)))
    return Trace("probe", requests, block_size=PROBE_PROMPT)


def _replay_rows(url: str, trace: Any) -> Any:
    """Per-request columns of a probe trace replayed through `url` by the replay client."""
    from simulator.replay import ReplayConfig, replay

    result = asyncio.run(replay(trace, ReplayConfig(url=url, timeout_s=120.0)))
    if result.errors:
        raise RuntimeError(f"probe requests failed: {dict(result.errors)}")
    return result.metrics.columns()


def _probe(
    url: str, agent: str, args: argparse.Namespace, model: Any, rounds: list[dict[str, Any]]
) -> None:
    """One round of serving probes; appends {"ttft_s": s, "step": {k: overhead s}}.

    The request path goes through the proxy; the step probes go to one agent directly, so the
    other agents stay idle: what is measured is one instance's own serving loop (the simulator's
    unit), not agents competing for the same CPU cores.
    """
    import numpy as np

    base = 1_000_000 * (len(rounds) + 1)
    # Isolated one-token requests, far enough apart that each finds the fleet idle.
    isolated = _probe_trace([(0.15 * i, 1, 1) for i in range(2 * args.instances + 4)], base)
    cols = _replay_rows(url, isolated)
    ttft = float(np.median(cols["first_token"] - cols["arrival"]))
    step: dict[int, float] = {}
    for j, k in enumerate(_probe_batches(args)):
        burst = _probe_trace([(0.0, k, PROBE_DECODE + 1)], base + 1000 * (j + 1))
        cols = _replay_rows(agent, burst)
        tpot = float(np.median((cols["last_token"] - cols["first_token"]) / PROBE_DECODE))
        # Contexts run from PROBE_PROMPT + 1 to PROBE_PROMPT + PROBE_DECODE: the model is linear
        # in their sum, so the mean context prices every step of the probe on average.
        context = PROBE_PROMPT + (PROBE_DECODE + 1) / 2
        step[k] = tpot - model.engine_step_time([], [context] * k)
    rounds.append({"ttft_s": ttft, "step": step})


def _probe_batches(args: argparse.Namespace) -> list[int]:
    return sorted({1, max(1, args.max_num_seqs // 4), max(1, args.max_num_seqs // 2)})


def _serving_fit(rounds: list[dict[str, Any]]) -> tuple[float, float]:
    """(step_s, per_sequence_s) >= 0 by least squares over every round's step probes."""
    import numpy as np

    ks = np.array([k for r in rounds for k in r["step"]], dtype=float)
    overhead = np.array([o for r in rounds for o in r["step"].values()])
    slope, intercept = np.polyfit(ks, overhead, 1)
    if slope < 0:  # no measurable per-sequence cost: a constant
        return max(float(overhead.mean()), 0.0), 0.0
    if intercept < 0:  # a cost proportional to the batch only
        return 0.0, float((ks @ overhead) / (ks @ ks))
    return float(intercept), float(slope)


def _spread(values: list[float]) -> str:
    median = statistics.median(values)
    if len(values) < 2 or not median:
        return "n/a"
    return f"{(min(values) - median) / median:+.0%}..{(max(values) - median) / median:+.0%}"


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--policies", default="round_robin,kvherd")
    parser.add_argument("--instances", type=int, default=2)
    parser.add_argument("--model", default="tiny", help="tiny or small")
    parser.add_argument("--requests", type=int, default=60)
    parser.add_argument(
        "--shrink", type=int, default=16, help="divide lengths by this (power of 2)"
    )
    parser.add_argument("--max-output", type=int, default=32)
    parser.add_argument("--rate-scale", type=float, default=1.0)
    parser.add_argument("--repeats", type=int, default=3, help="real runs per policy")
    parser.add_argument("--probe-rounds", type=int, default=3)
    parser.add_argument("--num-blocks", type=int, default=512)
    parser.add_argument("--max-num-seqs", type=int, default=16)
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    parser.add_argument("--profile-repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if not MOONCAKE.is_file():
        print(f"{MOONCAKE} not found", file=sys.stderr)
        return 2
    if args.repeats < 1 or args.probe_rounds < 1 or 512 % args.shrink:
        print("--repeats and --probe-rounds >= 1; --shrink must divide 512", file=sys.stderr)
        return 2
    from simulator.latency.calibrated import CalibratedModel

    out = args.out or Path(tempfile.mkdtemp(prefix="kvherd-fidelity-"))
    out.mkdir(parents=True, exist_ok=True)
    trace = _shrunk_trace(out, args)
    engine_profile = out / "profile_engine.json"
    max_context = min(2048, CONTEXT.get(args.model, 2048) - 16)
    subprocess.run(
        _kvherd(
            "profile",
            "--model",
            args.model,
            "--out",
            str(engine_profile),
            "--device",
            "cpu",
            "--torch-threads",
            "1",
            "--clock",
            "thread",
            "--num-blocks",
            str(args.num_blocks),
            "--max-num-seqs",
            str(args.max_num_seqs),
            "--max-num-batched-tokens",
            str(args.max_num_batched_tokens),
            "--max-model-len",
            str(CONTEXT.get(args.model, 2048)),
            "--max-batch",
            str(args.max_num_seqs),
            "--max-context",
            str(max_context),
            "--repeats",
            str(args.profile_repeats),
        ),
        check=True,
        cwd=ROOT,
    )
    profile = json.loads(engine_profile.read_text())
    model = CalibratedModel(profile, str(engine_profile))

    rounds: list[dict[str, Any]] = []
    with _fleet("round_robin", args, profile, out / "up_probe.log") as (url, agents):
        for r in range(args.probe_rounds):
            _probe(url, agents[r % len(agents)], args, model, rounds)
    step_s, per_sequence_s = _serving_fit(rounds)
    profile["serving"] = {"step_s": step_s, "per_sequence_s": per_sequence_s}
    fleet_profile = out / "profile_fleet.json"
    fleet_profile.write_text(json.dumps(profile, indent=1) + "\n")
    served = CalibratedModel(profile, str(fleet_profile))
    request_s = [r["ttft_s"] - served.step_time([(PROBE_PROMPT, 0)], []) for r in rounds]
    request_ms = max(statistics.median(request_s), 0.0) * 1000.0

    policies = args.policies.split(",")
    reals: dict[str, list[dict[str, Any]]] = {policy: [] for policy in policies}
    for repeat in range(args.repeats):
        for policy in policies:
            with _fleet(policy, args, profile, out / f"up_{policy}_{repeat}.log") as (url, _):
                # Warm-up: the first requests of a fresh fleet pay one-off costs.
                _replay_rows(url, _probe_trace([(0.0, args.instances, 2)], 9_000_000))
                dest = out / f"real_{policy}_{repeat}"
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
                    cwd=ROOT,
                )
            summary = json.loads((dest / "summary.json").read_text())["results"][policy]
            reals[policy].append(summary)
            print(
                f"real {policy} #{repeat + 1}: "
                + ", ".join(f"{label} {summary[key]:.3g}" for key, label in METRICS),
                flush=True,
            )
    subprocess.run(
        _kvherd(
            "sim",
            str(trace),
            "--instances",
            str(args.instances),
            "--policy",
            ",".join(policies),
            "--latency-model",
            f"calibrated:{fleet_profile}",
            "--id-block-size",
            str(512 // args.shrink),
            "--max-num-seqs",
            str(profile["engine"]["max_num_seqs"]),
            "--max-num-batched-tokens",
            str(profile["engine"]["max_num_batched_tokens"]),
            "--max-model-len",
            str(profile["engine"]["max_model_len"]),
            "--request-overhead-ms",
            f"{request_ms:.3f}",
            "--report-interval-ms",
            str(LOAD_INTERVAL_MS),
            "--out",
            str(out / "sim"),
            "--quiet",
            "--no-plots",
        ),
        check=True,
        stdout=subprocess.DEVNULL,
        cwd=ROOT,
    )
    simulated = json.loads((out / "sim" / "summary.json").read_text())["results"]

    print(
        f"\n{len(trace.read_text().splitlines())} Mooncake requests shrunk {args.shrink}x, "
        f"{args.instances} x {args.model}, {args.repeats} real runs per policy; out {out}"
    )
    fit = profile["fit"]
    print(
        f"engine profile: {fit['num_points']} batch shapes, R^2 {fit['r2']:.4f}, "
        f"mean |error| {fit['mean_abs_pct_error']:.1f}%"
    )
    for k in _probe_batches(args):
        per_round = [r["step"][k] * 1000.0 for r in rounds]
        print(
            f"probe: serving cost per step at {k} sequence(s) "
            + " / ".join(f"{v:.3f}" for v in per_round)
            + " ms"
        )
    print(
        f"serving fit: {step_s * 1000:.3f} ms per step + {per_sequence_s * 1000:.3f} ms per "
        f"sequence; request path {request_ms:.2f} ms (rounds: "
        + " / ".join(f"{v * 1000:.2f}" for v in request_s)
        + ")"
    )
    print("| policy | metric | real median | real spread | sim | sim error |")
    print("|---|---|---:|---:|---:|---:|")
    for policy in policies:
        sim = simulated[policy]
        for key, label in METRICS:
            values = [run[key] for run in reals[policy]]
            real = statistics.median(values)
            err = (sim[key] - real) / real if real else float("nan")
            print(
                f"| {policy} | {label} | {real:.3g} | {_spread(values)} | {sim[key]:.3g} "
                f"| {err:+.1%} |",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
