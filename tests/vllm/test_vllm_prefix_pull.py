"""``kvherd serve --prefix-pull`` in front of two real vLLM servers running kvherd's connector.

``a`` computes a long prompt (its KV events tell the proxy's index); the same prompt again goes,
by round robin, to ``b``, and the pull rule finds pulling ``a``'s blocks no slower than routing to
``a`` and faster than recomputing at ``b``: the proxy asks
``b``'s connector for them in the body (``kv_transfer_params.kvherd_pull``, from ``a``'s block
server given as ``--instance ...,pull_address=``). ``b`` loads every full block
(``cached_tokens``) and its greedy output is ``a``'s.
"""

from __future__ import annotations

import asyncio
import json
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

# Round robin makes b the policy's pick after a. A pull priced at nothing (no bytes, no set-up)
# ties with routing to the holder, and the rule's ties go to the pull: the decision does not
# depend on how busy a's load reports say it is at that moment (a tiny model on vLLM finishes
# even a 3,400-token generation in about a second, before its gauge shows it).
FLAGS = (
    "--policy", "round_robin", "--prefix-pull", "--pull-min-tokens", "256",
    "--pull-kv-bytes-per-token", "0", "--pull-latency-ms", "0", "--load-interval", "0.05",
    "--migration-policy", "none",
)  # fmt: skip


async def test_a_long_prefix_is_pulled_into_the_idle_vllm(
    kvherd_fleet: Any, vllm_pair: tuple[VllmServer, VllmServer], prompts: Prompts
) -> None:
    a = vllm_pair[0]
    prompt = prompts.make("prefix-pull-through-kvherd", blocks=12)
    blocks = prompts.full_blocks(prompt)
    with kvherd_fleet(*FLAGS, a_options={"pull_address": a.block_address}) as proxy:
        headers = {"Authorization": f"Bearer {proxy.admin_token}"}
        async with httpx.AsyncClient(timeout=120, trust_env=False) as client:

            async def drain(name: str, draining: bool) -> None:
                r = await client.post(
                    f"{proxy.admin_url}/admin/v1/instances/{name}/drain",
                    json={"draining": draining},
                    headers=headers,
                )
                assert r.status_code == 200, r.text

            async def complete(body: dict[str, Any]) -> httpx.Response:
                r = await client.post(f"{proxy.url}/v1/completions", json=body)
                assert r.status_code == 200, r.text
                return r

            greedy = {"model": SERVED_MODEL, "prompt": prompt, "max_tokens": 8, "temperature": 0}
            await drain("b", True)  # the prompt goes to a
            expected = (await complete(greedy)).json()
            held = await asyncio.to_thread(
                poll_until, lambda: (indexed_blocks(proxy, "a") or 0) >= blocks, 30
            )
            assert held, "the proxy's index never saw a hold the prompt"
            await drain("b", False)
            got = await complete(greedy)  # round robin: b, after a
            assert got.headers["x-kvherd-instance"] == "b"
            assert proxy.metric("kvherd_prefix_pull_decisions_total", action="pull") == 1
    answer = got.json()
    assert answer["choices"][0]["text"] == expected["choices"][0]["text"]
    assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == blocks * VLLM_BLOCK_SIZE
    assert answer["kv_transfer_params"]["kvherd_pull"]["outcome"] == "loaded"


async def test_pd_between_two_vllm_servers_through_their_connectors(
    kvherd_fleet: Any, vllm_pair: tuple[VllmServer, VllmServer], prompts: Prompts
) -> None:
    """``a`` as the prefill instance, ``b`` as the decode one: the proxy has ``a`` compute the
    prompt for one token, then sends the request to ``b``, which pulls every full block from
    ``a`` and decodes; streamed and not, the greedy output is vLLM's own (``b`` computing it
    alone, with a salt of its own)."""
    a, b = vllm_pair
    roles = {"a_options": {"role": "prefill", "pull_address": a.block_address}}
    with kvherd_fleet(*FLAGS, **roles, b_options={"role": "decode"}) as proxy:
        async with httpx.AsyncClient(timeout=120, trust_env=False) as client:
            for streamed in (False, True):
                prompt = prompts.make(f"pd-through-connectors-{streamed}", blocks=6)
                body = {"model": SERVED_MODEL, "prompt": prompt, "max_tokens": 12, "temperature": 0}
                own = await client.post(
                    f"{b.url}/v1/completions", json={**body, "cache_salt": f"own-{streamed}"}
                )
                expected = own.json()["choices"][0]["text"]
                if not streamed:
                    got = await client.post(f"{proxy.url}/v1/completions", json=body)
                    assert got.status_code == 200, got.text
                    answer = got.json()
                    assert answer["choices"][0]["text"] == expected
                    assert answer["kv_transfer_params"]["kvherd_pull"]["outcome"] == "loaded"
                    full = prompts.full_blocks(prompt) * VLLM_BLOCK_SIZE
                    assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] >= full
                else:
                    text = []
                    async with client.stream(
                        "POST", f"{proxy.url}/v1/completions", json={**body, "stream": True}
                    ) as got:
                        assert got.status_code == 200
                        async for line in got.aiter_lines():
                            if line.startswith("data: {"):
                                text.append(json.loads(line[6:])["choices"][0]["text"])
                    assert "".join(text) == expected
                assert got.headers["x-kvherd-instance"] == "b"
        assert proxy.metric("kvherd_pd_handoffs_total", outcome="ok") == 2
