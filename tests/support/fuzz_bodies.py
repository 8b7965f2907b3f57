"""Fuzzed request bodies for the OpenAI routes, and what an answer to one must look like.

Shared by the chaos suite (``tests/chaos/test_fuzz.py``, through hypothesis) and
``bench/chaos_bench.py``.

Contract:
- `requests(path)` draws ``(method, path, body, headers)``: well-formed requests mixed with wrong
  types, out-of-range numbers, token ids past the vocabulary and past 2**32, lone UTF-16
  surrogates, truncated JSON, bytes that are not JSON, odd content types, reused and malformed
  request ids, and methods the route does not take. `path` fixes the route (`ROUTES`); None picks
  one of them or an unknown path.
- `check_answer` asserts an answer is 2xx, or 4xx with the OpenAI error object (never a 5xx), and
  that a 200 stream carries no error frame.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
from hypothesis import strategies as st

ROUTES = ("/v1/completions", "/v1/chat/completions")
UNKNOWN = "/v1/nowhere"

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
def requests(draw: st.DrawFn, path: str | None = None) -> tuple[str, str, bytes, dict[str, str]]:
    """(method, path, body, headers): a fuzzed body for `path` (None: any route or none)."""
    if path is None:
        path = draw(st.sampled_from([*ROUTES, UNKNOWN]))
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
