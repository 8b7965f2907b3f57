"""Fuzzed bodies against a real agent and a real ``kvherd serve`` in front of it.

Every answer must be 2xx, or 4xx with the OpenAI error object; never a 5xx, never a hang (each
request is bounded by the client's timeout). Afterwards the agent holds no request and no KV
block. Bodies mix well-formed requests with wrong types, out-of-range numbers, token ids past the
vocabulary and past 2**32, lone UTF-16 surrogates, odd content types and bytes that are not JSON.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from agent_process import AgentProcess, agent_process, free_port
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

pytestmark = pytest.mark.timeout(300)

FLEET = "fuzz-fleet-token"
ADMIN = "fuzz-admin-token"
AUTH = {"Authorization": f"Bearer {FLEET}"}
EXAMPLES = int(os.environ.get("KVHERD_FUZZ_EXAMPLES", "300"))


@dataclass
class Fleet:
    agent: AgentProcess
    proxy_url: str


@contextlib.contextmanager
def kvherd_serve(agent: AgentProcess) -> Iterator[str]:
    port, admin_port = free_port(), free_port()
    instance = f"{agent.url},kv_events={agent.kv_events_endpoint},replay={agent.replay_endpoint}"
    cmd = [sys.executable, "-m", "kvherd", "serve", "--port", str(port), "--admin-port",
           str(admin_port), "--instance", instance, "--log-level", "warning",
           "--migration-policy", "none"]  # fmt: skip
    env = {**os.environ, "KVHERD_ADMIN_TOKEN": ADMIN, "KVHERD_FLEET_TOKEN": FLEET}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            assert time.monotonic() < deadline, "kvherd serve did not become healthy"
            time.sleep(0.05)  # polling while the process starts
        yield url
    finally:
        proc.terminate()
        proc.wait(30)


@pytest.fixture(scope="module")
def fleet() -> Iterator[Fleet]:
    env = {"KVHERD_FLEET_TOKEN": FLEET}
    with agent_process(kv_events=True, env=env) as agent, kvherd_serve(agent) as url:
        yield Fleet(agent, url)


# -- strategies ----------------------------------------------------------------------------------
SURROGATES = st.sampled_from(["\ud800", "\udfff", "a\udc00b", "\ud83d"])
TEXT = st.one_of(
    st.text(max_size=40),
    st.tuples(st.text(max_size=10), SURROGATES, st.text(max_size=10)).map("".join),
)
TOKEN_ID = st.one_of(
    st.integers(0, 300),
    st.sampled_from([-1, 2**31, 2**32 - 1, 2**32, 2**40, 2**63, 2**64 + 5]),
)
SCALAR = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**65), 2**65), st.floats(allow_nan=False), TEXT
)
MAX_TOKENS = st.one_of(st.integers(-2, 4), st.sampled_from([2**31, 2**63, "3", 1.5, None]))
PROMPT = st.one_of(
    TEXT,
    st.lists(TOKEN_ID, min_size=0, max_size=40),
    st.lists(TEXT, min_size=0, max_size=3),
    st.lists(st.lists(TOKEN_ID, max_size=20), max_size=2),
    SCALAR,
)
CONTENT = st.one_of(
    TEXT,
    st.lists(
        st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url"]), "text": TEXT}),
        max_size=2,
    ),
    SCALAR,
)
MESSAGE = st.one_of(
    st.fixed_dictionaries(
        {
            "role": st.sampled_from(["system", "user", "assistant", "tool", "wizard"]),
            "content": CONTENT,
        }
    ),
    SCALAR,
)
COMMON: dict[str, Any] = {
    "max_tokens": MAX_TOKENS,
    "temperature": st.one_of(st.floats(-1, 3), SCALAR),
    "top_p": st.one_of(st.floats(0, 1), SCALAR),
    "top_k": st.one_of(st.integers(-2, 50), SCALAR),
    "seed": st.one_of(st.integers(-(2**64), 2**64), SCALAR),
    "stop": st.one_of(TEXT, st.lists(TEXT, max_size=3), SCALAR),
    "stop_token_ids": st.one_of(st.lists(TOKEN_ID, max_size=3), SCALAR),
    "stream": st.one_of(st.booleans(), SCALAR),
    "stream_options": st.one_of(st.fixed_dictionaries({"include_usage": st.booleans()}), SCALAR),
    "n": st.one_of(st.integers(-1, 3), SCALAR),
    "cache_salt": st.one_of(TEXT, SCALAR),
    "priority": st.one_of(st.integers(-(2**40), 2**40), SCALAR),
    "return_token_ids": st.one_of(st.booleans(), SCALAR),
    "logit_bias": st.one_of(st.dictionaries(TEXT, st.integers(), max_size=2), SCALAR),
    "model": st.one_of(st.just("tiny"), TEXT),
}
COMPLETION = st.fixed_dictionaries({"prompt": PROMPT}, optional=COMMON)
CHAT = st.fixed_dictionaries(
    {"messages": st.one_of(st.lists(MESSAGE, max_size=3), SCALAR)}, optional=COMMON
)


@st.composite
def requests(draw: st.DrawFn) -> tuple[str, str, bytes, dict[str, str]]:
    """(method, path, body, headers): a fuzzed body for one of the OpenAI routes."""
    path = draw(st.sampled_from(["/v1/completions", "/v1/chat/completions", "/v1/nowhere"]))
    body = draw(CHAT if path.endswith("chat/completions") else COMPLETION)
    raw = json.dumps(body).encode()  # lone surrogates become \\udXXX escapes, as JSON allows
    raw = draw(
        st.one_of(
            st.just(raw),
            st.just(raw[: len(raw) // 2]),  # truncated JSON
            st.binary(max_size=30),
            st.sampled_from([b"", b"[]", b"null", b'"x"', b"\xff\xfe{}"]),
        )
    )
    content_type = draw(
        st.sampled_from(
            [
                "application/json",
                "application/json; charset=utf-8",
                "text/plain",
                "application/x-www-form-urlencoded",
                "application/vnd.kvherd+json",
                None,
            ]
        )
    )
    headers = {} if content_type is None else {"Content-Type": content_type}
    if draw(st.booleans()):
        headers["X-Request-Id"] = draw(
            st.sampled_from(["fuzz-1", "fuzz-1", "has space", "x" * 300])
        )
    method = draw(st.sampled_from(["POST", "POST", "POST", "GET", "PUT"]))
    return method, path, raw, headers


def check_answer(response: httpx.Response, where: str) -> None:
    status = response.status_code
    assert status < 500, (where, status, response.text[:300])
    if status >= 400:
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}, (where, response.text)
        assert isinstance(error["message"], str) and error["message"], (where, response.text)
    elif response.headers.get("content-type", "").startswith("text/event-stream"):
        for line in response.text.splitlines():
            if line.startswith("data: ") and line != "data: [DONE]":
                frame = json.loads(line[6:])
                assert "error" not in frame, (where, frame)


@settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    database=None,
)
@given(request=requests())
# The inputs that answered 500 before: a lone surrogate (agent), a token id past 2**32 (proxy), a
# text/plain body the proxy took as JSON, and an unknown route.
@example(request=("POST", "/v1/completions", b'{"prompt": "a\\ud800", "max_tokens": 2}', {}))
@example(
    request=(
        "POST",
        "/v1/chat/completions",
        b'{"messages": [{"role": "user", "content": "\\udfff"}], "max_tokens": 2}',
        {"Content-Type": "application/json"},
    )
)
@example(request=("POST", "/v1/completions", b'{"prompt": [1, 4294967296]}', {}))
@example(request=("POST", "/v1/completions", b'{"prompt": "x"}', {"Content-Type": "text/plain"}))
@example(request=("GET", "/v1/nowhere", b"", {}))
def test_fuzzed_bodies_get_2xx_or_4xx_error_objects(
    fleet: Fleet, request: tuple[str, str, bytes, dict[str, str]]
) -> None:
    method, path, body, headers = request
    with httpx.Client(timeout=60) as client:
        for base in (fleet.agent.url, fleet.proxy_url):
            response = client.request(method, base + path, content=body, headers=headers)
            check_answer(response, f"{base}: {method} {path} {body[:200]!r} {headers}")


def test_the_agent_holds_nothing_after_the_fuzzing(fleet: Fleet) -> None:
    """Runs after the fuzz test (file order): every request ended and freed its blocks."""
    url = f"{fleet.agent.url}/kvherd/v1/state?check_integrity=true"
    deadline = time.monotonic() + 30
    while True:
        state = httpx.get(url, headers=AUTH, timeout=10).json()
        assert state["integrity"] == "ok", state["integrity"]
        idle = state["num_running"] == 0 and state["num_waiting"] == 0
        if idle and state["block_owners"] == []:
            break
        assert time.monotonic() < deadline, state["block_owners"]
        time.sleep(0.05)  # requests a client left may still be finishing their last step
    for path in ("/v1/nowhere", "/kvherd/v2/state", "/"):
        response = httpx.get(fleet.proxy_url + path, timeout=10)
        assert response.status_code == 404 and set(response.json()["error"]) == {
            "message", "type", "param", "code"
        }  # fmt: skip
