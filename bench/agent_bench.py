"""Benchmark of the instance agent's HTTP layer against the same engine called in-process, one run.

Both sides run the same model (preset ``tiny`` by default, CPU), the same engine configuration and
the same workload: `--requests` completions with `--prompt-len`-token prompts (distinct, so no prefix
cache hits) and `--max-tokens` output tokens each (EOS ignored, seeded sampling).

(a) Sequential: one request at a time. The in-process baseline is ``add_request`` + ``step`` until
    finished; kvherd is a streamed ``POST /v1/completions`` through a real `kvherd agent` process on
    loopback (httpx client, keep-alive). The difference of the medians is the per-request overhead
    of the HTTP layer (parsing, validation, engine-thread hand-off, SSE framing, client parsing).
(b) Concurrent: `--concurrency` requests kept in flight against an engine batching at most
    `--max-num-seqs` (default 64 in flight, 32 in the batch, so the waiting queue keeps the batch
    full while clients turn around). Baseline: the engine stepping with that many requests added;
    kvherd: that many concurrent streams. Reported as requests/s and output tokens/s, and the
    kvherd/in-process ratio.

The two sides are interleaved (request by request in (a), round by round in (b), medians over
`--rounds`), so load from anything else on the machine hits both alike; the idle side sleeps (the
agent's engine thread waits on a condition). (b) also reports CPU time per request of the serving
side (the agent process, from /proc) and of the HTTP client, which load on the box does not skew.
Both use `--threads` torch threads. The client runs on
the same machine as the agent, so the figures are an upper bound on what a remote client would see.

Usage: ``python bench/agent_bench.py [--quick]``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from instance_agent.engine.core.request import SamplingParams
from instance_agent.engine.llm_engine import EngineConfig, LLMEngine


def _prompts(n: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(256) for _ in range(length)] for _ in range(n)]


# -- in-process baseline -----------------------------------------------------------------------
def engine_sequential(engine: LLMEngine, prompts: list[list[int]], max_tokens: int) -> list[float]:
    latencies = []
    for i, prompt in enumerate(prompts):
        params = SamplingParams(max_tokens=max_tokens, seed=i, ignore_eos=True)
        started = time.perf_counter()
        engine.add_request(f"seq-{i}-{started}", prompt, params)
        done = False
        while not done:
            done = any(out.finished for out in engine.step())
        latencies.append(time.perf_counter() - started)
    return latencies


def engine_concurrent(
    engine: LLMEngine, prompts: list[list[int]], max_tokens: int, concurrency: int
) -> float:
    """Wall seconds to finish all prompts with `concurrency` admitted at a time."""
    pending = list(enumerate(prompts))
    in_flight = 0
    started = time.perf_counter()
    tag = f"{started}"
    while pending or in_flight:
        while pending and in_flight < concurrency:
            i, prompt = pending.pop(0)
            params = SamplingParams(max_tokens=max_tokens, seed=i, ignore_eos=True)
            engine.add_request(f"conc-{i}-{tag}", prompt, params)
            in_flight += 1
        in_flight -= sum(out.finished for out in engine.step())
    return time.perf_counter() - started


# -- kvherd agent over HTTP --------------------------------------------------------------------
def _process_cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process (from /proc), robust to other load on the machine."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def start_agent(args: argparse.Namespace, log_path: str) -> tuple[subprocess.Popen[bytes], str]:
    port = _free_port()
    cmd = [
        sys.executable, "-m", "kvherd", "agent", "--host", "127.0.0.1", "--port", str(port),
        "--model", args.model, "--num-gpu-blocks", str(args.num_blocks),
        "--max-num-seqs", str(args.max_num_seqs), "--log-level", "warning",
        "--torch-threads", str(args.threads),
    ]  # fmt: skip
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"agent exited: {Path(log_path).read_text()}")
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    proc.kill()
    raise TimeoutError("agent did not become healthy")


async def _stream(client: httpx.AsyncClient, url: str, prompt: list[int], seed: int, n: int) -> int:
    body = {"prompt": prompt, "max_tokens": n, "seed": seed, "ignore_eos": True, "stream": True}
    tokens = 0
    async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                tokens += 1 if chunk["choices"] and chunk["choices"][0]["text"] != "" else 0
    return tokens


async def http_sequential(url: str, prompts: list[list[int]], max_tokens: int) -> list[float]:
    latencies = []
    async with httpx.AsyncClient(timeout=300) as client:
        for i, prompt in enumerate(prompts):
            started = time.perf_counter()
            await _stream(client, url, prompt, i, max_tokens)
            latencies.append(time.perf_counter() - started)
    return latencies


async def http_concurrent(
    url: str, prompts: list[list[int]], max_tokens: int, concurrency: int
) -> float:
    limit = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=300, limits=limits) as client:

        async def one(i: int, prompt: list[int]) -> None:
            async with limit:
                await _stream(client, url, prompt, i, max_tokens)

        started = time.perf_counter()
        await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
        return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--requests", type=int, default=128, help="per concurrent round")
    parser.add_argument("--sequential-requests", type=int, default=20, help="per round")
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--max-num-seqs", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--num-blocks", type=int, default=2048)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads, both sides")
    parser.add_argument("--quick", action="store_true", help="a small smoke run")
    args = parser.parse_args()
    if args.quick:
        args.requests, args.sequential_requests, args.concurrency, args.rounds = 16, 4, 8, 1
        args.max_num_seqs = 4
    import torch

    torch.set_num_threads(args.threads)
    engine = LLMEngine(
        EngineConfig(
            model=args.model,
            num_gpu_blocks=args.num_blocks,
            max_num_seqs=args.max_num_seqs,
            device="cpu",
        )
    )
    log_path = tempfile.mktemp(prefix="kvherd-agent-bench-", suffix=".log")
    proc, url = start_agent(args, log_path)
    base_seq: list[float] = []
    http_seq: list[float] = []
    base_conc: list[float] = []
    http_conc: list[float] = []
    cpu = {"in-process": 0.0, "agent": 0.0, "client": 0.0}
    m = args.max_tokens
    try:
        warm = _prompts(4, args.prompt_len, seed=3)
        engine_sequential(engine, warm, m)
        asyncio.run(http_sequential(url, warm, m))
        for r in range(args.rounds):
            seq_prompts = _prompts(args.sequential_requests, args.prompt_len, seed=10 + r)
            for prompt in seq_prompts:  # pairwise, so both sides see the same machine load
                base_seq += engine_sequential(engine, [prompt], m)
                http_seq += asyncio.run(http_sequential(url, [prompt], m))
            conc_prompts = _prompts(args.requests, args.prompt_len, seed=100 + r)
            started = time.process_time()
            base_conc.append(engine_concurrent(engine, conc_prompts, m, args.concurrency))
            cpu["in-process"] += time.process_time() - started
            started, agent_started = time.process_time(), _process_cpu_seconds(proc.pid)
            http_conc.append(asyncio.run(http_concurrent(url, conc_prompts, m, args.concurrency)))
            cpu["agent"] += _process_cpu_seconds(proc.pid) - agent_started
            cpu["client"] += time.process_time() - started
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
        os.unlink(log_path)

    n, c = args.requests, args.concurrency
    med_base, med_http = statistics.median(base_seq), statistics.median(http_seq)
    conc_base, conc_http = statistics.median(base_conc), statistics.median(http_conc)
    print(
        f"model={args.model} prompt_len={args.prompt_len} max_tokens={m} rounds={args.rounds} "
        f"sequential={args.sequential_requests}/round concurrent={n}/round concurrency={c} "
        f"max_num_seqs={args.max_num_seqs} "
        f"threads={args.threads} cpus={os.cpu_count()}"
    )
    print(f"{'':36}{'in-process':>12}{'kvherd agent':>14}{'ratio':>8}")
    print(
        f"{'(a) sequential median latency ms':36}{med_base * 1e3:12.1f}{med_http * 1e3:14.1f}"
        f"{med_http / med_base:8.2f}"
    )
    print(f"{'    HTTP overhead per request ms':36}{'':12}{(med_http - med_base) * 1e3:14.1f}")
    print(f"{'    HTTP overhead per token ms':36}{'':12}{(med_http - med_base) / m * 1e3:14.2f}")
    print(
        f"{'(b) concurrent requests/s':36}{n / conc_base:12.1f}{n / conc_http:14.1f}"
        f"{conc_base / conc_http:8.2f}"
    )
    print(
        f"{'    output tokens/s':36}{n * m / conc_base:12.0f}{n * m / conc_http:14.0f}"
        f"{conc_base / conc_http:8.2f}"
    )
    per_request = args.rounds * n / 1e3  # CPU ms per request
    print(
        f"{'    CPU ms per request (server)':36}{cpu['in-process'] / per_request:12.2f}"
        f"{cpu['agent'] / per_request:14.2f}{cpu['agent'] / cpu['in-process']:8.2f}"
    )
    print(f"{'    CPU ms per request (client)':36}{'':12}{cpu['client'] / per_request:14.2f}")


if __name__ == "__main__":
    main()
