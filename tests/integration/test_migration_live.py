"""Live migration between two real `kvherd agent` processes, as a client sees it.

A request sent to agent A is migrated to agent B mid-generation with ``POST A/kvherd/v1/migrate``;
the client's connection stays with A, which relays the rest from B. The client must get exactly
the tokens, text and usage of an unmigrated run, streamed or not, and neither agent may keep a
block afterwards.
"""

from __future__ import annotations

import itertools
import json
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
from agent_process import AgentProcess
from test_proxy import agents as agents_started

pytestmark = pytest.mark.timeout(180)

PROMPT = [(i * 11 + 7) % 250 for i in range(45)]
# Long enough that a migration ordered early has time to finish first: the tiny model decodes
# ~1 token/ms on an idle machine, and a migration takes tens of milliseconds.
MAX_TOKENS = 600
GREEDY = {"temperature": 0.0}
SEEDED = {"temperature": 0.9, "top_p": 0.95, "seed": 1234}
_ids = itertools.count()


@pytest.fixture(scope="module")
def agents() -> Iterator[tuple[AgentProcess, AgentProcess]]:
    with agents_started(2, "--block-size", "4", kv_events=False) as (a, b):
        yield a, b


def body(sampling: dict[str, Any], stream: bool) -> dict[str, Any]:
    payload: dict[str, Any] = {
        "model": "tiny",
        "prompt": PROMPT,
        "max_tokens": MAX_TOKENS,
        "ignore_eos": True,
        "return_token_ids": True,
        "stream": stream,
        **sampling,
    }
    if stream:
        payload["stream_options"] = {"include_usage": True}
    return payload


def wait_until(condition: Callable[[], bool], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.002)


class Generation:
    """One completion on a background thread; `tokens` grows as the client receives them."""

    def __init__(self, url: str, payload: dict[str, Any], request_id: str) -> None:
        self.url, self.payload, self.request_id = url, payload, request_id
        self.tokens: list[int] = []
        self.text = ""
        self.usage: dict[str, Any] | None = None
        self.finish_reason: str | None = None
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run)
        self._thread.start()

    def _run(self) -> None:
        try:
            with httpx.Client(timeout=60) as client:
                headers = {"X-Request-Id": self.request_id}
                if self.payload["stream"]:
                    self._stream(client, headers)
                else:
                    response = client.post(
                        f"{self.url}/v1/completions", json=self.payload, headers=headers
                    )
                    assert response.status_code == 200, response.text
                    assert response.headers["x-request-id"] == self.request_id
                    data = response.json()
                    choice = data["choices"][0]
                    self.tokens, self.text = choice["token_ids"], choice["text"]
                    self.finish_reason, self.usage = choice["finish_reason"], data["usage"]
        except BaseException as exc:  # re-raised on the test's thread by `result`
            self.error = exc

    def _stream(self, client: httpx.Client, headers: dict[str, str]) -> None:
        with client.stream(
            "POST", f"{self.url}/v1/completions", json=self.payload, headers=headers
        ) as response:
            assert response.status_code == 200
            for line in response.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                assert "error" not in chunk, chunk
                if chunk.get("usage") is not None:
                    self.usage = chunk["usage"]
                for choice in chunk["choices"]:
                    self.tokens.extend(choice.get("token_ids") or [])
                    self.text += choice["text"]
                    self.finish_reason = choice["finish_reason"] or self.finish_reason

    def result(self) -> Generation:
        self._thread.join(120)
        if self.error is not None:
            raise self.error
        return self


def output_tokens_on(agent: AgentProcess, request_id: str) -> int:
    state = httpx.get(f"{agent.url}/kvherd/v1/state").json()
    running = [r for r in state["running"] if r["request_id"] == request_id]
    return int(running[0]["num_output_tokens"]) if running else 0


def assert_clean(*agents: AgentProcess) -> None:
    """Nothing running, no block held by anyone, the block manager's invariants hold."""
    for agent in agents:

        def idle(agent: AgentProcess = agent) -> bool:
            state = httpx.get(f"{agent.url}/kvherd/v1/state?check_integrity=true").json()
            assert state["integrity"] == "ok", state["integrity"]
            return state["num_running"] == 0 and state["block_owners"] == []

        wait_until(idle)


def migrate(source: AgentProcess, request_id: str, dst: str) -> dict[str, Any]:
    response = httpx.post(
        f"{source.url}/kvherd/v1/migrate",
        json={"request_id": request_id, "dst": dst},
        timeout=60,
    )
    assert response.status_code == 200, response.text
    return dict(response.json())


_references: dict[tuple[str, bool], Generation] = {}


def reference(agent: AgentProcess, sampling: dict[str, Any], stream: bool) -> Generation:
    key = (json.dumps(sampling), stream)
    if key not in _references:
        _references[key] = Generation(agent.url, body(sampling, stream), f"ref-{next(_ids)}")
    return _references[key].result()


@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "plain"])
@pytest.mark.parametrize("sampling", [GREEDY, SEEDED], ids=["greedy", "seeded"])
@pytest.mark.parametrize("after_tokens", [1, MAX_TOKENS // 3, MAX_TOKENS - 1])
def test_migrated_request_matches_an_unmigrated_run(
    agents: tuple[AgentProcess, AgentProcess],
    sampling: dict[str, Any],
    stream: bool,
    after_tokens: int,
) -> None:
    a, b = agents
    expected = reference(a, sampling, stream)
    assert len(expected.tokens) == MAX_TOKENS
    rid = f"mig-{next(_ids)}"
    generation = Generation(a.url, body(sampling, stream), rid)
    if stream:
        wait_until(lambda: len(generation.tokens) >= after_tokens or generation.error is not None)
    else:
        wait_until(
            lambda: output_tokens_on(a, rid) >= after_tokens or not generation._thread.is_alive()
        )
    outcome = migrate(a, rid, b.url)
    got = generation.result()
    if after_tokens < MAX_TOKENS - 1:
        # Most of the request is still ahead: the migration has time to finish first.
        assert outcome["status"] == "committed", json.dumps(outcome)
    if outcome["status"] == "committed":
        # Blocks B already caches (the prompt, after the first test) are shared, not sent.
        moved = outcome["blocks_sent"] + outcome["blocks_skipped"]
        assert moved * 4 >= len(PROMPT) and outcome["downtime_s"] > 0
    else:
        # The request finished on A before the stop-and-copy: nothing moved, nothing lost.
        assert outcome["reason"] == "request_finished", outcome
    assert got.tokens == expected.tokens
    assert got.text == expected.text
    assert got.finish_reason == "length"
    assert got.usage is not None and expected.usage is not None
    assert got.usage["prompt_tokens"] == len(PROMPT)
    assert got.usage["completion_tokens"] == MAX_TOKENS
    assert got.usage["total_tokens"] == len(PROMPT) + MAX_TOKENS
    assert_clean(a, b)


def test_request_migrated_back_and_forth_stays_exact(
    agents: tuple[AgentProcess, AgentProcess],
) -> None:
    """A -> B, then B -> A while A still relays it: the second source relays to the first."""
    a, b = agents
    expected = reference(a, GREEDY, True)
    rid = f"pingpong-{next(_ids)}"
    generation = Generation(a.url, body(GREEDY, True), rid)
    wait_until(lambda: len(generation.tokens) >= 2)
    assert migrate(a, rid, b.url)["status"] == "committed"
    wait_until(lambda: output_tokens_on(b, rid) > 0 or not generation._thread.is_alive())
    back = migrate(b, rid, a.url)
    got = generation.result()
    assert back["status"] in ("committed", "aborted"), back
    assert got.tokens == expected.tokens and got.text == expected.text
    assert_clean(a, b)


def test_client_leaving_after_migration_frees_both_agents(
    agents: tuple[AgentProcess, AgentProcess],
) -> None:
    a, b = agents
    rid = f"leave-{next(_ids)}"
    payload = body(GREEDY, True) | {"max_tokens": 1500}
    with (
        httpx.Client(timeout=60) as client,
        client.stream(
            "POST", f"{a.url}/v1/completions", json=payload, headers={"X-Request-Id": rid}
        ) as response,
    ):
        lines = response.iter_lines()
        next(line for line in lines if line.startswith("data: "))
        assert migrate(a, rid, b.url)["status"] == "committed"
        wait_until(lambda: output_tokens_on(b, rid) > 0)
    # The connection is closed: A cancels its relay, B aborts the request.
    assert_clean(a, b)


def test_reattaching_client_gets_a_notice_and_resumes_at_the_destination(
    agents: tuple[AgentProcess, AgentProcess],
) -> None:
    """The proxy's side of the protocol, spoken by the test: the source's stream ends with the
    migration notice (no [DONE]); resuming at the destination gives exactly the missing rest."""
    a, b = agents
    expected = reference(a, SEEDED, True)
    rid = f"reattach-{next(_ids)}"
    tokens: list[int] = []
    notice: dict[str, Any] | None = None
    with httpx.Client(timeout=60) as client:
        headers = {"X-Request-Id": rid, "X-Kvherd-Reattach": "1"}
        with client.stream(
            "POST", f"{a.url}/v1/completions", json=body(SEEDED, True), headers=headers
        ) as response:
            lines = response.iter_lines()
            for line in lines:
                if line.startswith("data: "):
                    tokens.extend(json.loads(line[6:])["choices"][0]["token_ids"])
                    break
            assert migrate(a, rid, b.url)["status"] == "committed"
            rest = [line[6:] for line in lines if line.startswith("data: ")]
        assert rest[-1] != "[DONE]"
        for data in rest[:-1]:
            tokens.extend(json.loads(data)["choices"][0]["token_ids"])
        notice = json.loads(rest[-1])["kvherd"]
        assert notice["migrated_to"] == b.url and notice["request_id"] == rid
        assert notice["resume"]["from"] == len(tokens)
        url = f"{b.url}/kvherd/v1/requests/{rid}/resume"
        assert client.post(url, json={"from": "x"}).status_code == 400
        assert (
            client.post(url.replace(rid, "nobody") + "?wait=0", json=notice["resume"]).status_code
            == 404
        )
        usage = None
        with client.stream("POST", url, json=notice["resume"]) as response:
            assert response.status_code == 200
            frames = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
        assert frames[-1] == "[DONE]"
        for data in frames[:-1]:
            chunk = json.loads(data)
            assert chunk["id"] == f"cmpl-{rid}"
            if chunk.get("usage"):
                usage = chunk["usage"]
            for choice in chunk["choices"]:
                tokens.extend(choice["token_ids"] or [])
    assert tokens == expected.tokens
    assert usage is not None and expected.usage is not None
    for key in ("prompt_tokens", "completion_tokens", "total_tokens"):
        assert usage[key] == expected.usage[key]
    assert_clean(a, b)
