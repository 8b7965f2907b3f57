"""Simulator fidelity: the same scaled-down trace through a real local fleet and through `kvherd sim`.

Steps, all on this machine:
  1. `kvherd profile` fits the calibrated latency model of the built-in engine with the very
     engine configuration the agents run (block size, pool, batch limits, one torch thread), timing
     whole engine steps in the stepping thread's CPU time (robust to other load on the machine).
  2. Serving probes on a probe fleet (`kvherd up`, round_robin) with the replay client, never the
     trace: isolated one-token requests through the proxy (prompts of 16 tokens, one and two
     token budgets) and bursts of k streaming requests through the proxy of a second, one-agent
     fleet (the path every streamed token takes, no other agent competing for the cores). Their
     TTFTs and TPOTs fit, by least squares in relative error, the fleet model
       step = compute_scale * (profiled engine step) + step_s + per_sequence_s * sequences,
       TTFT = request_s + the steps of the prefill:
     the request path (client -> proxy -> agent and the first token back), how much slower the
     agents compute now than the profile's clock says (1.0 on a quiet machine; other load on
     the cores raises it), and the serving loop's cost per step outside the engine. The terms
     go into the profile's ``serving`` section and its ``host`` section's
     ``request_overhead_s`` (`simulator.host_model.HostModel`); each of the
     `--probe-rounds` rounds is also fitted alone, to show their spread. The rounds are spread
     over the repeats, run just before each repeat's real runs: a shared VM's speed drifts within
     minutes, and probes taken all before the first real run calibrate another machine than
     the last one sees.
  3. For each policy, `--repeats` fresh fleets (`kvherd up -n N --policy P`, agents checked
     against the profile's engine through /kvherd/v1/state), each replaying the trace with
     `kvherd replay` after a short warm-up.
  4. One `kvherd sim` of the same trace: that profile (`--latency-model calibrated:FILE
     --profile FILE`: its engine fit, serving and host sections), N instances, the same engine
     limits, the proxy's load-report period. The profile is written to the out directory as
     ``profile_fleet.json``, to simulate this fleet again with `kvherd sim --profile`.
  5. Co-location (probed in step 2): the agents, proxy and client share this machine's cores,
     so requests and engine steps are slower while another agent computes. Each probe round
     sends few-token requests and a burst of streams straight to one agent of the probe fleet,
     first with the one-agent fleet idle, then with it decoding streams through its proxy (as
     a real fleet's other agent does; polled until its prefills are done). The median TTFT
     difference goes to the host section as ``request_overhead_per_busy_s`` (the request path
     grows per other busy instance at arrival), the median TPOT stretch as
     ``step_slowdown_per_busy`` (every step grows per other busy instance at its start).
  6. Idle wake-up: series of few-token requests through the proxy at arrival gaps of 30 ms to 1 s,
     in each probe round and again after each real run (a shared VM's wake-up cost drifts within
     minutes). The TTFT by idle time before the request, median over every series, relative to
     the probe rounds' TTFT at the isolated probes' idle time, goes to the host section as
     ``request_overhead_idle``. The same requests' deviations from the median of their series
     (one gap, one fleet, a few seconds) give the request path's spread, as its percentiles for
     ``request_overhead_spread``: a real path varies from request to request, and a constant
     path would give every short request the median and pull the TTFT quantiles in.
The trace is the Mooncake trace scaled down to fit the model's context: the first `--requests`
requests that fit, every length divided by `--shrink` and the hash-id block shrunk alike
(512/shrink tokens), so the prefix-sharing structure is kept; outputs are capped at `--max-output`.
Printed first: the machine's loopback round trip after 0 and 0.5 s idle (how fast the host wakes
idle processes; a shared VM can take milliseconds). Printed per policy: TTFT p50/p90, TPOT p50,
hit rate and engine steps (how the fleet batched the work), the real runs' median and their
spread (min..max over the repeats, as +-% of the median), the simulated value and its error
against the real median (target: within 10%). An error inside the real spread is
indistinguishable from the fleet's own run-to-run noise. Then, per policy, the median over
requests of sim TTFT / real TTFT (paired per request) and how often the simulated router chose
the instance the real one did.

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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the repository's packages, wherever the bench is started from

MOONCAKE = ROOT / "traces" / "mooncake" / "synthetic_trace.jsonl"
METRICS = (
    ("ttft_ms_p50", "TTFT p50 ms"),
    ("ttft_ms_p90", "TTFT p90 ms"),
    ("tpot_ms_p50", "TPOT p50 ms"),
    ("prefix_hit_rate", "hit rate"),
    # How the fleet batched the work: timing-free, but a loaded machine batches more per step.
    ("engine_steps", "engine steps"),
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
    policy: str,
    args: argparse.Namespace,
    profile: dict[str, Any],
    log: Path,
    instances: int | None = None,
) -> Iterator[tuple[str, list[str]]]:
    """A running `kvherd up` fleet of `instances` (default `--instances`) agents running the
    profile's engine; yields the proxy URL and the agents' URLs."""
    count = args.instances if instances is None else instances
    port, admin = _free_port(), _free_port()
    engine = profile["engine"]
    cmd = _kvherd(
        "up",
        "-n",
        str(count),
        "--model",
        args.model,
        "--policy",
        policy,
        "--port",
        str(port),
        "--admin-port",
        str(admin),
        f"--load-interval={LOAD_INTERVAL_MS / 1000.0}",
        "--expose-instance",  # the replay records which agent served each request
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
            agents = _wait_ready(proc, url, admin, count, log)
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


def _engine_steps(agents: list[str]) -> int:
    """Engine steps the fleet has run so far (the agents' own step counters)."""
    states = [httpx.get(f"{agent}/kvherd/v1/state", timeout=10).json() for agent in agents]
    return sum(int(state["step_latency"]["total_steps"]) for state in states)


def _probe_trace(groups: list[tuple[float, int, int, int]], first_index: int) -> Any:
    """(arrival s, requests, prompt tokens, output tokens) groups -> a trace of unshared prompts."""
    from simulator.traces import Trace, TraceRequest

    requests: list[TraceRequest] = []
    for arrival, count, prompt, output in groups:
        for _ in range(count):
            index = first_index + len(requests)
            ids = tuple(range(index * 1000, index * 1000 + -(-prompt // PROBE_PROMPT)))
            requests.append(TraceRequest(index, arrival, prompt, output, ids))
    return Trace("probe", requests, block_size=PROBE_PROMPT)


def _replay_rows(url: str, trace: Any) -> Any:
    """Per-request columns of a probe trace replayed through `url` by the replay client."""
    from simulator.replay import ReplayConfig, replay

    result = asyncio.run(replay(trace, ReplayConfig(url=url, timeout_s=120.0)))
    if result.errors:
        raise RuntimeError(f"probe requests failed: {dict(result.errors)}")
    return result.metrics.columns()


def _burst_tpot(url: str, streams: int, first_index: int) -> float:
    """Median TPOT (s) of `streams` probe requests streaming PROBE_DECODE + 1 tokens at once."""
    import numpy as np

    burst = _probe_trace([(0.0, streams, PROBE_PROMPT, PROBE_DECODE + 1)], first_index)
    cols = _replay_rows(url, burst)
    return float(np.median((cols["last_token"] - cols["first_token"]) / PROBE_DECODE))


def _chunks(prompt: int, budget: int) -> list[tuple[int, int]]:
    """The prefill chunks (new tokens, computed before) of a lone prompt under a token budget."""
    return [(min(budget, prompt - start), start) for start in range(0, prompt, budget)]


# One probe measurement and what it contains, in the terms of the fleet model
#   value = request_s * request + compute_scale * engine + step_s * steps + per_sequence_s * seqs
# (engine: the profile's engine seconds; steps: engine steps; seqs: sequence-steps).
Observation = tuple[float, float, float, float, float]


# Arrival gaps of the wake probes (the trace's are ~0.3 s apart, the isolated probes ~0.15 s).
WAKE_GAPS_S = (0.03, 0.15, 0.3, 1.0)
WAKE_REQUESTS = 17  # per gap; the first finds the fleet after the previous gap's, not counted
# After each real run, a shorter wake probe on its fleet: the wake-up cost drifts within minutes
# on a shared VM, so the curve follows it through the real runs.
WAKE_TRACK_REQUESTS = 9
WakePoint = tuple[float, float]  # (idle s before a few-token request, its TTFT s)
# Quantiles of the request path's deviation: every percentile, so the rare very slow request
# (a wake-up far above the rest) keeps the weight it had among the probes.
SPREAD_QUANTILES = 101


def _idle_ttfts(cols: Any, length: int) -> tuple[float, Any]:
    """The median idle time before the `length`-token requests of a probe series (from the
    previous request's last token to its arrival; the first request is not counted) and their
    TTFTs."""
    import numpy as np

    order = np.argsort(cols["arrival"])
    arrival, last = cols["arrival"][order], cols["last_token"][order]
    ttft = (cols["first_token"] - cols["arrival"])[order]
    pick = (cols["prompt_tokens"][order] == length)[1:]
    idle = (arrival[1:] - last[:-1])[pick]
    return float(np.median(idle)), ttft[1:][pick]


def _idle_ttft(cols: Any, length: int) -> WakePoint:
    """Median (idle time before it, TTFT) of the `length`-token requests of a probe series."""
    idle, ttfts = _idle_ttfts(cols, length)
    return idle, float(statistics.median(ttfts))


def _wake_probe(
    url: str, first_index: int, deviations: list[float], requests: int = WAKE_REQUESTS
) -> list[WakePoint]:
    """Few-token requests through the proxy at each of `WAKE_GAPS_S`: how the request path's
    time grows with the idle time before it (the host waking parked processes). Appends each
    counted request's TTFT minus its series' median to `deviations`."""
    points = []
    for j, gap in enumerate(WAKE_GAPS_S):
        series = [(gap * i, 1, PROBE_PROMPT, 1) for i in range(requests)]
        cols = _replay_rows(url, _probe_trace(series, first_index + 100 * j))
        idle, ttfts = _idle_ttfts(cols, PROBE_PROMPT)
        median = float(statistics.median(ttfts))
        points.append((idle, median))
        deviations.extend(float(t) - median for t in ttfts)
    return points


def _probe(
    url: str, single: str, args: argparse.Namespace, model: Any, rounds: list[list[Observation]]
) -> WakePoint:
    """One round of serving probes, appended to `rounds` as observations.

    Isolated one-token requests through the proxy (16 tokens, one and two token budgets long)
    give TTFTs: the request path, the engine's compute on this machine now, and per-step costs.
    Bursts of k streaming requests through `single`, the proxy of a one-agent fleet, give TPOTs:
    one instance's own serving loop (the simulator's unit) plus the path every streamed token
    takes (agent, proxy, client), without other agents competing for the cores. Returns the
    few-token requests' median (idle time before them, TTFT): the request path's reference.
    """
    import numpy as np

    budget = args.max_num_batched_tokens
    lengths = [PROBE_PROMPT, budget, 2 * budget]
    # Far enough apart that each finds the fleet idle.
    gap = 0.1 + 3 * model.engine_step_time(_chunks(2 * budget, budget), [])
    base = 1_000_000 * (len(rounds) + 1)
    isolated = [(gap * i, 1, lengths[i % 3], 1) for i in range(4 * len(lengths))]
    cols = _replay_rows(url, _probe_trace(isolated, base))
    reference = _idle_ttft(cols, PROBE_PROMPT)
    ttft = cols["first_token"] - cols["arrival"]
    observations: list[Observation] = []
    for length in lengths:
        chunks = _chunks(length, budget)
        value = float(np.median(ttft[cols["prompt_tokens"] == length]))
        engine = sum(model.engine_step_time([chunk], []) for chunk in chunks)
        observations.append((value, 1.0, engine, len(chunks), len(chunks)))
    for j, k in enumerate(_probe_batches(args)):
        tpot = _burst_tpot(single, k, base + 1000 * (j + 1))
        # Contexts run from PROBE_PROMPT + 1 to PROBE_PROMPT + PROBE_DECODE: the model is linear
        # in their sum, so the mean context prices every step of the probe on average.
        context = PROBE_PROMPT + (PROBE_DECODE + 1) / 2
        engine = model.engine_step_time([], [context] * k)
        observations.append((tpot, 0.0, engine, 1.0, float(k)))
    rounds.append(observations)
    return reference


class Colocation(NamedTuple):
    """Probe medians (s) on one agent with a co-located agent idle and with it decoding."""

    idle_ttft: float
    busy_ttft: float
    idle_tpot: float
    busy_tpot: float


_IDLE = Colocation(0.0, 0.0, 1.0, 1.0)  # one instance: no neighbour, no co-location cost


@dataclass
class Probes:
    """What the probes measured, pooled over the whole bench (never the trace's requests)."""

    rounds: list[list[Observation]] = field(default_factory=list)  # fleet-model observations
    colocation: list[Colocation] = field(default_factory=list)
    wake: list[list[WakePoint]] = field(default_factory=list)  # reference, then one per gap
    tracked: list[list[WakePoint]] = field(default_factory=list)  # after each real run
    deviations: list[float] = field(default_factory=list)  # wake TTFTs minus their series' median


def _probe_rounds(
    count: int,
    args: argparse.Namespace,
    profile: dict[str, Any],
    model: Any,
    log: Path,
    probes: Probes,
) -> None:
    """`count` rounds of serving, wake-up and co-location probes on fresh probe fleets: a
    round-robin one of `--instances` agents and a one-agent one (see `_probe`)."""
    if not count:
        return
    with (
        _fleet("round_robin", args, profile, log) as (url, agents),
        _fleet("round_robin", args, profile, log.with_name(log.stem + "_one.log"), 1) as (
            one,
            one_agents,
        ),
    ):
        for _ in range(count):
            r = len(probes.rounds)
            reference = _probe(url, one, args, model, probes.rounds)
            probes.wake.append(
                [reference, *_wake_probe(url, 6_000_000 + 1000 * r, probes.deviations)]
            )
            if args.instances > 1:  # the one-agent fleet is the quiet agent's busy neighbour
                quiet = agents[r % len(agents)]
                probes.colocation.append(
                    _colocation(quiet, (one, one_agents[0]), args, model, 5_000_000 + 1000 * r)
                )


def _decoding(agent: str, streams: int) -> bool:
    """Whether `agent` runs `streams` requests, every prefill done (it is decoding them)."""
    state = httpx.get(f"{agent}/kvherd/v1/state", timeout=10).json()
    running = state["running"]
    return len(running) == streams and all(r["num_output_tokens"] > 0 for r in running)


def _colocation(
    quiet: str,
    busy: tuple[str, str],
    args: argparse.Namespace,
    model: Any,
    first_index: int,
) -> Colocation:
    """Few-token requests (TTFT) and a burst of streams (TPOT) sent straight to the agent
    `quiet`, first with the co-located agent of `busy` (its proxy, its agent) idle, then with it
    decoding streams through its proxy, as a real fleet's other agent does.

    What the busy neighbour adds to the TTFT is the request path's co-location cost
    (``request_overhead_per_busy_s``); how much it stretches the TPOT is the engine steps'
    (``step_slowdown_per_busy``). Both sides skip the quiet agent's proxy, so only the
    neighbour's load differs between them.
    """
    import threading

    import numpy as np

    proxy, neighbour = busy
    gap = 0.05 + 3 * model.engine_step_time([(PROBE_PROMPT, 0)], [])
    count = 8
    isolated = [(gap * i, 1, PROBE_PROMPT, 1) for i in range(count)]
    burst = max(1, args.max_num_seqs // 4)
    stretched = 3 * (PROBE_DECODE + 1) * model.engine_step_time([], [PROBE_PROMPT] * burst)

    def measure(index: int) -> tuple[float, float]:
        cols = _replay_rows(quiet, _probe_trace(isolated, index))
        ttft = float(np.median(cols["first_token"] - cols["arrival"]))
        return ttft, _burst_tpot(quiet, burst, index + 50)

    idle_ttft, idle_tpot = measure(first_index)
    # The neighbour runs as many streams as the burst (a moderately loaded instance), decoding
    # twice as long as the probes take at three times their modelled time.
    streams = burst
    step = max(model.engine_step_time([], [PROBE_PROMPT] * streams), 1e-4)
    decode = int(2 * (gap * count + stretched) / step)
    decode = min(decode, CONTEXT.get(args.model, 2048) - 2 * PROBE_PROMPT)
    neighbour_trace = _probe_trace([(0.0, streams, PROBE_PROMPT, decode)], first_index + 100)
    load = threading.Thread(target=_replay_rows, args=(proxy, neighbour_trace))
    load.start()
    deadline = time.monotonic() + 30
    while not _decoding(neighbour, streams):
        if not load.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the co-located agent never decoded the probe's streams")
        time.sleep(0.005)  # polls the agent's own state; nothing to await
    busy_ttft, busy_tpot = measure(first_index + 200)
    still_decoding = _decoding(neighbour, streams)
    load.join()
    if not still_decoding:
        raise RuntimeError("the co-located agent's streams ended before the probes did")
    return Colocation(idle_ttft, busy_ttft, idle_tpot, busy_tpot)


def _probe_batches(args: argparse.Namespace) -> list[int]:
    return sorted({1, max(1, args.max_num_seqs // 4), max(1, args.max_num_seqs // 2)})


FLEET_TERMS = ("request_s", "compute_scale", "step_s", "per_sequence_s")


def _fleet_fit(observations: list[Observation]) -> dict[str, float]:
    """The fleet model's terms by least squares in relative error, none negative."""
    import numpy as np

    y = np.array([o[0] for o in observations])
    x = np.array([o[1:] for o in observations])
    free = list(range(len(FLEET_TERMS)))
    while True:  # drop a term that fits negative (its cost is below what the probes resolve)
        coef = np.zeros(len(FLEET_TERMS))
        solved, *_ = np.linalg.lstsq(x[:, free] / y[:, None], np.ones(len(y)), rcond=None)
        coef[free] = solved
        negative = [i for i in free if coef[i] < 0]
        if not negative:
            return {name: float(c) for name, c in zip(FLEET_TERMS, coef, strict=True)}
        worst = min(negative, key=lambda i: coef[i])
        if FLEET_TERMS[worst] == "compute_scale":  # the engine's own time cannot be dropped
            raise RuntimeError(f"probes contradict the profile (fit {coef.tolist()})")
        free.remove(worst)


def _requests(path: Path) -> dict[int, dict[str, str]]:
    """Trace index -> row of a report's requests CSV."""
    import csv

    with path.open() as f:
        return {int(row["index"]): row for row in csv.DictReader(f)}


def _per_request_ttft(path: Path) -> dict[int, float]:
    """Trace index -> TTFT in ms, from a report's requests CSV."""
    return {index: float(row["ttft_ms"]) for index, row in _requests(path).items()}


def _routing_agreement(real: Path, sim: Path) -> float:
    """Share of requests the simulated router sent where the real one did, under the best
    one-to-one naming of simulated instances to agents (their names differ)."""
    import itertools

    real_rows, sim_rows = _requests(real), _requests(sim)
    pairs = [
        (sim_rows[i]["instance"], real_rows[i]["instance"]) for i in sim_rows if i in real_rows
    ]
    agents = sorted({agent for _, agent in pairs})
    simulated = sorted({instance for instance, _ in pairs})
    agents += [f"(none {i})" for i in range(len(simulated) - len(agents))]  # names to spare
    best = 0
    for names in itertools.permutations(agents, len(simulated)):
        naming = dict(zip(simulated, names, strict=True))
        best = max(best, sum(naming[instance] == agent for instance, agent in pairs))
    return best / len(pairs)


def _paired_ttft_ratio(reals: list[Path], sim: Path) -> float:
    """Median over requests of sim TTFT / real TTFT (the real one: median over the repeats).

    Paired per request, it is immune to where a percentile falls in the trace's two clusters of
    TTFTs (about half of the prompts are a few tokens long, the rest hundreds).
    """
    real_runs = [_per_request_ttft(path) for path in reals]
    simulated = _per_request_ttft(sim)
    ratios = [
        value / statistics.median(run[index] for run in real_runs)
        for index, value in simulated.items()
        if all(index in run for run in real_runs)
    ]
    return statistics.median(ratios)


def _wake_latency(gap_s: float, rounds: int = 20) -> float:
    """Median loopback round trip (s) of one byte between two threads after `gap_s` idle.

    Not part of the fit: it shows how this machine treats idle processes right now. On a
    shared virtual machine a vCPU that idles loses its core, and waking the agents, proxy and
    client again then costs milliseconds the simulator does not model (compare gap 0).
    """
    import threading

    server = socket.create_server(("127.0.0.1", 0))

    def echo() -> None:
        conn, _ = server.accept()
        with conn:
            while data := conn.recv(16):
                conn.sendall(data)

    thread = threading.Thread(target=echo, daemon=True)
    thread.start()
    times = []
    with socket.create_connection(server.getsockname()) as client:
        for _ in range(rounds):
            time.sleep(gap_s)  # the idle time is what is measured
            start = time.perf_counter()
            client.sendall(b"x")
            client.recv(16)
            times.append(time.perf_counter() - start)
    thread.join(5)
    server.close()
    return statistics.median(times)


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
    parser.add_argument(
        "--probe-rounds", type=int, default=6, help="serving probe rounds, spread over the repeats"
    )
    parser.add_argument("--num-blocks", type=int, default=512)
    parser.add_argument("--max-num-seqs", type=int, default=16)
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    parser.add_argument("--profile-repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if not MOONCAKE.is_file():
        print(f"{MOONCAKE} not found", file=sys.stderr)
        return 2
    if args.repeats < 1 or args.probe_rounds < 1 or 512 % args.shrink:
        print("--repeats and --probe-rounds >= 1; --shrink must divide 512", file=sys.stderr)
        return 2
    from kvherd.profile_format import HOST_SECTION
    from simulator.host_model import HostModel
    from simulator.latency.calibrated import CalibratedModel
    from simulator.report import safe_label

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

    probes = Probes()
    policies = args.policies.split(",")
    reals: dict[str, list[dict[str, Any]]] = {policy: [] for policy in policies}
    for repeat in range(args.repeats):
        share = len(range(repeat, args.probe_rounds, args.repeats))
        _probe_rounds(share, args, profile, model, out / f"up_probe_{repeat}.log", probes)
        for k, policy in enumerate(policies):
            log = out / f"up_{policy}_{repeat}.log"
            with _fleet(policy, args, profile, log) as (url, agents):
                # Warm-up: the first requests of a fresh agent pay one-off costs. Sent to the
                # agents themselves: through the proxy they would draw from the policy's seeded
                # tie-break coin, which then no longer flips as in the simulation.
                for i, agent in enumerate(agents):
                    _replay_rows(agent, _probe_trace([(0.0, 1, PROBE_PROMPT, 2)], 9_000_000 + i))
                steps_before = _engine_steps(agents)
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
                steps = _engine_steps(agents) - steps_before
                run_index = repeat * len(policies) + k
                probes.tracked.append(
                    _wake_probe(
                        url, 7_000_000 + 1000 * run_index, probes.deviations, WAKE_TRACK_REQUESTS
                    )
                )
            report = json.loads((dest / "summary.json").read_text())
            summary = report["results"][policy]
            summary["engine_steps"] = steps
            reals[policy].append(summary)
            print(
                f"real {policy} #{repeat + 1}: "
                + ", ".join(f"{label} {summary[key]:.4g}" for key, label in METRICS)
                # Other work on the machine inflates the real side only: say how busy it was.
                + f" (load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores, "
                f"client sent up to {report['meta']['send_lag_ms_max']:.1f} ms late)",
                flush=True,
            )
    rounds, colocation, wake, tracked = (
        probes.rounds,
        probes.colocation,
        probes.wake,
        probes.tracked,
    )
    fleet = _fleet_fit([o for observations in rounds for o in observations])
    per_round = [_fleet_fit(observations) for observations in rounds]
    profile["serving"] = {key: fleet[key] for key in FLEET_TERMS[1:]}
    request_ms = fleet["request_s"] * 1000.0
    # What one busy co-located agent adds to a request, and how much it stretches the steps
    # (none measured below 0).
    per_busy_ms = max(
        0.0, 1000.0 * statistics.median(c.busy_ttft - c.idle_ttft for c in colocation or [_IDLE])
    )
    slowdown = max(
        0.0, statistics.median(c.busy_tpot / c.idle_tpot - 1 for c in colocation or [_IDLE])
    )

    # The request path by idle time, relative to what it was after the isolated probes' idle
    # time when the fit's request_s (which holds that much) was probed: the probe rounds' wake
    # curve gives that baseline; the curve itself is the median over every wake probe, those
    # after the real runs included, so it follows the machine's drift through the real runs.
    import numpy as np

    def wake_curve(series: list[list[WakePoint]]) -> list[WakePoint]:
        return sorted(
            (statistics.median(w[j][0] for w in series), statistics.median(w[j][1] for w in series))
            for j in range(len(WAKE_GAPS_S))
        )

    probed = wake_curve([w[1:] for w in wake])
    curve = wake_curve([w[1:] for w in wake] + tracked)
    baseline = float(
        np.interp(
            statistics.median(w[0][0] for w in wake),
            [idle for idle, _ in probed],
            [ttft for _, ttft in probed],
        )
    )
    idle_points = [(idle, 1000.0 * (ttft - baseline)) for idle, ttft in curve]
    spread_ms = 1000.0 * np.quantile(probes.deviations, np.linspace(0.0, 1.0, SPREAD_QUANTILES))

    def seconds(ms: float) -> float:  # to the microsecond: the probes resolve no finer
        return round(float(ms), 3) / 1000.0

    host = HostModel(
        request_overhead_s=seconds(request_ms),
        request_overhead_per_busy_s=seconds(per_busy_ms),
        request_overhead_idle=tuple(
            (round(idle, 4), seconds(extra))
            for i, (idle, extra) in enumerate(idle_points)
            if i == 0 or idle > idle_points[i - 1][0]
        ),
        request_overhead_spread=tuple(seconds(q) for q in spread_ms),
        step_slowdown_per_busy=round(slowdown, 4),
    )
    profile[HOST_SECTION] = host.profile_section()
    fleet_profile = out / "profile_fleet.json"
    fleet_profile.write_text(json.dumps(profile, indent=1) + "\n")
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
            "--profile",
            str(fleet_profile),
            "--id-block-size",
            str(512 // args.shrink),
            "--max-num-seqs",
            str(profile["engine"]["max_num_seqs"]),
            "--max-num-batched-tokens",
            str(profile["engine"]["max_num_batched_tokens"]),
            "--max-model-len",
            str(profile["engine"]["max_model_len"]),
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
    timing = json.loads((out / "sim" / "timing.json").read_text())
    for policy in policies:
        simulated[policy]["engine_steps"] = timing[policy]["engine_steps"]

    print(
        f"\n{len(trace.read_text().splitlines())} Mooncake requests shrunk {args.shrink}x, "
        f"{args.instances} x {args.model}, {args.repeats} real runs per policy; out {out}"
    )
    print(
        "machine: loopback round trip "
        + ", ".join(f"{_wake_latency(gap) * 1e6:.0f} us after {gap:g} s idle" for gap in (0, 0.5))
    )
    fit = profile["fit"]
    print(
        f"engine profile: {fit['num_points']} batch shapes, R^2 {fit['r2']:.4f}, "
        f"mean |error| {fit['mean_abs_pct_error']:.1f}%"
    )
    for key in FLEET_TERMS:
        scale = 1.0 if key == "compute_scale" else 1000.0
        unit = "" if key == "compute_scale" else " ms"
        print(
            f"probed fleet: {key} {fleet[key] * scale:.3f}{unit} (rounds alone: "
            + " / ".join(f"{r[key] * scale:.3f}" for r in per_round)
            + ")"
        )
    print(
        "probed idle wake-up: few-token TTFT after idle "
        + ", ".join(f"{idle * 1000:.0f} ms {extra:+.2f} ms" for idle, extra in idle_points)
        + f" (against the isolated probes' {1000 * statistics.median(w[0][0] for w in wake):.0f}"
        " ms); few-token TTFT by idle gap, probe rounds -> after the real runs: "
        + ", ".join(
            f"{1000 * statistics.median(w[j + 1][1] for w in wake):.1f} -> "
            f"{1000 * statistics.median(t[j][1] for t in tracked):.1f} ms"
            for j in range(len(WAKE_GAPS_S))
        )
    )
    print(
        f"probed request-path spread: {len(probes.deviations)} wake probe TTFTs against the "
        "median of their series, p5 / p25 / p75 / p95 "
        + " / ".join(
            f"{1000.0 * q:+.2f}" for q in np.quantile(probes.deviations, [0.05, 0.25, 0.75, 0.95])
        )
        + " ms"
    )
    if colocation:

        def ms(values: Iterator[float]) -> float:
            return 1000 * statistics.median(values)

        print(
            "probed co-location: few-token TTFT "
            f"{ms(c.idle_ttft for c in colocation):.2f} ms with the neighbour idle, "
            f"{ms(c.busy_ttft for c in colocation):.2f} ms with it decoding: +{per_busy_ms:.3f} "
            "ms per busy agent (rounds: "
            + " / ".join(f"{1000 * (c.busy_ttft - c.idle_ttft):+.2f}" for c in colocation)
            + f"); TPOT {ms(c.idle_tpot for c in colocation):.3f} -> "
            f"{ms(c.busy_tpot for c in colocation):.3f} ms: steps {slowdown:+.1%} per busy "
            "agent (rounds: "
            + " / ".join(f"{c.busy_tpot / c.idle_tpot - 1:+.1%}" for c in colocation)
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
                f"| {policy} | {label} | {real:.4g} | {_spread(values)} | {sim[key]:.4g} "
                f"| {err:+.1%} |",
                flush=True,
            )
        csv_name = f"requests_{safe_label(policy)}.csv"
        ratio = _paired_ttft_ratio(
            [out / f"real_{policy}_{r}" / csv_name for r in range(args.repeats)],
            out / "sim" / csv_name,
        )
        print(
            f"| {policy} | TTFT per request, median sim/real | | | {ratio:.3f} | {ratio - 1:+.1%} |"
        )
        agreement = [
            _routing_agreement(out / f"real_{policy}_{r}" / csv_name, out / "sim" / csv_name)
            for r in range(args.repeats)
        ]
        print(
            f"| {policy} | same instance as real (per run) | | | "
            + " / ".join(f"{a:.0%}" for a in agreement)
            + " | |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
