"""Prefix pulls between two real agents (`instance_agent.prefix_pull`), without a proxy.

The holder computes a long prompt once; the puller is then asked for the same prompt with
``X-Kvherd-Pull`` naming the holder's block server. What must hold: the blocks land and the
request hits them (``cached_tokens``), its greedy and seeded output equals the holder's (which
computed everything), and on every fault of the holder (dead, or stalled past the pull's
timeout) the request is recomputed with the same output, no error. No block or reservation is
left behind on either side.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from agent_process import AgentProcess, agent_processes

pytestmark = pytest.mark.timeout(180)

BLOCK = 16
PROMPT = [(i * 7 + 3) % 250 for i in range(40 * BLOCK + 5)]  # 40 full blocks and a tail


@pytest.fixture(scope="module")
def pair() -> Iterator[list[AgentProcess]]:
    with agent_processes(
        2, "--block-size", str(BLOCK), "--pull-timeout", "1.0", kv_events=False
    ) as agents:
        yield agents


def complete(agent: AgentProcess, prompt: list[int], headers: dict[str, str] | None = None,
             **sampling: Any) -> httpx.Response:  # fmt: skip
    body = {"prompt": prompt, "max_tokens": 12, "temperature": 0.0, **sampling}
    response = httpx.post(f"{agent.url}/v1/completions", json=body, headers=headers, timeout=60)
    assert response.status_code == 200, response.text
    return response


def state(agent: AgentProcess) -> dict[str, Any]:
    got = httpx.get(f"{agent.url}/kvherd/v1/state", params={"check_integrity": "true"})
    return dict(got.json())


def assert_clean(agent: AgentProcess) -> None:
    snapshot = state(agent)
    assert snapshot["integrity"] == "ok", snapshot["integrity"]
    assert snapshot["block_owners"] == [], snapshot["block_owners"]


def pull_header(holder: AgentProcess, blocks: int = 40) -> dict[str, str]:
    return {"X-Kvherd-Pull": f"{state(holder)['pull_address']} blocks={blocks}"}


def outcome(response: httpx.Response) -> dict[str, str]:
    name, *fields = response.headers["x-kvherd-pull-outcome"].split()
    return {"outcome": name, **dict(f.split("=") for f in fields)}


@pytest.mark.parametrize("sampling", [{}, {"temperature": 0.8, "seed": 11}], ids=["greedy", "seeded"])
def test_a_pulled_prefix_is_hit_and_the_output_is_identical(
    pair: list[AgentProcess], sampling: dict[str, Any]
) -> None:
    holder, puller = pair
    prompt = [sampling.get("seed", 0) % 250, *PROMPT]  # its own prefix: nothing cached yet
    expected = complete(holder, prompt, **sampling).json()
    assert expected["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    got = complete(puller, prompt, pull_header(holder), **sampling)
    pulled = outcome(got)
    assert pulled["outcome"] == "landed" and int(pulled["blocks"]) == 40, pulled
    body = got.json()
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 40 * BLOCK
    assert body["choices"][0]["text"] == expected["choices"][0]["text"]
    # Pulled once, then a local hit: a second pull finds nothing to pull.
    again = complete(puller, prompt, pull_header(holder), **sampling)
    assert outcome(again)["outcome"] == "nothing_to_pull"
    assert again.json()["choices"][0]["text"] == expected["choices"][0]["text"]
    metrics = httpx.get(f"{puller.url}/metrics").text
    assert 'kvherd_prefix_pulls_total{engine="0",model_name="tiny",outcome="landed"}' in metrics
    assert_clean(holder)
    assert_clean(puller)


def test_a_stalled_holder_costs_a_recompute(pair: list[AgentProcess]) -> None:
    holder, puller = pair
    prompt = [251, *PROMPT]
    expected = complete(holder, prompt).json()
    header = pull_header(holder)
    os.kill(holder.process.pid, signal.SIGSTOP)
    try:
        got = complete(puller, prompt, header)
    finally:
        os.kill(holder.process.pid, signal.SIGCONT)
    assert outcome(got)["outcome"] == "failed"
    body = got.json()
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert body["choices"][0]["text"] == expected["choices"][0]["text"]
    assert_clean(holder)
    assert_clean(puller)


def test_a_pull_from_a_dead_holder_costs_a_recompute(pair: list[AgentProcess]) -> None:
    _, puller = pair
    prompt = [252, *PROMPT]
    # Nothing listens there any more (a holder that died): refused at once.
    header = {"X-Kvherd-Pull": "tcp://127.0.0.1:9 blocks=40"}
    got = complete(puller, prompt, header)
    assert outcome(got)["outcome"] == "failed"
    assert got.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert_clean(puller)


@pytest.mark.parametrize(
    "value", ["tcp://127.0.0.1:1", "http://x:1 blocks=2", "tcp://h:1 blocks=-1", "nonsense"]
)
def test_a_malformed_pull_header_is_a_400(pair: list[AgentProcess], value: str) -> None:
    _, puller = pair
    response = httpx.post(
        f"{puller.url}/v1/completions",
        json={"prompt": PROMPT[:8], "max_tokens": 2},
        headers={"X-Kvherd-Pull": value},
    )
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "x-kvherd-pull"


def test_a_client_gone_mid_pull_leaves_nothing_reserved(pair: list[AgentProcess]) -> None:
    """The client gives up while the pull waits on a stalled holder: once the pull ends (its
    timeout), the puller frees what it reserved and took."""
    holder, puller = pair
    prompt = [253, *PROMPT]
    complete(holder, prompt)
    header = pull_header(holder)
    os.kill(holder.process.pid, signal.SIGSTOP)
    try:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(
                f"{puller.url}/v1/completions",
                json={"prompt": prompt, "max_tokens": 4},
                headers=header,
                timeout=0.3,
            )
    finally:
        os.kill(holder.process.pid, signal.SIGCONT)
    deadline = time.monotonic() + 10
    while state(puller)["block_owners"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert_clean(puller)
    assert_clean(holder)
