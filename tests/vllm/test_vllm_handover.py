"""Hand-over between two real vLLM servers: a drained server's prefixes are pulled by the survivor.

A vLLM server cannot list its cache, so the proxy keeps the token ids of the prompts it routed to
vLLM (`scheduler.core.prompt_book`) and hands over what the leaver's KV events say it holds.
``a`` serves a conversation (two turns: one lineage) and an unrelated prompt while ``b`` is
drained; then ``a`` is drained and ``POST /admin/v1/instances/a/handover`` makes ``b``'s kvherd
connector pull every full block from ``a``'s block server. ``b`` then answers the three prompts
from its cache (``cached_tokens``: every full block), with ``a``'s greedy text.
"""

from __future__ import annotations

from typing import Any

import httpx
from vllm_fleet import (
    SERVED_MODEL,
    VLLM_BLOCK_SIZE,
    Prompts,
    VllmServer,
    indexed_blocks,
    poll_until,
)

LOADS = "vllm:kvherd_connector_loads_total"
BLOCKS = "vllm:kvherd_connector_load_blocks_total"


def test_a_drained_vllm_servers_prefixes_are_pulled_by_the_survivor(
    kvherd_fleet: Any, vllm_pair: tuple[VllmServer, VllmServer], prompts: Prompts
) -> None:
    a, b = vllm_pair
    first = prompts.make("handover-turn-1", blocks=3)
    turn_2 = first + " and then " + prompts.make("handover-turn-2", blocks=2)
    other = prompts.make("handover-other", blocks=3)
    asked = [first, turn_2, other]
    options = {"a_options": {"pull_address": a.block_address},
               "b_options": {"pull_address": b.block_address}}  # fmt: skip
    with (
        kvherd_fleet("--migration-policy", "none", "--load-interval", "0.05", **options) as proxy,
        httpx.Client(timeout=120, trust_env=False) as client,
    ):
        headers = {"Authorization": f"Bearer {proxy.admin_token}"}

        def drain(name: str, draining: bool) -> None:
            r = client.post(
                f"{proxy.admin_url}/admin/v1/instances/{name}/drain",
                json={"draining": draining},
                headers=headers,
            )
            assert r.status_code == 200, r.text

        def complete(prompt: str) -> httpx.Response:
            body = {"model": SERVED_MODEL, "prompt": prompt, "max_tokens": 8, "temperature": 0}
            r = client.post(f"{proxy.url}/v1/completions", json=body)
            assert r.status_code == 200, r.text
            return r

        held_before = indexed_blocks(proxy, "a") or 0
        drain("b", True)
        expected = {p: complete(p).json()["choices"][0]["text"] for p in asked}
        blocks = sum(prompts.full_blocks(p) for p in (turn_2, other))  # turn 1 is turn 2's head
        assert poll_until(lambda: (indexed_blocks(proxy, "a") or 0) >= held_before + blocks, 30)
        drain("b", False)
        drain("a", True)
        loaded_before = b.metric(BLOCKS, tier="peer")
        r = client.post(f"{proxy.admin_url}/admin/v1/instances/a/handover", headers=headers)
        assert r.status_code == 200, r.text
        result = r.json()
        assert result["error"] is None, result
        assert result["pulled_prefixes"] == 2, result  # one per lineage: turn 2 covers turn 1
        assert result["pulled_blocks"] == blocks and result["failed_blocks"] == 0, result
        assert b.metric(BLOCKS, tier="peer") == loaded_before + blocks, b.log()
        assert proxy.metric("kvherd_handover_blocks_total", outcome="pulled") == blocks
        for p in asked:  # a is drained: b answers, from the blocks it pulled
            got = complete(p)
            assert got.headers["x-kvherd-instance"] == "b"
            answer = got.json()
            assert answer["choices"][0]["text"] == expected[p]
            full = prompts.full_blocks(p) * VLLM_BLOCK_SIZE
            assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == full, p
