"""Per-tenant rate limits through a real ``kvherd serve`` and a real agent, read by the `openai`
client: concurrent requests past a tenant's rpm or tpm get exactly the 429s the buckets owe
(``rate_limit_error``, ``Retry-After``, the ``x-ratelimit-*`` headers), the admitted ones carry
the headers too, the real output count corrects the reservation, and the admin API shows and
changes the limits at run time."""

from __future__ import annotations

import asyncio
import time

import httpx
import openai
import pytest
from agent_process import agent_process
from serve_process import serve_process

from scheduler.core.rate_limit import DEFAULT_OUTPUT_RESERVE

pytestmark = pytest.mark.timeout(120)

PROMPT = list(range(1, 41))  # 40 prompt tokens
MAX_TOKENS = 8
COST = len(PROMPT) + MAX_TOKENS


def _client(served_url: str, key: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=served_url + "/v1", api_key=key, max_retries=0)


async def _complete(client: openai.AsyncOpenAI, i: int, **extra: object) -> tuple[int, dict]:
    """(status, headers) of one completion; a 429 is read off the client's RateLimitError."""
    try:
        raw = await client.completions.with_raw_response.create(
            model="tiny", prompt=[i % 200 + 1, *PROMPT[1:]], max_tokens=MAX_TOKENS,
            extra_body={"ignore_eos": True, **extra},
        )  # fmt: skip
    except openai.RateLimitError as exc:
        error = exc.body if isinstance(exc.body, dict) else {}
        headers = dict(exc.response.headers)
        headers["code"] = error.get("code")
        headers["type"] = error.get("type")
        return 429, headers
    raw.parse()
    return raw.status_code, dict(raw.headers)


async def _tenants(served: object) -> dict[str, dict]:
    async with httpx.AsyncClient() as http:
        got = await http.get(
            served.admin_url + "/admin/v1/tenants",  # type: ignore[attr-defined]
            headers=served.admin_headers,  # type: ignore[attr-defined]
        )
    assert got.status_code == 200
    return {t["tenant"]: t for t in got.json()["data"]}


async def test_concurrent_requests_past_the_limits_get_exactly_the_429s_owed() -> None:
    tpm = 3 * COST + COST // 2  # three requests' worth and a half
    with (
        agent_process("--max-num-seqs", "16") as agent,
        serve_process(
            [agent.instance_spec()],
            "--api-key", "req-key=req rpm=4",
            "--api-key", f"tok-key=tok tpm={tpm}",
            "--api-key", "free-key=free",
        ) as served,
    ):  # fmt: skip
        by_requests = await asyncio.gather(
            *(_complete(_client(served.url, "req-key"), i) for i in range(10))
        )
        ok = [h for s, h in by_requests if s == 200]
        refused = [h for s, h in by_requests if s == 429]
        assert len(ok) == 4 and len(refused) == 6, [s for s, _ in by_requests]
        assert sorted(h["x-ratelimit-remaining-requests"] for h in ok) == ["0", "1", "2", "3"]
        for h in refused:
            assert (h["type"], h["code"]) == ("rate_limit_error", "rate_limit_requests")
            assert 1 <= int(h["retry-after"]) <= 15  # one request back in 60/4 s
            assert h["x-ratelimit-limit-requests"] == "4"
            assert h["x-ratelimit-remaining-requests"] == "0"
            assert h["x-ratelimit-reset-requests"].endswith("s")
            assert "x-ratelimit-limit-tokens" not in h  # no tpm for this tenant

        by_tokens = await asyncio.gather(
            *(_complete(_client(served.url, "tok-key"), i) for i in range(8))
        )
        statuses = sorted(s for s, _ in by_tokens)
        assert statuses == [200] * 3 + [429] * 5, statuses
        for status, h in by_tokens:
            assert h["x-ratelimit-limit-tokens"] == str(tpm)
            if status == 429:
                assert h["code"] == "rate_limit_tokens" and int(h["retry-after"]) >= 1

        # The real count settles the reservation: a request naming no max_tokens reserves
        # DEFAULT_OUTPUT_RESERVE and the agent stops it at its default 16; the difference comes
        # back when it ends (read off the JSON's usage, or counted off the stream).
        async with httpx.AsyncClient() as http:
            put = await http.put(
                served.admin_url + "/admin/v1/tenants/tok/limits",
                headers=served.admin_headers, json={"tpm": 6000},
            )  # fmt: skip
        assert put.status_code == 200 and put.json()["tpm"] == 6000
        client = _client(served.url, "tok-key")
        refund = DEFAULT_OUTPUT_RESERVE - 16
        for stream in (False, True):
            start = time.monotonic()
            raw = await client.completions.with_raw_response.create(
                model="tiny", prompt=PROMPT, stream=stream, extra_body={"ignore_eos": True}
            )
            if stream:
                assert len([c async for c in raw.parse()]) >= 16  # type: ignore[union-attr]
            else:
                assert raw.parse().usage.completion_tokens == 16  # type: ignore[union-attr]
            held = int(raw.headers["x-ratelimit-remaining-tokens"])  # after its reservation
            after = (await _tenants(served))["tok"]["remaining"]["tokens"]["remaining"]
            refilled = (time.monotonic() - start) * 6000 / 60
            assert refund <= after - held <= refund + refilled + 1, (stream, held, after)

        # Run-time changes: lift req's limit; bad values and unknown tenants are 4xx.
        async with httpx.AsyncClient() as http:
            admin = served.admin_url + "/admin/v1/tenants"
            assert (await http.get(admin)).status_code == 401
            for body in ({"rpm": 0}, {"rpm": "10"}, {"tpm": 1.5}, [1]):
                bad = await http.put(f"{admin}/req/limits", headers=served.admin_headers, json=body)
                assert bad.status_code == 400, body
                assert bad.json()["error"]["type"] == "invalid_request_error"
            missing = await http.put(
                f"{admin}/nobody/limits", headers=served.admin_headers, json={"rpm": 1}
            )
            assert missing.status_code == 404
            lifted = await http.post(
                f"{admin}/req/limits", headers=served.admin_headers, json={"rpm": None}
            )
            assert lifted.json()["rpm"] is None
        status, headers = await _complete(_client(served.url, "req-key"), 99)
        assert status == 200 and "x-ratelimit-limit-requests" not in headers
        status, headers = await _complete(_client(served.url, "free-key"), 98)
        assert status == 200 and not any(h.startswith("x-ratelimit") for h in headers)
        listed = await _tenants(served)
        assert set(listed) == {"req", "tok", "free"}
        assert (listed["free"]["rpm"], listed["free"]["tpm"]) == (None, None)
