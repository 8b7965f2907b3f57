"""Scale-in: SIGTERM on a registered agent migrates its running requests away, then it exits.

Two real agents join a real proxy through ``--scheduler`` (the admin API's registration). The
agent that receives SIGTERM tells the scheduler at once (a heartbeat with ``"draining": true``);
the scheduler drains it, the `drain` migration policy moves its running requests to the other
agent, and the agent exits 0 long before the requests would have finished there. The clients,
talking to the proxy, get exactly the output of an undisturbed run, streamed and not.
"""

from __future__ import annotations

import asyncio
import contextlib

import httpx
import pytest
from agent_process import AgentProcess, agent_process
from test_migration_proxy import ADMIN, Completion, body, running_on
from test_proxy import TOKEN, running_proxy, wait_for

pytestmark = pytest.mark.timeout(240)

GREEDY = {"temperature": 0.0}
MAX_TOKENS = 600


async def test_sigterm_on_a_registered_agent_migrates_its_requests_away() -> None:
    flags = ("--migration-policy", "none", "--migration-interval", "0.05")
    async with running_proxy([], *flags, "--load-interval", "0.05") as proxy:
        with contextlib.ExitStack() as stack:
            args = (
                "--block-size",
                "16",
                "--scheduler",
                proxy.admin_url,
                "--heartbeat-interval",
                "0.2",
            )

            def join() -> AgentProcess:
                started = agent_process(*args, kv_events=True, env={"KVHERD_ADMIN_TOKEN": TOKEN})
                return stack.enter_context(started)

            # Started off the event loop (the proxy on this loop answers their registrations), in
            # parallel (startup is dominated by imports).
            pair = await asyncio.gather(asyncio.to_thread(join), asyncio.to_thread(join))
            fleet = proxy.fleet
            await wait_for(lambda: len(fleet.instances) == 2, timeout=60, interval=0.02)
            first, second = list(fleet.instances)
            by_url = {agent.url: agent for agent in pair}
            async with httpx.AsyncClient(timeout=60) as client:
                drain = f"{proxy.admin_url}/admin/v1/instances/{{}}/drain"
                # Everything starts on `first`: `second` takes no new requests for now.
                await client.post(drain.format(second), json={"draining": True}, headers=ADMIN)
                streamed = body(GREEDY, True, MAX_TOKENS)
                plain = body(GREEDY, False, MAX_TOKENS)
                expected = [
                    await Completion(client, proxy.url, b).result() for b in (streamed, plain)
                ]
                moving = [Completion(client, proxy.url, b) for b in (streamed, plain)]
                for completion in moving:
                    assert await running_on(proxy, completion.request_id, 3) == first
                await client.post(drain.format(second), json={"draining": False}, headers=ADMIN)

                leaving = by_url[fleet.instances[first].url]
                exit_code = asyncio.ensure_future(asyncio.to_thread(leaving.terminate, 120.0))
                got = [await c.result() for c in moving]
                assert await exit_code == 0, leaving.log()
                for mine, theirs in zip(got, expected, strict=True):
                    assert mine.tokens == theirs.tokens and mine.text == theirs.text
                metrics = (await client.get(f"{proxy.url}/metrics")).text
                # Both moved (none finished in place), and the leaver deregistered itself.
                assert 'kvherd_migrations_total{outcome="committed"} 2.0' in metrics, metrics
                await wait_for(lambda: list(fleet.instances) == [second], timeout=30, interval=0.02)
