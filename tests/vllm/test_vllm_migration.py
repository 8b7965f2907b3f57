"""Live migration of a vLLM stream by ``kvherd serve`` (`scheduler.proxy.stream_cuts`).

A greedy stream runs on ``a`` (``b`` drained meanwhile); an operator's order (``POST
/admin/v1/migrate``) moves it to ``b``: the proxy cuts ``a``'s stream (vLLM aborts the request,
kvherd's connector keeps its blocks) and continues the very same stream on ``b``, whose connector
pulls every full block of prompt + tokens streamed from ``a``. The order answers ``committed``; the
client reads one unbroken stream whose tokens are exactly vLLM's own for the request (``b``
computing it alone). The pull is asserted by the connector's own outcome on ``b``'s ``/metrics``
(one peer load ``loaded``, at least the prompt's full blocks), not by a log line: greedy tokens
would match on a recompute too.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
from vllm_fleet import SERVED_MODEL, Prompts, VllmServer, poll_until

MAX_TOKENS = 400
LOADS = "vllm:kvherd_connector_loads_total"
BLOCKS = "vllm:kvherd_connector_load_blocks_total"


async def test_a_vllm_stream_migrates_with_its_kv(
    kvherd_fleet: Any, vllm_pair: tuple[VllmServer, VllmServer], prompts: Prompts
) -> None:
    a, b = vllm_pair
    options = {"a_options": {"pull_address": a.block_address}}
    prompt = prompts.make("migrated-by-the-proxy", blocks=3)
    body = {"model": SERVED_MODEL, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0}
    loaded_before = b.metric(LOADS, tier="peer", outcome="loaded")
    failed_before = b.metric(LOADS, tier="peer", outcome="failed")
    blocks_before = b.metric(BLOCKS, tier="peer")
    with kvherd_fleet("--migration-policy", "none", **options) as proxy:
        headers = {"Authorization": f"Bearer {proxy.admin_token}"}
        async with httpx.AsyncClient(timeout=120, trust_env=False) as client:
            own = await client.post(
                f"{b.url}/v1/completions",
                json={**body, "cache_salt": "own", "return_token_ids": True},
            )
            expected = own.json()["choices"][0]["token_ids"]

            async def drain(name: str, draining: bool) -> None:
                r = await client.post(
                    f"{proxy.admin_url}/admin/v1/instances/{name}/drain",
                    json={"draining": draining},
                    headers=headers,
                )
                assert r.status_code == 200, r.text

            events: list[dict[str, Any]] = []

            async def read() -> None:
                streamed = {**body, "stream": True, "return_token_ids": True}
                async with client.stream(
                    "POST",
                    f"{proxy.url}/v1/completions",
                    json=streamed,
                    headers={"X-Request-Id": "migrating-stream"},
                ) as response:
                    assert response.status_code == 200
                    async for line in response.aiter_lines():
                        if line.startswith("data: {"):
                            events.append(json.loads(line[6:]))

            await drain("b", True)
            reading = asyncio.create_task(read())
            while len(events) < 10:
                if reading.done():
                    await reading  # the reader's own failure, if it had one
                    raise AssertionError(f"the stream ended after {len(events)} events: {events}")
                await asyncio.sleep(0.01)
            await drain("b", False)
            order = await client.post(
                f"{proxy.admin_url}/admin/v1/migrate",
                json={"request_id": "migrating-stream", "to": "b"},
                headers=headers,
            )
            await reading
        assert order.status_code == 200, order.text
        assert order.json()["status"] == "committed", order.json()
        assert proxy.metric("kvherd_continuations_total", outcome="migrated") == 1
    # b's connector loaded the stream's blocks from a peer (its stats reach /metrics a step later).
    loaded = poll_until(lambda: b.metric(LOADS, tier="peer", outcome="loaded") > loaded_before)
    assert loaded, b.log()
    assert b.metric(LOADS, tier="peer", outcome="loaded") == loaded_before + 1, b.log()
    assert b.metric(LOADS, tier="peer", outcome="failed") == failed_before, b.log()
    assert b.metric(BLOCKS, tier="peer") - blocks_before >= prompts.full_blocks(prompt), b.log()
    tokens = [t for e in events for c in e["choices"] for t in c.get("token_ids") or ()]
    assert tokens == expected
    assert (
        "".join(c["text"] for e in events for c in e["choices"]) == own.json()["choices"][0]["text"]
    )
