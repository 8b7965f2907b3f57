"""Prefix pulls decided by a real ``kvherd serve --prefix-pull`` between two real agents.

Agent A computes a long prompt; the proxy's index learns it from A's KV events. A is then
kept busy (two long generations, pinned there by draining B meanwhile), so the policy
(least requests) prefers idle B for the same prompt again. The pull rule (`scheduler.core.
prefix_pull`) then judges pulling A's blocks to B faster than recomputing at B or queueing at A:
B pulls them before its prefill, the request hits them, and its output is exactly A's. The
proxy counts the decision and the agent's outcome; neither agent leaks a block.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

import httpx
import pytest
from agent_process import agent_processes
from serve_process import serve_process

from kvherd.fleet_token import FLEET_TOKEN_ENV, auth_headers

pytestmark = pytest.mark.timeout(240)

BLOCK = 16
PROMPT = [(i * 11 + 5) % 250 for i in range(40 * BLOCK + 3)]
FLAGS = (
    "--policy", "least_requests", "--prefix-pull", "--pull-min-tokens", "256",
    "--pull-kv-bytes-per-token", "1024", "--pull-prefill-tokens-per-s", "8000",
    "--load-interval", "0.05", "--migration-policy", "none",
)  # fmt: skip


async def admin(served: Any, client: httpx.AsyncClient) -> dict[str, dict[str, Any]]:
    url = f"{served.admin_url}/admin/v1/instances"
    listed = await client.get(url, headers=served.admin_headers)
    return {i["url"]: i for i in listed.json()["data"]}


async def wait_until(check: Any, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not await check():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.05)


@pytest.mark.parametrize("fleet_token", [None, "pull-fleet-token"], ids=["open", "fleet-token"])
async def test_the_proxy_pulls_a_long_prefix_to_the_idle_agent(fleet_token: str | None) -> None:
    # With a fleet token the agents refuse a pull header without it and authenticate the block
    # wire with it: the proxy's own pull still lands.
    env = None if fleet_token is None else {FLEET_TOKEN_ENV: fleet_token}
    token_flags = () if fleet_token is None else ("--fleet-token", fleet_token)
    agent_headers = auth_headers(fleet_token)
    async with contextlib.AsyncExitStack() as stack:
        a, b = stack.enter_context(agent_processes(2, "--block-size", str(BLOCK), env=env))
        specs = [a.instance_spec(), b.instance_spec()]
        served = stack.enter_context(serve_process(specs, *FLAGS, *token_flags))
        client = await stack.enter_async_context(httpx.AsyncClient(timeout=120))
        instances = await admin(served, client)
        assert all(i["pull_address"] for i in instances.values())
        drain = served.admin_url + "/admin/v1/instances/{}/drain"

        async def set_draining(url: str, draining: bool) -> None:
            target = drain.format(instances[url]["instance_id"])
            r = await client.post(target, json={"draining": draining}, headers=served.admin_headers)
            assert r.status_code == 200, r.text

        async def complete(body: dict[str, Any]) -> dict[str, Any]:
            r = await client.post(f"{served.url}/v1/completions", json=body)
            assert r.status_code == 200, r.text
            return dict(r.json())

        async def a_holds_the_prompt() -> bool:
            return (await admin(served, client))[a.url]["kv_events"]["indexed_blocks"] >= 40

        async def a_is_busy() -> bool:
            return (await admin(served, client))[a.url]["load"]["num_running"] >= 2

        prompt = {"prompt": PROMPT, "max_tokens": 16, "temperature": 0.0}
        await set_draining(b.url, True)  # A alone takes work for now
        expected = await complete(prompt)
        await wait_until(a_holds_the_prompt)
        long = {"prompt": [7, 8, 9], "max_tokens": 600, "ignore_eos": True}
        busy = [asyncio.create_task(complete(long)) for _ in range(2)]
        await wait_until(a_is_busy)
        await set_draining(b.url, False)
        got = await complete(prompt)  # least requests: B; A holds its prefix
        await asyncio.gather(*busy)
        assert got["choices"][0]["text"] == expected["choices"][0]["text"]
        assert got["usage"]["prompt_tokens_details"]["cached_tokens"] == 40 * BLOCK
        metrics = (await client.get(f"{served.url}/metrics")).text
        assert 'kvherd_prefix_pull_decisions_total{action="pull"} 1.0' in metrics, metrics
        assert 'kvherd_prefix_pulls_total{outcome="landed"} 1.0' in metrics, metrics
        for agent in (a, b):
            url = f"{agent.url}/kvherd/v1/state?check_integrity=true"
            state = (await client.get(url, headers=agent_headers)).json()
            assert state["integrity"] == "ok" and state["block_owners"] == []
        # The admin API shows each instance's KV tiers as it reports them (here the GPU pool).
        tiers = (await admin(served, client))[b.url]["tiers"]
        assert [t["medium"] for t in tiers] == ["GPU"], tiers
        assert tiers[0]["capacity_blocks"] > 0 and tiers[0]["num_blocks"] >= 40
