"""P/D disaggregation on this machine's CPU fleet: colocated (2 mixed) vs 1 prefill : 1 decode, one run.

Setup: two real ``kvherd agent`` processes (preset ``small``: 8 layers, hidden 512, fp32, CPU,
block size 16, one torch thread each, KV events on, prefill in chunks of `--chunk` tokens;
``--role prefill`` and ``--role decode``) behind a ``kvherd serve`` process
(``--migration-policy none``: only P/D handoffs move requests; first-byte and inter-chunk
deadlines and the expected-wait admission limit raised, since a loaded CPU fleet is slow, not
failing). The same two agents serve both configurations; only the proxy's
``--instance URL,role=...`` differs (``mixed,mixed`` for colocated, overriding the agents' roles,
``prefill,decode`` for P/D), and every run sends prompts no instance has seen.

(a) Decode inter-token latency under a prefill-heavy mix: `--decoders` closed-loop streams of short
    prompts (64 tokens) with long outputs (128 tokens), the decode work, while `--prefillers`
    closed-loop streams send long prompts (`--long-prompt` tokens, 8 output tokens), the prefill
    work. Client-side gaps between the decode streams' token chunks (p50, p99), their TTFT, and
    the long requests' TTFT; colocated and P/D alternate `--rounds` times for `--seconds` each
    (pooled), so both see the same background load. Target: P/D decode ITL p99 <= 0.5x colocated.
(b) The handoff's cost to the second token vs context length: one streamed request at a time
    (`--contexts` prompt tokens, 64 output tokens) through the P/D proxy, all on the client's
    clock: TTFT, the gap to the second token, the median gap, the handoff's cost as the client
    sees it (second-token gap minus median gap) and the largest gap; beside them, from the
    proxy's ``kvherd_pd_handoff_*`` metrics, the handoff (from the first token's frame written
    on the prefill agent to the commit on the decode agent: the part of the second-token gap the
    handoff causes, the rest being the proxy's reattachment and a decode step) and its downtime
    (from the first token sampled: it also covers the first token's own delivery, which the
    client sees in its TTFT, not in the gap), and bytes; then, from one request sent to the
    prefill agent with the handoff header (its report), the stages and the KV the stop-and-copy
    stage sent (a chunked prefill's earlier blocks move while later chunks compute); and the
    largest gap of the same request colocated. Target: flat in context length (like migration
    downtime).
(c) Bytes saved by dedup: `--shared` requests with one shared `--prefix`-token prefix and a
    384-token suffix of their own, one after the other through the P/D proxy: KV bytes sent by the
    handoffs vs what a handoff without the decode instance's cache would send, and blocks
    deduplicated.

Usage: ``python bench/pd_fleet.py [--seconds 20] [--rounds 2] [--chunk 512] [--sections abc]
[--json out.json]``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
# The agent subprocess helper the integration tests use (a test support module, not a product one).
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "support"))

from agent_process import AgentProcess, agent_process, free_port

ADMIN_TOKEN = "pd-bench"
DECODE_PROMPT, DECODE_TOKENS, LONG_TOKENS = 64, 128, 8
_seeds = iter(range(1, 1 << 30))


def prompt(length: int) -> list[int]:
    """Token ids nobody sent before in this run."""
    rng = random.Random(next(_seeds))
    return [rng.randrange(3, 250) for _ in range(length)]


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


@contextlib.contextmanager
def agents(args: argparse.Namespace) -> Iterator[list[AgentProcess]]:
    flags = ["--model", args.model, "--torch-threads", "1", "--max-num-seqs", "32",
             "--max-num-batched-tokens", str(args.chunk), "--log-level", "warning"]  # fmt: skip
    # The roles P/D runs with (a prefill agent holds a handed-off request at its first token, so
    # its second token waits for the handoff); colocated, the proxy overrides them to mixed, and
    # without a handoff header neither agent acts on its role.
    with (
        agent_process(*flags, "--role", "prefill", kv_events=True) as a,
        agent_process(*flags, "--role", "decode", kv_events=True) as b,
    ):
        yield [a, b]


def instance_arg(agent: AgentProcess, role: str) -> str:
    return f"{agent.url},kv_events={agent.kv_events_endpoint},replay={agent.replay_endpoint},role={role}"


@contextlib.asynccontextmanager
async def proxy(fleet: list[AgentProcess], roles: tuple[str, str]) -> AsyncIterator[str]:
    """A ``kvherd serve`` process in front of `fleet` with `roles`; yields its base URL."""
    port, admin_port = free_port(), free_port()
    cmd = [sys.executable, "-m", "kvherd", "serve", "--port", str(port),
           "--admin-port", str(admin_port), "--admin-token", ADMIN_TOKEN,
           "--migration-policy", "none", "--load-interval", "0.1", "--log-level", "warning",
           # A CPU fleet under load is slow, not failing: no deadline retries, no refusals.
           "--first-byte-deadline", "300", "600", "--inter-chunk-deadline", "60", "120",
           "--max-queue-wait", "600"]  # fmt: skip
    for agent, role in zip(fleet, roles, strict=True):
        cmd += ["--instance", instance_arg(agent, role)]
    fd, log_path = tempfile.mkstemp(prefix="kvherd-pd-serve-", suffix=".log")
    with os.fdopen(fd, "wb") as log_file:  # the child keeps its own copy of the descriptor
        proc = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        async with httpx.AsyncClient(timeout=2) as client:
            for _ in range(600):
                if proc.poll() is not None:
                    raise RuntimeError(f"kvherd serve exited: {Path(log_path).read_text()}")
                with contextlib.suppress(httpx.HTTPError):
                    if (await client.get(f"{url}/health")).status_code == 200:
                        break
                await asyncio.sleep(0.05)
            else:
                raise TimeoutError("kvherd serve did not become healthy")
        yield url
    except BaseException:
        print(Path(log_path).read_text()[-3000:], file=sys.stderr)
        raise
    finally:
        proc.terminate()
        proc.wait(30)
        os.unlink(log_path)


async def stream(
    client: httpx.AsyncClient, url: str, tokens: list[int], max_tokens: int
) -> list[float]:
    """Arrival times of the stream's token chunks (the first is the TTFT), from its start."""
    body = {
        "prompt": tokens,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": 0.0,
        "return_token_ids": True,
        "stream": True,
    }
    started = time.perf_counter()
    times: list[float] = []
    async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                if any(choice.get("token_ids") for choice in chunk["choices"]):
                    times.append(time.perf_counter() - started)
    return times


def gaps(times: list[float]) -> list[float]:
    return [b - a for a, b in itertools.pairwise(times)]


async def mix(url: str, args: argparse.Namespace) -> dict[str, list[float]]:
    """(a): decode streams and long-prompt streams for `args.seconds`, closed loop."""
    out: dict[str, list[float]] = {"itl": [], "decode_ttft": [], "long_ttft": []}
    deadline = time.perf_counter() + args.seconds
    limits = httpx.Limits(max_connections=64, max_keepalive_connections=64)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:

        async def decoder() -> None:
            while time.perf_counter() < deadline:
                times = await stream(client, url, prompt(DECODE_PROMPT), DECODE_TOKENS)
                out["decode_ttft"].append(times[0])
                out["itl"].extend(gaps(times))

        async def prefiller() -> None:
            while time.perf_counter() < deadline:
                times = await stream(client, url, prompt(args.long_prompt), LONG_TOKENS)
                out["long_ttft"].append(times[0])

        await asyncio.gather(
            *(decoder() for _ in range(args.decoders)),
            *(prefiller() for _ in range(args.prefillers)),
        )
    return out


async def metrics(url: str) -> dict[str, float]:
    async with httpx.AsyncClient(timeout=10) as client:
        text = (await client.get(f"{url}/metrics")).text
    found: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("kvherd_pd_") and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            found[name] = float(value)
    return found


def delta(after: dict[str, float], before: dict[str, float], name: str) -> float:
    return after.get(name, 0.0) - before.get(name, 0.0)


async def second_token(url: str, context: int, pd: bool) -> dict[str, float]:
    """(b): one request alone; its token timing and (P/D) its handoff's figures."""
    before = await metrics(url) if pd else {}
    async with httpx.AsyncClient(timeout=600) as client:
        times = await stream(client, url, prompt(context), 64)
    after = await metrics(url) if pd else {}
    between = gaps(times)
    row = {
        "ttft_s": times[0],
        "second_token_s": between[0],
        "max_gap_s": max(between),
        "median_gap_s": statistics.median(between),
        # The handoff's cost as the client sees it: its second token's wait beyond a decode step.
        "second_token_cost_s": between[0] - statistics.median(between),
    }
    if pd:
        row["handoffs_ok"] = delta(after, before, 'kvherd_pd_handoffs_total{outcome="ok"}')
        row["downtime_s"] = delta(after, before, "kvherd_pd_handoff_downtime_seconds_sum")
        row["handoff_s"] = delta(after, before, "kvherd_pd_handoff_seconds_sum")
        row["bytes_sent"] = delta(after, before, "kvherd_pd_handoff_bytes_sum")
    return row


async def handoff_report(prefill: AgentProcess, decode: AgentProcess, context: int) -> Any:
    """(b): the prefill agent's own report of one handoff (stages, the stop-and-copy's blocks)."""
    body = {"prompt": prompt(context), "max_tokens": 8, "ignore_eos": True, "temperature": 0.0}
    async with httpx.AsyncClient(timeout=600) as client:
        response = await client.post(
            f"{prefill.url}/v1/completions", json=body, headers={"x-kvherd-handoff": decode.url}
        )
    response.raise_for_status()
    return json.loads(response.headers["x-kvherd-handoff"])


async def dedup(url: str, args: argparse.Namespace) -> dict[str, float]:
    """(c): requests sharing one prefix, one after the other."""
    shared = prompt(args.prefix)
    before = await metrics(url)
    async with httpx.AsyncClient(timeout=600) as client:
        for _ in range(args.shared):
            await stream(client, url, shared + prompt(384), 32)
    after = await metrics(url)
    return {
        "requests": args.shared,
        "handoffs_ok": delta(after, before, 'kvherd_pd_handoffs_total{outcome="ok"}'),
        "bytes_sent": delta(after, before, "kvherd_pd_handoff_bytes_sum"),
        "bytes_skipped": delta(after, before, "kvherd_pd_handoff_skipped_bytes_total"),
        "blocks_sent": delta(after, before, 'kvherd_pd_handoff_blocks_total{kind="sent"}'),
        "blocks_deduplicated": delta(
            after, before, 'kvherd_pd_handoff_blocks_total{kind="deduplicated"}'
        ),
    }


COLOCATED, PD = ("mixed", "mixed"), ("prefill", "decode")


async def run(args: argparse.Namespace) -> dict[str, Any]:
    contexts = [int(c) for c in args.contexts.split(",")]
    result: dict[str, Any] = {"model": args.model, "args": vars(args)}
    with agents(args) as fleet:
        # Warm both engines (first forward passes allocate) and the pair's KV transport outside
        # any measurement.
        async with proxy(fleet, COLOCATED) as url, httpx.AsyncClient(timeout=600) as client:
            await asyncio.gather(*(stream(client, url, prompt(512), 8) for _ in range(4)))
        async with proxy(fleet, PD) as url, httpx.AsyncClient(timeout=600) as client:
            await stream(client, url, prompt(512), 8)
        if "a" in args.sections:
            result["mix"] = await mixes(fleet, args)
        if "b" in args.sections:
            result["second_token"] = await second_tokens(fleet, contexts, args)
        if "c" in args.sections:
            async with proxy(fleet, PD) as url:
                result["dedup"] = await dedup(url, args)
    return result


async def mixes(fleet: list[AgentProcess], args: argparse.Namespace) -> dict[str, Any]:
    """(a), colocated and P/D alternating `args.rounds` times."""
    pooled: dict[str, dict[str, list[float]]] = {"colocated": {}, "pd": {}}
    for _ in range(args.rounds):
        for name, roles in (("colocated", COLOCATED), ("pd", PD)):
            async with proxy(fleet, roles) as url:
                got = await mix(url, args)
                if name == "pd":
                    got["handoffs"] = [
                        v for k, v in (await metrics(url)).items() if "handoffs_total" in k
                    ]
            for key, values in got.items():
                pooled[name].setdefault(key, []).extend(values)
    return {
        name: {
            "itl_p50_s": quantile(data["itl"], 0.5),
            "itl_p99_s": quantile(data["itl"], 0.99),
            "decode_ttft_p50_s": quantile(data["decode_ttft"], 0.5),
            "long_ttft_p50_s": quantile(data["long_ttft"], 0.5),
            "long_ttft_p99_s": quantile(data["long_ttft"], 0.99),
            "decode_requests": len(data["decode_ttft"]),
            "long_requests": len(data["long_ttft"]),
        }
        for name, data in pooled.items()
    }


async def second_tokens(
    fleet: list[AgentProcess], contexts: list[int], args: argparse.Namespace
) -> list[dict[str, Any]]:
    """(b): per context, `args.repeats` requests colocated and through P/D (medians; every
    column's median over the same requests), and one handoff report from the prefill agent."""
    rows = []
    for context in contexts:
        async with proxy(fleet, COLOCATED) as url:
            colocated = [await second_token(url, context, False) for _ in range(args.repeats)]
        async with proxy(fleet, PD) as url:
            pd = [await second_token(url, context, True) for _ in range(args.repeats)]
        report = await handoff_report(fleet[0], fleet[1], context)
        rows.append(
            {
                "context": context,
                "pd": {k: statistics.median(r[k] for r in pd) for k in pd[0]},
                "colocated": {k: statistics.median(r[k] for r in colocated) for k in colocated[0]},
                "report": report,
            }
        )
    return rows


def report(result: dict[str, Any]) -> None:
    args = result["args"]
    print(
        f"\nP/D on the CPU fleet ({result['model']}, 2 agents, prefill chunks of {args['chunk']})"
    )
    if "mix" in result:
        report_mix(result["mix"], args)
    if "second_token" in result:
        report_second_token(result["second_token"])
    if "dedup" in result:
        d = result["dedup"]
        total = d["bytes_sent"] + d["bytes_skipped"]
        print(
            f"\nDedup: {d['requests']:.0f} requests sharing a {args['prefix']}-token prefix "
            f"(+384 tokens each), {d['handoffs_ok']:.0f} handed off: sent "
            f"{d['bytes_sent'] / 2**20:.1f} MiB of {total / 2**20:.1f} MiB "
            f"({d['bytes_skipped'] / max(total, 1):.0%} saved; {d['blocks_deduplicated']:.0f} "
            f"blocks deduplicated, {d['blocks_sent']:.0f} sent)"
        )


def report_mix(mix_: dict[str, Any], args: dict[str, Any]) -> None:
    print(
        f"{args['decoders']} decode streams ({DECODE_PROMPT}-token prompts, {DECODE_TOKENS} "
        f"tokens) + {args['prefillers']} long-prompt streams ({args['long_prompt']} tokens, "
        f"{LONG_TOKENS} out), {args['rounds']} x {args['seconds']} s each"
    )
    print(
        f"{'fleet':>12} {'ITL p50 ms':>11} {'ITL p99 ms':>11} {'decode TTFT p50':>16} "
        f"{'long TTFT p50':>14} {'long TTFT p99':>14} {'decode reqs':>12} {'long reqs':>10}"
    )
    for name, label in (("colocated", "2 mixed"), ("pd", "1P:1D")):
        row = mix_[name]
        print(
            f"{label:>12} {row['itl_p50_s'] * 1e3:>11.1f} {row['itl_p99_s'] * 1e3:>11.1f} "
            f"{row['decode_ttft_p50_s'] * 1e3:>14.0f}ms {row['long_ttft_p50_s'] * 1e3:>12.0f}ms "
            f"{row['long_ttft_p99_s'] * 1e3:>12.0f}ms {row['decode_requests']:>12} "
            f"{row['long_requests']:>10}"
        )
    ratio = mix_["pd"]["itl_p99_s"] / mix_["colocated"]["itl_p99_s"]
    print(f"decode ITL p99, 1P:1D / 2 mixed: {ratio:.2f}x (target <= 0.5)")


def report_second_token(rows: list[dict[str, Any]]) -> None:
    print(
        "\nHandoff cost to the second token (one request at a time, 64 output tokens; medians).\n"
        "Client clock: TTFT, 2nd-token gap, median gap, cost = 2nd gap - median gap, max gap.\n"
        "Proxy metrics: handoff = first token's frame written -> commit (inside the 2nd gap),\n"
        "downtime = first token sampled -> commit (its first part delays token 1's delivery).\n"
        "Prefill agent's report: stages, KV sent by the stop-and-copy, KV sent in all."
    )
    print(
        f"{'context':>8} {'TTFT ms':>8} {'2nd gap':>8} {'median':>7} {'cost ms':>8} "
        f"{'max gap':>8} {'handoff':>8} {'downtime':>9} {'stages':>7} {'final MiB':>10} "
        f"{'MiB sent':>9} {'colocated max gap':>18}"
    )
    for row in rows:
        pd, co, rep = row["pd"], row["colocated"], row["report"]
        per_block = rep.get("bytes_sent", 0) / max(rep.get("blocks_sent", 0), 1)
        final = rep.get("final_blocks", float("nan")) * per_block / 2**20
        print(
            f"{row['context']:>8} {pd['ttft_s'] * 1e3:>8.0f} {pd['second_token_s'] * 1e3:>8.1f} "
            f"{pd['median_gap_s'] * 1e3:>7.1f} {pd['second_token_cost_s'] * 1e3:>8.1f} "
            f"{pd['max_gap_s'] * 1e3:>8.1f} {pd['handoff_s'] * 1e3:>8.1f} "
            f"{pd['downtime_s'] * 1e3:>9.1f} {rep.get('stages', 0):>7} {final:>10.2f} "
            f"{pd['bytes_sent'] / 2**20:>9.2f} {co['max_gap_s'] * 1e3:>16.1f}ms"
        )
    first, last = rows[0]["pd"], rows[-1]["pd"]
    print(
        f"{rows[-1]['context']}/{rows[0]['context']} tokens of context: largest gap "
        f"{last['max_gap_s'] / first['max_gap_s']:.2f}x, 2nd-token gap "
        f"{last['second_token_s'] / first['second_token_s']:.2f}x, handoff "
        f"{last['handoff_s'] / max(first['handoff_s'], 1e-9):.2f}x (target: flat)"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="small")
    parser.add_argument("--seconds", type=float, default=20.0, help="per round and fleet, (a)")
    parser.add_argument("--rounds", type=int, default=2, help="alternations of the two fleets")
    parser.add_argument("--decoders", type=int, default=4)
    parser.add_argument("--prefillers", type=int, default=2)
    parser.add_argument("--long-prompt", type=int, default=1536)
    parser.add_argument("--contexts", default="512,1024,2048,3072")
    parser.add_argument("--repeats", type=int, default=3, help="requests per context, (b)")
    parser.add_argument("--prefix", type=int, default=1024, help="shared prefix, (c)")
    parser.add_argument("--shared", type=int, default=6, help="requests sharing it, (c)")
    parser.add_argument("--chunk", type=int, default=512, help="prefill tokens per engine step")
    parser.add_argument("--sections", default="abc", help="which of (a), (b), (c) to run")
    parser.add_argument("--json", default=None, help="also write the figures here")
    args = parser.parse_args()
    result = asyncio.run(run(args))
    report(result)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
