"""Load that a fleet has the batch slots to run at once, and the loss of one instance under it
(shared by ``tests/vllm/test_vllm_admission.py`` and ``tests/integration/test_admission_capacity.py``).

Issue 22: admission must not refuse what the engines can start. A burst of as many requests as
the fleet has batch slots fits the engines' batches, so it is served without a 429; after one of
two instances is SIGKILLed, the survivor serves a closed loop of as many clients as it has slots.

Contract:
- `burst(url, n, max_tokens)` sends `n` greedy completions at once (even ones streamed, odd ones
  not; each prompt distinct, ``ignore_eos`` so each generates exactly `max_tokens`) and returns
  one `Outcome` per request. Every request is bounded (`REQUEST_TIMEOUT_S`, and the whole burst
  `BURST_TIMEOUT_S`): a request that does not finish is recorded as a hang, never awaited forever.
- `Outcome` is what the client saw: HTTP status, the instance that served it
  (``X-Kvherd-Instance``, with ``--expose-instance``), tokens received, whether a stream ended
  with ``[DONE]`` and no error frame, the refusal's body and ``Retry-After``, and its send, end
  and latency times (monotonic seconds). `ok` is a complete answer: 200 and exactly
  `max_tokens` tokens (a stream: ended cleanly, its usage says so too).
- `burst_behind_long(url, long_n, n, max_tokens, long_tokens, settle_s)`: `long_n` streamed long
  generations (`long_tokens`) are started and held open until each has sent its first token
  (they run in the engines' batches), then, `settle_s` later (a while with no completion), a
  `burst` of `n` more; once the burst has ended the long streams are closed (the proxy aborts
  them upstream). Returns (the long ones, the burst): a long one is `started` once its first
  token came; it never ends by itself here, so only its status and start are judged.
- `closed_loop_with_kill(url, clients, per_client, max_tokens, kill)` runs `clients` closed-loop
  clients; once every client has had a request served (200: the fleet is warm and serving), it calls
  `kill()` (the caller's SIGKILL) from the event loop, and each client then sends `per_client`
  more requests. Returns a `KillRun`: the outcomes sent before the kill, in flight at it, and sent
  after it, plus the kill's time.
- `burst_problems(outcomes)` lists what a burst that fits the fleet's slots must not show (429s,
  incomplete answers, hangs), and says so when it was not a burst at all.
- `describe(outcomes)` is a short text for assertion messages: counts by status, the distinct
  refusal messages (with their ``Retry-After``), hangs and latency quantiles.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import httpx

REQUEST_TIMEOUT_S = 60.0  # one request, client side: a hang is a failure, not a stuck test
BURST_TIMEOUT_S = 180.0  # a whole burst or closed-loop run


@dataclass
class Outcome:
    index: int
    stream: bool
    max_tokens: int
    sent: float = 0.0
    ended: float | None = None  # None: it never finished (a hang)
    status: int | None = None  # None: no response head (connection error or hang)
    instance: str | None = None
    tokens: int = 0
    clean_end: bool = False  # a stream ended with [DONE] and no error frame
    body: str = ""  # an error's body (first 300 characters)
    retry_after: str | None = None
    error: str | None = None  # a client-side exception
    started: bool = False  # a stream's first token arrived

    @property
    def ok(self) -> bool:
        complete = self.clean_end if self.stream else True
        return self.status == 200 and complete and self.tokens == self.max_tokens

    @property
    def hung(self) -> bool:
        return self.ended is None

    @property
    def latency(self) -> float | None:
        return None if self.ended is None else self.ended - self.sent


@dataclass
class KillRun:
    killed_at: float = 0.0
    before: list[Outcome] = field(default_factory=list)  # ended before the kill
    during: list[Outcome] = field(default_factory=list)  # sent before the kill, ended after it
    after: list[Outcome] = field(default_factory=list)  # sent after the kill


def _body(tag: str, index: int, stream: bool, max_tokens: int, model: str) -> dict[str, object]:
    body: dict[str, object] = {
        "model": model,
        # A distinct first word: no request shares a cached prefix with another.
        "prompt": f"{tag}-{index} quick brown fox over the lazy dog",
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": stream,
    }
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


async def send(
    client: httpx.AsyncClient,
    url: str,
    outcome: Outcome,
    tag: str,
    model: str,
) -> Outcome:
    """One completion, recorded into `outcome` (bounded by `REQUEST_TIMEOUT_S`)."""
    body = _body(tag, outcome.index, outcome.stream, outcome.max_tokens, model)
    outcome.sent = time.monotonic()
    try:
        await asyncio.wait_for(_exchange(client, url, body, outcome), REQUEST_TIMEOUT_S)
    except TimeoutError:
        outcome.error = f"no end within {REQUEST_TIMEOUT_S} s"
        return outcome  # ended stays None: a hang
    except httpx.HTTPError as exc:
        outcome.error = f"{type(exc).__name__}: {exc}"
    outcome.ended = time.monotonic()
    return outcome


async def _exchange(
    client: httpx.AsyncClient, url: str, body: dict[str, object], outcome: Outcome
) -> None:
    async with client.stream("POST", url + "/v1/completions", json=body) as response:
        outcome.status = response.status_code
        outcome.instance = response.headers.get("x-kvherd-instance")
        outcome.retry_after = response.headers.get("retry-after")
        if response.status_code != 200:
            outcome.body = (await response.aread()).decode(errors="replace")[:300]
            return
        if not outcome.stream:
            parsed = json.loads(await response.aread())
            outcome.tokens = int(parsed["usage"]["completion_tokens"])
            return
        usage_tokens = None
        errored = False
        done = False
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                continue
            chunk = json.loads(line[6:])
            outcome.started = True
            if "error" in chunk:
                errored = True
                outcome.body = line[:300]
            if chunk.get("usage") and not chunk.get("choices"):
                usage_tokens = int(chunk["usage"]["completion_tokens"])
        outcome.tokens = usage_tokens or 0
        outcome.clean_end = done and not errored


def _client() -> httpx.AsyncClient:
    return httpx.AsyncClient(
        timeout=httpx.Timeout(REQUEST_TIMEOUT_S),
        limits=httpx.Limits(max_connections=None, max_keepalive_connections=None),
        trust_env=False,
    )


async def burst(
    url: str, n: int, max_tokens: int, tag: str = "burst", model: str = "tiny"
) -> list[Outcome]:
    """`n` requests sent at once (module contract)."""
    outcomes = [Outcome(i, stream=i % 2 == 0, max_tokens=max_tokens) for i in range(n)]
    async with _client() as client:
        await asyncio.wait_for(
            asyncio.gather(*(send(client, url, o, tag, model) for o in outcomes)),
            BURST_TIMEOUT_S,
        )
    return outcomes


async def burst_behind_long(
    url: str,
    long_n: int,
    n: int,
    max_tokens: int,
    long_tokens: int,
    settle_s: float,
    tag: str = "behind",
    model: str = "tiny",
) -> tuple[list[Outcome], list[Outcome]]:
    """A burst while long generations run (module contract)."""
    held = [Outcome(i, stream=True, max_tokens=long_tokens) for i in range(long_n)]
    async with _client() as client:
        tasks = [asyncio.ensure_future(send(client, url, o, tag + "-long", model)) for o in held]
        try:
            deadline = time.monotonic() + BURST_TIMEOUT_S
            # Polled: the streams' first tokens land in `held` as they arrive.
            while not all(o.started or o.ended is not None for o in held):
                assert time.monotonic() < deadline, f"long generations never started: {held}"
                await asyncio.sleep(0.02)
            await asyncio.sleep(settle_s)
            outcomes = await burst(url, n, max_tokens, tag, model)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            for outcome in held:
                if outcome.ended is None:  # closed here, not hung
                    outcome.ended = time.monotonic()
                    outcome.error = "closed by the test after the burst"
    return held, outcomes


async def closed_loop_with_kill(
    url: str,
    clients: int,
    per_client: int,
    max_tokens: int,
    kill: Callable[[], None],
    tag: str = "kill",
    model: str = "tiny",
) -> KillRun:
    """`clients` closed-loop clients; `kill()` once each has been answered (module contract)."""
    run = KillRun()
    everything: list[Outcome] = []
    answered: set[int] = set()
    killed = asyncio.Event()
    all_answered = asyncio.Event()
    serial = iter(range(1_000_000))

    async def client_loop(client: httpx.AsyncClient, who: int) -> None:
        after = 0
        while after < per_client:
            index = next(serial)
            outcome = Outcome(index, stream=index % 2 == 0, max_tokens=max_tokens)
            everything.append(outcome)
            sent_after = killed.is_set()
            await send(client, url, outcome, tag, model)
            after += sent_after
            if outcome.ok:  # a refusal is not being served
                answered.add(who)
            if len(answered) == clients:
                all_answered.set()
            if outcome.hung:
                return  # its time is spent; the run reports it

    async with _client() as client:
        loops = [asyncio.ensure_future(client_loop(client, who)) for who in range(clients)]
        try:
            await asyncio.wait_for(all_answered.wait(), BURST_TIMEOUT_S)
            kill()
            run.killed_at = time.monotonic()
            killed.set()
            await asyncio.wait_for(asyncio.gather(*loops), BURST_TIMEOUT_S)
        finally:
            for loop in loops:
                loop.cancel()
    for outcome in everything:
        if outcome.sent >= run.killed_at:
            run.after.append(outcome)
        elif outcome.ended is not None and outcome.ended < run.killed_at:
            run.before.append(outcome)
        else:
            run.during.append(outcome)
    return run


def burst_problems(outcomes: Sequence[Outcome]) -> list[str]:
    """What a burst the fleet has the slots for must not show: refusals, incomplete answers
    or hangs; and that it was not one (the last request sent after the first was answered)."""
    problems = []
    refused = sum(o.status == 429 for o in outcomes)
    if refused:
        problems.append(f"{refused} of {len(outcomes)} refused (429)")
    if not all(o.ok for o in outcomes):
        problems.append(f"{sum(not o.ok for o in outcomes)} of {len(outcomes)} not complete")
    answered = [o.ended for o in outcomes if o.ok and o.ended is not None]
    if answered and max(o.sent for o in outcomes) >= min(answered):
        problems.append("not a burst: a request was answered before the last was sent")
    return problems


def describe(outcomes: Sequence[Outcome]) -> str:
    """Counts by status, distinct refusals, hangs and latencies (for assertion messages)."""
    statuses = Counter(o.status for o in outcomes)
    incomplete = [o for o in outcomes if o.status == 200 and not o.ok]
    refusals = Counter(
        (o.status, o.retry_after, o.body or o.error or "") for o in outcomes if o.status != 200
    )
    latencies = sorted(o.latency for o in outcomes if o.latency is not None)
    by_instance = Counter(o.instance for o in outcomes if o.status == 200)
    lines = [
        f"{len(outcomes)} requests: statuses {dict(statuses)}; ok {sum(o.ok for o in outcomes)}; "
        f"200 but incomplete {len(incomplete)}; hung {sum(o.hung for o in outcomes)}; "
        f"served by {dict(by_instance)}"
    ]
    if latencies:
        lines.append(
            f"latency s: median {statistics.median(latencies):.2f}, max {latencies[-1]:.2f}"
        )
    for (status, retry_after, text), count in refusals.most_common(6):
        lines.append(f"  {count} x {status} (Retry-After {retry_after}): {text}")
    for outcome in incomplete[:3]:
        lines.append(f"  incomplete: {outcome}")
    return "\n".join(lines)


def assert_survivor_served(run: KillRun, min_after: int) -> None:
    """What a kill test asserts, alike in front of agents and vLLM: no 429 before the kill (half
    the fleet's slots), at least `min_after` requests after it, none hung, >= 99% of them served
    whole, no 5xx."""
    report = (
        f"before the kill:\n{describe(run.before)}\nin flight at the kill:\n"
        f"{describe(run.during)}\nafter the kill:\n{describe(run.after)}"
    )
    print(report)
    assert len(run.after) >= min_after, report
    assert not [o for o in run.before if o.status == 429], report
    assert not [o for o in run.during + run.after if o.hung], report
    assert sum(o.ok for o in run.after) >= 0.99 * len(run.after), report
    assert not [o for o in run.after if o.status is not None and o.status >= 500], report
