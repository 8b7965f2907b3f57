"""Fault-injection scenarios against real fleets, shared by the chaos suite and ``bench/chaos_bench.py``.

Usage::

    figures = await instance_lost(signal.SIGSTOP)         # 1 of 4 agents hung under mixed load
    figures = await migration_fault("destination", "commit")
    print(Figures.table([figures]))

Contract:
- Every scenario starts its own agents (``kvherd agent --model tiny`` subprocesses) and its own
  ``kvherd serve`` subprocess, injects one fault, and returns `Figures`: requests sent, completed
  (200 and, for streams, ``[DONE]`` with no error frame), identical to the undisturbed run (every
  request is greedy: its reference is the same body sent straight to an agent before the fault),
  hangs (no answer within the client's timeout), 5xx answers, seconds from the fault until the
  proxy takes the instance out of rotation, and the blocks the surviving agents still hold once idle.
- The scenarios pace themselves by events (requests started, tokens streamed, a control message
  seen), never by sleeps standing in for them; the only clocks are the figures they measure and
  the bounds after which a request counts as hung. Assertions are the callers' business.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import signal
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

import httpx
from agent_process import AgentProcess, agent_processes
from fault_relay import Fault, FaultRelay
from serve_process import Served, serve_process

HANG_S = 120.0  # a request with no complete answer by then is hung
MAX_TOKENS = 96
PAYLOADS = 8  # distinct greedy bodies: half streamed, a quarter chat
# Fast failure detection, as an operator of a fault-tolerant fleet sets it; half the fleet may go
# at once in the pair scenarios, so admission may wait long (these are about admitted requests).
SERVE_FLAGS = ("--health-interval", "0.5", "--health-timeout", "1", "--max-queue-wait", "60")


@dataclass
class Figures:
    scenario: str
    requests: int = 0
    completed: int = 0
    identical: int | None = 0  # None: no generation to compare (floods, fuzzing)
    hangs: int = 0
    errors_5xx: int = 0
    eject_s: float | None = None
    recovery_s: float | None = None
    leaked_blocks: int | None = 0  # None: not measured
    notes: list[str] = field(default_factory=list)  # what a failed request saw (first few)

    @property
    def completed_pct(self) -> float:
        return 100.0 * self.completed / self.requests if self.requests else 100.0

    @property
    def identical_pct(self) -> float | None:
        if self.identical is None:
            return None
        return 100.0 * self.identical / self.requests if self.requests else 100.0

    @staticmethod
    def table(rows: list[Figures]) -> str:
        head = ("scenario", "requests", "completed %", "identical %", "hangs", "5xx",
                "time to eject s", "recovery s", "leaked blocks")  # fmt: skip
        lines = [head]
        for r in rows:
            lines.append(
                (
                    r.scenario,
                    str(r.requests),
                    f"{r.completed_pct:.1f}",
                    "-" if r.identical_pct is None else f"{r.identical_pct:.1f}",
                    str(r.hangs),
                    str(r.errors_5xx),
                    "-" if r.eject_s is None else f"{r.eject_s:.2f}",
                    "-" if r.recovery_s is None else f"{r.recovery_s:.2f}",
                    "-" if r.leaked_blocks is None else str(r.leaked_blocks),
                )
            )
        widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
        out = [
            "| " + " | ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)) + " |"
            for line in lines
        ]
        out.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
        return "\n".join(out)


# -- the load --------------------------------------------------------------------------------------
def payload(i: int, max_tokens: int = MAX_TOKENS) -> tuple[str, dict[str, Any]]:
    """(path, body) of greedy request kind `i` (mod PAYLOADS): distinct prompts, no shared prefix."""
    i %= PAYLOADS
    body: dict[str, Any] = {"max_tokens": max_tokens, "ignore_eos": True, "temperature": 0.0}
    body["stream"] = i % 2 == 0
    if i % 4 >= 2:
        path = "/v1/chat/completions"
        body["messages"] = [{"role": "user", "content": f"Tale number {i} of the herd, please."}]
    else:
        path = "/v1/completions"
        body["prompt"] = [(i * 31 + j * 7 + 3) % 250 for j in range(32)]
    if body["stream"]:
        body["stream_options"] = {"include_usage": True}
    return path, body


@dataclass
class Outcome:
    status: int = 0
    text: str = ""
    done: bool = False
    hung: bool = False
    error: str = ""
    frames: int = 0  # streamed chunks seen so far (the scenarios wait on them)


async def send(
    client: httpx.AsyncClient,
    base: str,
    path: str,
    body: dict[str, Any],
    outcome: Outcome,
    request_id: str | None = None,
) -> Outcome:
    """One request as a client sees it; `outcome` fills in as the answer arrives."""
    chat = path.endswith("chat/completions")
    headers = {} if request_id is None else {"X-Request-Id": request_id}
    try:
        async with asyncio.timeout(HANG_S):
            if not body.get("stream"):
                response = await client.post(base + path, json=body, headers=headers)
                outcome.status = response.status_code
                if response.status_code != 200:
                    outcome.error = response.text[:200]
                    return outcome
                choice = response.json()["choices"][0]
                outcome.text = choice["message"]["content"] if chat else choice["text"]
                outcome.done = True
                return outcome
            async with client.stream("POST", base + path, json=body, headers=headers) as response:
                outcome.status = response.status_code
                if response.status_code != 200:
                    outcome.error = (await response.aread()).decode(errors="replace")[:200]
                    return outcome
                async for line in response.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    if line == "data: [DONE]":
                        outcome.done = True
                        continue
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        outcome.error = json.dumps(chunk)[:200]
                        continue
                    for choice in chunk["choices"]:
                        outcome.frames += 1
                        outcome.text += (
                            choice["delta"].get("content") or "" if chat else choice["text"]
                        )
    except TimeoutError:
        outcome.hung = True
    except httpx.HTTPError as exc:
        outcome.error = f"{type(exc).__name__}: {exc}"
    if outcome.error:
        outcome.done = False
    return outcome


async def references(
    agent: AgentProcess, max_tokens: int = MAX_TOKENS, kinds: range | list[int] = range(PAYLOADS)
) -> dict[int, str]:
    """The undisturbed output of payload `kinds`, straight from one agent."""
    expected = {}
    async with httpx.AsyncClient(timeout=HANG_S) as client:
        for kind in kinds:
            outcome = await send(client, agent.url, *payload(kind, max_tokens), Outcome())
            assert outcome.done and not outcome.error, (kind, outcome)
            expected[kind] = outcome.text
    return expected


def score(figures: Figures, results: list[tuple[int, Outcome]], expected: dict[int, str]) -> None:
    figures.requests += len(results)
    for kind, o in results:
        ok = o.status == 200 and o.done and not o.error and not o.hung
        figures.completed += ok
        assert figures.identical is not None
        figures.identical += ok and o.text == expected[kind % PAYLOADS]
        figures.hangs += o.hung
        figures.errors_5xx += o.status >= 500
        if not ok and len(figures.notes) < 5:
            figures.notes.append(f"kind {kind}: status {o.status} {o.error[:160]}")


# -- the fleet -------------------------------------------------------------------------------------
async def leaked_blocks(
    agents: list[AgentProcess], timeout: float = 90.0, headers: dict[str, str] | None = None
) -> int:
    """Blocks the (live) agents still hold once idle: requests and migration reservations that
    should have ended. Waits up to `timeout` (a silent source's reservation expires in ~40 s)."""
    leaked = 0
    async with httpx.AsyncClient(timeout=10, headers=headers) as client:
        for agent in agents:
            url = f"{agent.url}/kvherd/v1/state?check_integrity=true"
            deadline = time.monotonic() + timeout
            while True:
                state = (await client.get(url)).json()
                assert state["integrity"] == "ok", state["integrity"]
                held = state["total_blocks"] - state["free_blocks"]
                idle = state["num_running"] == 0 and state["num_waiting"] == 0
                if (
                    idle and held == 0 and not state["block_owners"]
                ) or time.monotonic() > deadline:
                    leaked += held
                    break
                await asyncio.sleep(0.1)  # requests a client left may still be finishing
    return leaked


async def health_of(client: httpx.AsyncClient, served: Served) -> dict[str, str]:
    """Instance URL -> the proxy's health word ("healthy", "ejected", ...)."""
    answer = await client.get(
        served.admin_url + "/admin/v1/instances", headers=served.admin_headers
    )
    return {i["url"]: i["health"] for i in answer.json()["data"]}


async def time_to_eject(
    served: Served, url: str, since: float, timeout: float = 60.0
) -> float | None:
    """Seconds from `since` until the proxy stops calling instance `url` healthy."""
    async with httpx.AsyncClient(timeout=10) as client:
        while time.monotonic() - since < timeout:
            if (await health_of(client, served)).get(url) != "healthy":
                return time.monotonic() - since
            await asyncio.sleep(0.02)
    return None


# -- scenario: one of N agents killed or hung under load -------------------------------------------
async def instance_lost(
    sig: signal.Signals, num_agents: int = 4, clients: int = 12, after_faults: int = 48
) -> Figures:
    """`sig` (SIGKILL or SIGSTOP) to one of `num_agents` agents while `clients` closed-loop clients
    send mixed streamed/plain greedy requests through ``kvherd serve`` (round robin, so the victim
    carries its share); the load goes on until `after_faults` more requests were sent."""
    figures = Figures(f"{sig.name} 1 of {num_agents} agents")
    with agent_processes(num_agents) as fleet:
        expected = await references(fleet[0])
        victim = fleet[-1]
        flags = ("--policy", "round_robin", "--migration-policy", "none", *SERVE_FLAGS)
        with serve_process([a.instance_spec() for a in fleet], *flags) as served:
            try:
                results = await _load_with_fault(
                    served, victim, sig, clients, after_faults, figures
                )
            finally:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(victim.process.pid, signal.SIGKILL)  # a hung one is gone for good
            score(figures, results, expected)
            if figures.completed < figures.requests:
                figures.notes.append("proxy log: " + served.log()[-3000:])
        figures.leaked_blocks = await leaked_blocks([a for a in fleet if a is not victim])
    return figures


async def _load_with_fault(
    served: Served,
    victim: AgentProcess,
    sig: signal.Signals,
    clients: int,
    after_faults: int,
    figures: Figures,
) -> list[tuple[int, Outcome]]:
    kinds = itertools.count()
    results: list[tuple[int, Outcome]] = []
    started: list[Outcome] = []
    faulted = asyncio.Event()
    sent_after = 0

    async def client_loop(client: httpx.AsyncClient) -> None:
        nonlocal sent_after
        while not faulted.is_set() or sent_after < after_faults:
            kind = next(kinds)
            sent_after += faulted.is_set()
            outcome = Outcome()
            started.append(outcome)
            results.append((kind, await send(client, served.url, *payload(kind), outcome)))

    async with httpx.AsyncClient(timeout=None, limits=httpx.Limits(max_connections=None)) as http:
        loops = [asyncio.ensure_future(client_loop(http)) for _ in range(clients)]
        # The fault lands once every client has a request going and some streams are mid-way.
        while not (len(started) >= 2 * clients and sum(o.frames >= 8 for o in started) >= 2):
            await asyncio.sleep(0.005)
        os.kill(victim.process.pid, sig)
        at = time.monotonic()
        faulted.set()
        figures.eject_s = await time_to_eject(served, victim.url, at)
        await asyncio.gather(*loops)
    return results


# -- scenario: a migration cut at one of its stages ------------------------------------------------
Victim = Literal["destination", "source"]
Point = Literal["live", "stop-and-copy", "commit", "committed", "resumed"]
# Where each point is, as the destination's control messages show it: a stage's reservation
# answered (its KV copy is under way) while the request still decodes on the source ("live") or
# once it is suspended there ("stop-and-copy", whichever stage that is), a commit about to be
# delivered, a commit accepted, the proxy's reattachment answered (the stream goes on from the
# destination). The stream migrates after 60 tokens: 92 tokens of context, 6 blocks, more than
# the 4 a stop-and-copy takes, so its first stage is live.
_FAULTS: dict[Point, tuple[str, Literal["before", "after"]]] = {
    "live": ("/kvherd/v1/migration/reserve", "after"),
    "stop-and-copy": ("/kvherd/v1/migration/reserve", "after"),
    "commit": ("/kvherd/v1/migration/commit", "before"),
    "committed": ("/kvherd/v1/migration/commit", "after"),
    "resumed": ("/resume", "after"),
}
MIGRATE_AFTER = 60


@contextlib.contextmanager
def _relayed(agents: list[AgentProcess]) -> Iterator[list[FaultRelay]]:
    with contextlib.ExitStack() as stack:
        yield [stack.enter_context(FaultRelay(a.url)) for a in agents]


async def migration_fault(
    victim: Victim, point: Point, max_tokens: int = 700, after_tokens: int = 0
) -> Figures:
    """A greedy stream and a plain request run on one of two agents; the proxy's operator migrates
    the stream to the other and `victim` is SIGKILLed at `point` of that migration, or once the
    client got `after_tokens` more of the stream's chunks (a token each) after it. Each agent is
    behind a `FaultRelay` (the proxy and the agents only know the relays' URLs)."""
    scenario = f"kill {victim} at {point}"
    figures = Figures(f"{scenario} +{after_tokens} tokens" if after_tokens else scenario)
    with agent_processes(2) as pair, _relayed(pair) as relays:
        expected = await references(pair[0], max_tokens, [0, 1])
        specs = [a.instance_spec(r.url) for a, r in zip(pair, relays, strict=True)]
        flags = ("--migration-policy", "none", "--policy", "round_robin", *SERVE_FLAGS,
                 "--expose-instance")  # fmt: skip
        with serve_process(specs, *flags) as served:
            async with httpx.AsyncClient(timeout=None) as http:
                instances = (
                    await http.get(served.admin_url + "/admin/v1/instances",
                                   headers=served.admin_headers)
                ).json()["data"]  # fmt: skip
                ids = {i["url"]: i["instance_id"] for i in instances}
                stream = Outcome()
                kind = 0  # a streamed completion
                running = asyncio.ensure_future(
                    send(http, served.url, *payload(kind, max_tokens), stream, "chaos-stream")
                )
                await _wait(lambda: stream.frames >= MIGRATE_AFTER or running.done())
                src = await _instance_of(http, pair, relays)
                s = next(k for k, r in enumerate(relays) if r.url == src)
                d = 1 - s
                dead = pair[d] if victim == "destination" else pair[s]
                path, when = _FAULTS[point]
                match = _while(point == "live", pair[s]) if "reserve" in path else _anything
                kill = lambda: os.kill(dead.process.pid, signal.SIGKILL)  # noqa: E731
                reached: list[int] = []  # the client's frames when `point` was reached
                action = (lambda: reached.append(stream.frames)) if after_tokens else kill
                relays[d].arm(Fault(path, when, action, match))
                # A plain request sent alongside: it must complete whatever happens.
                plain = asyncio.ensure_future(
                    send(http, served.url, *payload(1, max_tokens), Outcome())
                )
                order = await http.post(
                    served.admin_url + "/admin/v1/migrate",
                    json={"request_id": "chaos-stream", "to": ids[relays[d].url]},
                    headers=served.admin_headers,
                )
                figures.notes.append(f"migrate: {order.status_code} {order.text[:160]}")
                fired = await asyncio.to_thread(relays[d].fired.wait, 60)
                if fired and after_tokens:
                    enough = reached[0] + after_tokens
                    await _wait(lambda: stream.frames >= enough or running.done())
                    if running.done():
                        figures.notes.append("the stream ended before the fault")
                    kill()
                    figures.notes.append(
                        f"{point} at token {reached[0]}, killed at {stream.frames}"
                    )
                at = time.monotonic()
                if not fired:
                    figures.notes.append("the fault never fired")
                figures.eject_s = await time_to_eject(served, relays[pair.index(dead)].url, at)
                results = [(kind, await running), (1, await plain)]
            score(figures, results, expected)
            if figures.completed < figures.requests:
                figures.notes.append("proxy log: " + served.log()[-3000:])
        figures.leaked_blocks = await leaked_blocks([a for a in pair if a is not dead])
    return figures


def _while(decoding: bool, source: AgentProcess) -> Callable[[Any], bool]:
    """A reservation for a request that is decoding on `source` (or, not `decoding`, suspended
    there: the stop-and-copy stage)."""

    def match(body: Any) -> bool:
        if not isinstance(body, dict):
            return False
        state = httpx.get(f"{source.url}/kvherd/v1/state", timeout=10).json()
        running = {r["request_id"] for r in state["running"]}
        return (body.get("request_id") in running) == decoding

    return match


def _anything(body: Any) -> bool:
    return True


async def _instance_of(
    http: httpx.AsyncClient, pair: list[AgentProcess], relays: list[FaultRelay]
) -> str:
    """The relay URL of the agent running the stream (the only request so far)."""
    for agent, relay in zip(pair, relays, strict=True):
        state = (await http.get(agent.url + "/kvherd/v1/state")).json()
        if state["running"]:
            return relay.url
    raise AssertionError("the stream runs nowhere")


async def _wait(condition: Any, timeout: float = HANG_S) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.005)


# -- scenario: fuzzed bodies -----------------------------------------------------------------------
async def fuzz(bodies_per_route: int) -> Figures:
    """`bodies_per_route` fuzzed bodies (`fuzz_bodies.requests`) to each OpenAI route, each sent to
    an agent (with a fleet token) and to ``kvherd serve`` in front of it. A body counts as
    completed when both answered 2xx, or 4xx with the OpenAI error object."""
    from fuzz_bodies import ROUTES, check_answer, requests
    from hypothesis import HealthCheck, given, settings

    figures = Figures(
        f"fuzz {bodies_per_route} bodies/route x {len(ROUTES)} routes x 2", identical=None
    )
    env = {"KVHERD_FLEET_TOKEN": "chaos-fleet-token"}
    auth = {"Authorization": "Bearer chaos-fleet-token"}
    with (
        agent_processes(1, env=env) as (agent,),
        serve_process([agent.instance_spec()], "--migration-policy", "none", env=env) as served,
        httpx.Client(timeout=60) as client,
    ):

        def one(request: tuple[str, str, bytes, dict[str, str]]) -> None:
            method, path, body, headers = request
            for base in (agent.url, served.url):
                figures.requests += 1
                try:
                    response = client.request(method, base + path, content=body, headers=headers)
                except httpx.TimeoutException:
                    figures.hangs += 1
                    continue
                figures.errors_5xx += response.status_code >= 500
                try:
                    check_answer(response, base)
                except (AssertionError, ValueError, KeyError) as exc:
                    if len(figures.notes) < 5:
                        figures.notes.append(f"{method} {base}{path} {body[:80]!r}: {exc}")
                    continue
                figures.completed += 1

        run = settings(
            max_examples=bodies_per_route,
            deadline=None,
            database=None,
            suppress_health_check=list(HealthCheck),
        )
        for route in ROUTES:
            await asyncio.to_thread(run(given(requests(route))(one)))
        figures.leaked_blocks = await leaked_blocks([agent], headers=auth)
    return figures
