"""Fuzzed bodies against a real agent and a real ``kvherd serve`` in front of it.

At least ``KVHERD_FUZZ_EXAMPLES`` (default 1,000) fuzzed bodies per OpenAI route, each sent to the
agent and to the proxy (`fuzz_bodies.requests`), plus bodies to an unknown path. Every answer must
be 2xx, or 4xx with the OpenAI error object; never a 5xx, never a hang (each request is bounded by
the client's timeout). Afterwards the agent holds no request and no KV block.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest
from agent_process import AgentProcess, agent_process
from chaos_scenarios import leaked_blocks
from fuzz_bodies import ROUTES, UNKNOWN, check_answer, requests
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from serve_process import serve_process

pytestmark = pytest.mark.timeout(900)

FLEET = "fuzz-fleet-token"
AUTH = {"Authorization": f"Bearer {FLEET}"}
EXAMPLES = int(os.environ.get("KVHERD_FUZZ_EXAMPLES", "1000"))
FUZZ = settings(
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    database=None,
    max_examples=EXAMPLES,
)
SENT: Counter[tuple[str, str]] = Counter()  # (agent|proxy, path) -> bodies answered


@dataclass
class Fleet:
    agent: AgentProcess
    proxy_url: str
    client: httpx.Client


@pytest.fixture(scope="module")
def fleet() -> Iterator[Fleet]:
    env = {"KVHERD_FLEET_TOKEN": FLEET}
    with (
        agent_process(kv_events=True, env=env) as agent,
        serve_process([agent.instance_spec()], "--migration-policy", "none", env=env) as served,
        httpx.Client(timeout=60) as client,
    ):
        yield Fleet(agent, served.url, client)


def send_to_both(fleet: Fleet, request: tuple[str, str, bytes, dict[str, str]]) -> None:
    method, path, body, headers = request
    for name, base in (("agent", fleet.agent.url), ("proxy", fleet.proxy_url)):
        response = fleet.client.request(method, base + path, content=body, headers=headers)
        check_answer(response, f"{name}: {method} {path} {body[:200]!r} {headers}")
        SENT[name, path] += 1


# The inputs that answered 500 before: a lone surrogate (agent; in a prompt, a message, a content
# part), a token id past 2**32 (proxy), a text/plain body the proxy took as JSON, an unknown route.
ONCE_5XX = [
    ("POST", "/v1/completions", b'{"prompt": "a\\ud800", "max_tokens": 2}', {}),
    (
        "POST",
        "/v1/chat/completions",
        b'{"messages": [{"role": "user", "content": "\\udfff"}], "max_tokens": 2}',
        {"Content-Type": "application/json"},
    ),
    (  # in a content part (the fuzzer found it in CI, 2026-12-01)
        "POST",
        "/v1/chat/completions",
        b'{"messages": [{"role": "system", "content": [{"type": "text", "text": "\\ud800"}]}]}',
        {"Content-Type": "application/json"},
    ),
    (  # in a message's name, which the template also reads
        "POST",
        "/v1/chat/completions",
        b'{"messages": [{"role": "user", "content": "hi", "name": "\\udc00"}], "max_tokens": 2}',
        {"Content-Type": "application/json"},
    ),
    ("POST", "/v1/completions", b'{"prompt": [1, 4294967296]}', {}),
    ("POST", "/v1/completions", b'{"prompt": "x"}', {"Content-Type": "text/plain"}),
    ("GET", "/v1/nowhere", b"", {}),
]


@pytest.mark.parametrize("request_", ONCE_5XX, ids=range(len(ONCE_5XX)))
def test_bodies_that_once_answered_5xx(
    fleet: Fleet, request_: tuple[str, str, bytes, dict[str, str]]
) -> None:
    send_to_both(fleet, request_)


@pytest.mark.parametrize("path", ROUTES)
@FUZZ
@given(data=st.data())
def test_fuzzed_bodies_get_2xx_or_4xx_error_objects(
    fleet: Fleet, path: str, data: st.DataObject
) -> None:
    send_to_both(fleet, data.draw(requests(path)))


@settings(FUZZ, max_examples=max(1, EXAMPLES // 10))
@given(request=requests(UNKNOWN))
def test_fuzzed_bodies_to_an_unknown_path_get_404_error_objects(
    fleet: Fleet, request: tuple[str, str, bytes, dict[str, str]]
) -> None:
    send_to_both(fleet, request)


async def test_the_agent_holds_nothing_after_the_fuzzing(fleet: Fleet) -> None:
    """Runs after the fuzz tests (file order): every body was sent, every request ended and freed
    its blocks."""
    print(f"\nfuzzed bodies answered: {dict(SENT)}")
    for name in ("agent", "proxy"):
        for path in ROUTES:
            assert SENT[name, path] >= EXAMPLES, SENT
    assert await leaked_blocks([fleet.agent], headers=AUTH) == 0
    for path in ("/v1/nowhere", "/kvherd/v2/state", "/"):
        response = fleet.client.get(fleet.proxy_url + path)
        assert response.status_code == 404 and set(response.json()["error"]) == {
            "message", "type", "param", "code"
        }  # fmt: skip
