"""The cache outlives a resize: prefixes move between real agents as the fleet shrinks and grows.

Scale-in (hand-over):
Two real agents register with a real proxy (``--scheduler``). Every prompt is served by ``first``
(``second`` drained meanwhile), so only ``first`` caches them. ``first`` gets SIGTERM: it drains,
then asks the proxy for the hand-over (``POST /admin/v1/instances/{id}/handover``), which has
``second`` pull the prompts' blocks from ``first``'s block server; then ``first`` exits. The same
prompts sent again are served by ``second`` from its prefix cache: its own counters show the hits
(before the hand-over it held none of those blocks, so without it every prompt token would be
recomputed), and the greedy text is the one ``first`` gave.

Scale-out (warm-up): a new agent joining a fleet whose agent caches prompts is held out of
routing while it pulls those prefixes, then let in; it serves them from its cache at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools

import httpx
import pytest
from agent_process import AgentProcess, agent_process
from test_migration_proxy import ADMIN
from test_proxy import TOKEN, running_proxy, wait_for
from vllm_fleet import metric_sum

pytestmark = pytest.mark.timeout(240)

BLOCK = 16
PROMPTS = [f"Hand-over prompt {i}: " + "the cache should outlive the instance. " * 4 for i in range(6)]


async def _completion(client: httpx.AsyncClient, base: str, prompt: str) -> str:
    body = {"prompt": prompt, "max_tokens": 8, "temperature": 0.0}
    response = await client.post(f"{base}/v1/completions", json=body)
    assert response.status_code == 200, response.text
    return str(response.json()["choices"][0]["text"])


def _join(stack: contextlib.ExitStack, admin_url: str) -> AgentProcess:
    """Start an agent that registers with the proxy at `admin_url`, stopped with `stack`."""
    args = ("--block-size", str(BLOCK), "--scheduler", admin_url, "--heartbeat-interval", "0.2")
    started = agent_process(*args, kv_events=True, env={"KVHERD_ADMIN_TOKEN": TOKEN})
    return stack.enter_context(started)


async def _counters(client: httpx.AsyncClient, agent: AgentProcess) -> tuple[float, float]:
    text = (await client.get(f"{agent.url}/metrics")).text
    return (
        metric_sum(text, "vllm:prefix_cache_hits_total"),
        metric_sum(text, "vllm:prefix_cache_queries_total"),
    )


async def test_a_leaving_agent_hands_its_prefixes_to_the_survivor() -> None:
    async with running_proxy([], "--load-interval", "0.05") as proxy:
        with contextlib.ExitStack() as stack:
            join = functools.partial(_join, stack, proxy.admin_url)

            pair = await asyncio.gather(asyncio.to_thread(join), asyncio.to_thread(join))
            fleet = proxy.fleet
            await wait_for(lambda: len(fleet.instances) == 2, timeout=60, interval=0.02)
            first, second = list(fleet.instances)
            by_url = {agent.url: agent for agent in pair}
            leaving, staying = by_url[fleet.instances[first].url], by_url[fleet.instances[second].url]
            drain = f"{proxy.admin_url}/admin/v1/instances/{{}}/drain"
            async with httpx.AsyncClient(timeout=60) as client:
                await client.post(drain.format(second), json={"draining": True}, headers=ADMIN)
                expected = [await _completion(client, proxy.url, p) for p in PROMPTS]
                await client.post(drain.format(second), json={"draining": False}, headers=ADMIN)
                index = fleet.cluster.prefix_index
                await wait_for(lambda: index.num_blocks(first) > 0, timeout=20)
                held = index.blocks(first)
                assert not held & index.blocks(second), "the survivor holds none of them yet"

                # The hand-over answers 409 while the instance still serves.
                url = f"{proxy.admin_url}/admin/v1/instances/{first}/handover"
                refused = await client.post(url, headers=ADMIN)
                assert refused.status_code == 409, refused.text

                assert await asyncio.to_thread(leaving.terminate, 120.0) == 0, leaving.log()
                assert "handed over" in leaving.log(), leaving.log()
                await wait_for(lambda: list(fleet.instances) == [second], timeout=30)
                metrics = (await client.get(f"{proxy.url}/metrics")).text
                pulled = metric_sum(metrics, "kvherd_handover_blocks_total", outcome="pulled")
                assert pulled == len(held), (pulled, len(held), leaving.log())
                assert metric_sum(metrics, "kvherd_handover_blocks_total", outcome="failed") == 0

                hits_before, queries_before = await _counters(client, staying)
                again = [await _completion(client, proxy.url, p) for p in PROMPTS]
                hits, queries = await _counters(client, staying)
                assert again == expected
                # Every full block of every prompt is a hit (the last token's block is computed).
                full_blocks = sum(
                    (len(t) - 1) // BLOCK for t in await _prompt_tokens(client, staying)
                )
                assert hits - hits_before == full_blocks * BLOCK, (hits - hits_before, full_blocks)
                assert queries - queries_before > hits - hits_before


async def _prompt_tokens(client: httpx.AsyncClient, agent: AgentProcess) -> list[list[int]]:
    tokenized = []
    for prompt in PROMPTS:
        r = await client.post(f"{agent.url}/tokenize", json={"prompt": prompt})
        tokenized.append(r.json()["tokens"])
    return tokenized


async def test_a_new_agent_warms_up_from_its_peer_before_it_takes_traffic() -> None:
    async with running_proxy([], "--load-interval", "0.05") as proxy:
        with contextlib.ExitStack() as stack:
            join = functools.partial(_join, stack, proxy.admin_url)

            old = await asyncio.to_thread(join)
            fleet = proxy.fleet
            await wait_for(lambda: len(fleet.instances) == 1, timeout=60, interval=0.02)
            (first,) = fleet.instances
            async with httpx.AsyncClient(timeout=60) as client:
                expected = [await _completion(client, proxy.url, p) for p in PROMPTS]
                index = fleet.cluster.prefix_index
                await wait_for(lambda: index.num_blocks(first) > 0, timeout=20)
                held = index.blocks(first)

                new = await asyncio.to_thread(join)
                await wait_for(lambda: len(fleet.instances) == 2, timeout=60, interval=0.02)
                (second,) = set(fleet.instances) - {first}
                # Held out of routing while it warms up, then let in holding the peer's blocks.
                await wait_for(lambda: not fleet.cluster.get(second).draining, timeout=60)
                metrics = (await client.get(f"{proxy.url}/metrics")).text
                pulled = metric_sum(
                    metrics, "kvherd_handover_blocks_total", cause="scale_out", outcome="pulled"
                )
                assert pulled == len(held), (pulled, len(held), new.log())
                await wait_for(lambda: held <= index.blocks(second), timeout=20)

                drain = f"{proxy.admin_url}/admin/v1/instances/{first}/drain"
                await client.post(drain, json={"draining": True}, headers=ADMIN)
                hits_before, _ = await _counters(client, new)
                again = [await _completion(client, proxy.url, p) for p in PROMPTS]
                hits, _ = await _counters(client, new)
                assert again == expected
                full_blocks = sum((len(t) - 1) // BLOCK for t in await _prompt_tokens(client, new))
                assert hits - hits_before == full_blocks * BLOCK
                assert old.process.poll() is None
