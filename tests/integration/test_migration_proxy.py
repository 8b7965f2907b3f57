"""Live migration through ``kvherd serve``: operator orders and drains, as the client sees them.

Two real agents behind the proxy (`serve_fleet`, the code ``kvherd serve`` runs). A request is
moved with ``POST /admin/v1/migrate`` or by draining its instance; the client, talking to the
proxy, must get exactly the output of an unmigrated run.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import pytest
from agent_process import AgentProcess, agent_process
from test_proxy import TOKEN, RunningProxy, agents, running_proxy, wait_for

pytestmark = pytest.mark.timeout(180)

PROMPT = [(i * 17 + 3) % 250 for i in range(50)]
GREEDY = {"temperature": 0.0}
SEEDED = {"temperature": 0.9, "top_p": 0.95, "seed": 77}
ADMIN = {"Authorization": f"Bearer {TOKEN}"}
_ids = itertools.count()
# Long enough that an order given after a few tokens lands before the end (~1 token/ms idle).
LONG = 600


@pytest.fixture(scope="module")
def pair() -> Iterator[list[AgentProcess]]:
    with agents(2, "--block-size", "16") as started:
        yield started


@pytest.fixture
async def proxy(pair: list[AgentProcess]) -> AsyncIterator[RunningProxy]:
    # No automatic migration: only the test's orders and drains move requests.
    flags = (
        "--migration-policy",
        "none",
        "--migration-interval",
        "0.05",
        "--load-interval",
        "0.05",
    )
    async with running_proxy(pair, *flags) as running:
        yield running


class Completion:
    """A completion through the proxy; `tokens` grows as chunks arrive when streamed."""

    def __init__(self, client: httpx.AsyncClient, url: str, body: dict[str, Any]) -> None:
        self.request_id = f"px-{next(_ids)}"
        self.tokens: list[int] = []
        self.text = ""
        self.usage: dict[str, Any] | None = None
        self.task = asyncio.ensure_future(self._run(client, url, body))

    async def _run(self, client: httpx.AsyncClient, url: str, body: dict[str, Any]) -> None:
        headers = {"X-Request-Id": self.request_id}
        if not body["stream"]:
            response = await client.post(f"{url}/v1/completions", json=body, headers=headers)
            assert response.status_code == 200, response.text
            data = response.json()
            self.tokens, self.text = data["choices"][0]["token_ids"], data["choices"][0]["text"]
            self.usage = data["usage"]
            return
        async with client.stream(
            "POST", f"{url}/v1/completions", json=body, headers=headers
        ) as response:
            assert response.status_code == 200
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                assert "error" not in chunk, chunk
                if chunk.get("usage"):
                    self.usage = chunk["usage"]
                for choice in chunk["choices"]:
                    self.tokens.extend(choice.get("token_ids") or [])
                    self.text += choice["text"]

    async def result(self) -> Completion:
        await asyncio.wait_for(self.task, 120)
        return self


def body(sampling: dict[str, Any], stream: bool, max_tokens: int) -> dict[str, Any]:
    payload: dict[str, Any] = {
        "prompt": PROMPT,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "return_token_ids": True,
        "stream": stream,
        **sampling,
    }
    if stream:
        payload["stream_options"] = {"include_usage": True}
    return payload


async def running_on(proxy: RunningProxy, request_id: str, min_tokens: int) -> str:
    """The instance the request runs on, once it has generated `min_tokens` tokens there."""
    fleet = proxy.fleet
    instance_id: str | None = None

    def generated() -> bool:
        nonlocal instance_id
        key = fleet.request_key(request_id)  # the agents know the request by the fleet's id
        instance_id = fleet.router.instance_of(key)
        if instance_id is None:
            return False
        state = httpx.get(f"{fleet.instances[instance_id].url}/kvherd/v1/state").json()
        mine = [r for r in state["running"] if r["request_id"] == key]
        return bool(mine) and mine[0]["num_output_tokens"] >= min_tokens

    await wait_for(generated, timeout=60, interval=0.005)
    assert instance_id is not None
    return instance_id


async def assert_agents_clean(pair: list[AgentProcess]) -> None:
    async with httpx.AsyncClient() as client:
        for agent in pair:

            async def state(agent: AgentProcess = agent) -> dict[str, Any]:
                url = f"{agent.url}/kvherd/v1/state?check_integrity=true"
                return dict((await client.get(url)).json())

            for _ in range(2000):
                current = await state()
                assert current["integrity"] == "ok", current["integrity"]
                if current["num_running"] == 0 and current["block_owners"] == []:
                    break
                await asyncio.sleep(0.01)
            else:
                raise AssertionError(f"{agent.url} still holds {current['block_owners']}")


@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "plain"])
@pytest.mark.parametrize("sampling", [GREEDY, SEEDED], ids=["greedy", "seeded"])
async def test_admin_migrate_through_the_proxy_is_invisible_to_the_client(
    proxy: RunningProxy, pair: list[AgentProcess], sampling: dict[str, Any], stream: bool
) -> None:
    async with httpx.AsyncClient(timeout=60) as client:
        expected = await Completion(client, proxy.url, body(sampling, stream, LONG)).result()
        assert len(expected.tokens) == LONG
        moving = Completion(client, proxy.url, body(sampling, stream, LONG))
        src = await running_on(proxy, moving.request_id, 5)
        dst = next(i for i in proxy.fleet.instances if i != src)
        response = await client.post(
            f"{proxy.admin_url}/admin/v1/migrate",
            json={"request_id": moving.request_id, "to": dst},
            headers=ADMIN,
        )
        assert response.status_code == 200, response.text
        outcome = response.json()
        assert outcome["status"] == "committed", outcome
        got = await moving.result()
        assert got.tokens == expected.tokens and got.text == expected.text
        assert got.usage is not None and expected.usage is not None
        for key in ("prompt_tokens", "completion_tokens", "total_tokens"):
            assert got.usage[key] == expected.usage[key]
        metrics = (await client.get(f"{proxy.url}/metrics")).text
        assert 'kvherd_migrations_total{outcome="committed"} 1.0' in metrics
        assert "kvherd_migrations_started_total 1.0" in metrics
        assert "kvherd_migration_downtime_seconds_count 1.0" in metrics
        # Streamed: the proxy itself continued the stream at the destination; plain: the
        # source relayed the rest.
        assert f"kvherd_migration_reattachments_total {float(stream)}" in metrics
    await assert_agents_clean(pair)


async def test_migrated_chat_stream_continues_through_the_proxy(
    proxy: RunningProxy, pair: list[AgentProcess]
) -> None:
    chat = {
        "messages": [{"role": "user", "content": "Tell me a long story about KV caches."}],
        "max_tokens": LONG,
        "ignore_eos": True,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }

    async def run(client: httpx.AsyncClient, rid: str) -> list[dict[str, Any]]:
        async with client.stream(
            "POST", f"{proxy.url}/v1/chat/completions", json=chat, headers={"X-Request-Id": rid}
        ) as response:
            assert response.status_code == 200
            return [
                json.loads(line[6:])
                async for line in response.aiter_lines()
                if line.startswith("data: ") and line != "data: [DONE]"
            ]

    async with httpx.AsyncClient(timeout=60) as client:
        expected = await run(client, "chat-ref")
        moving = asyncio.ensure_future(run(client, "chat-moving"))
        src = await running_on(proxy, "chat-moving", 5)
        dst = next(i for i in proxy.fleet.instances if i != src)
        response = await client.post(
            f"{proxy.admin_url}/admin/v1/migrate",
            json={"request_id": "chat-moving", "to": dst},
            headers=ADMIN,
        )
        assert response.json()["status"] == "committed"
        got = await asyncio.wait_for(moving, 120)
    # Same chunks (role chunk once, content, running usage, final usage) apart from the id and
    # the prefix-cache hits (the second run finds the first one's prompt cached).
    for chunk in expected + got:
        chunk.pop("id")
        chunk.pop("created")
        if chunk.get("usage"):
            chunk["usage"].pop("prompt_tokens_details")
    assert got == expected
    await assert_agents_clean(pair)


async def test_admin_migrate_refuses_bad_orders(proxy: RunningProxy) -> None:
    async with httpx.AsyncClient(timeout=60) as client:
        url = f"{proxy.admin_url}/admin/v1/migrate"
        some = next(iter(proxy.fleet.instances))
        for order, status, param in [
            ({"request_id": "nope", "to": some}, 404, "request_id"),
            ({"request_id": 3, "to": some}, 400, "request_id"),
            ({"request_id": "x"}, 400, "to"),
            ([1], 400, None),
        ]:
            response = await client.post(url, json=order, headers=ADMIN)
            assert response.status_code == status, (order, response.text)
            assert response.json()["error"]["param"] == param
            assert response.json()["error"]["type"] == "invalid_request_error"
        assert (await client.post(url, json={})).status_code == 401


async def test_drain_moves_every_running_request_elsewhere(
    proxy: RunningProxy, pair: list[AgentProcess]
) -> None:
    fleet = proxy.fleet
    first, second = list(fleet.instances)
    samplings = [{"temperature": 0.8, "seed": seed} for seed in (1, 2, 3)]

    async def batch(client: httpx.AsyncClient) -> list[Completion]:
        return [Completion(client, proxy.url, body(s, True, 400)) for s in samplings]

    async with httpx.AsyncClient(timeout=60) as client:
        drain = f"{proxy.admin_url}/admin/v1/instances/{{}}/drain"
        # Everything starts on `first`: `second` takes no new requests for now.
        await client.post(drain.format(second), json={"draining": True}, headers=ADMIN)
        expected = [await c.result() for c in await batch(client)]
        moving = await batch(client)
        for completion in moving:
            assert await running_on(proxy, completion.request_id, 3) == first
        await client.post(drain.format(second), json={"draining": False}, headers=ADMIN)
        response = await client.post(drain.format(first), json={}, headers=ADMIN)
        assert response.status_code == 200 and response.json()["draining"] is True
        got = [await c.result() for c in moving]
        for mine, theirs in zip(got, expected, strict=True):
            assert mine.tokens == theirs.tokens and mine.text == theirs.text
        metrics = (await client.get(f"{proxy.url}/metrics")).text
        assert 'kvherd_migrations_total{outcome="committed"} 3.0' in metrics
        await client.post(drain.format(first), json={"draining": False}, headers=ADMIN)
    await assert_agents_clean(pair)


async def test_an_order_for_a_stream_between_instances_waits_for_its_next_one(
    pair: list[AgentProcess],
) -> None:
    """A stream whose instance left is placed nowhere until its continuation is dispatched (held
    back here: the only other instance is full). The stream is still in flight: an order given
    meanwhile is not answered 404 "no request in flight" but waits for that dispatch and moves
    the stream from there; the client still gets exactly the unmoved output."""
    flags = ("--migration-policy", "none", "--max-inflight-per-instance", "1")
    async with running_proxy(pair, *flags) as proxy, httpx.AsyncClient(timeout=60) as client:
        fleet = proxy.fleet
        expected = await Completion(client, proxy.url, body(GREEDY, True, LONG)).result()
        moving = Completion(client, proxy.url, body(GREEDY, True, LONG))
        src = await running_on(proxy, moving.request_id, 5)
        other = next(i for i in fleet.instances if i != src)
        # Another request in the fleet's accounting fills `other` (one in flight per instance).
        holder, _ = fleet.dispatch("holder", 1, [], only=frozenset({other}))
        key = fleet.request_key(moving.request_id)
        spec = fleet.instances[src].spec
        await fleet.remove_instance(src)  # its streams fail over at once
        await fleet.add_instance(spec)  # back, but the stream's continuation will not go there
        assert fleet.router.instance_of(key) is None  # between its attempts
        order = asyncio.ensure_future(
            client.post(
                f"{proxy.admin_url}/admin/v1/migrate",
                json={"request_id": moving.request_id, "to": src},
                headers=ADMIN,
            )
        )
        await asyncio.sleep(0.5)
        assert not order.done(), (await order).text  # waiting for the continuation's dispatch
        assert not moving.task.done()
        fleet.request_finished("holder", holder)  # room on `other`: the continuation starts
        response = await asyncio.wait_for(order, 30)
        assert response.status_code == 200, response.text
        got = await moving.result()
        assert got.tokens == expected.tokens and got.text == expected.text
        answer = await client.post(
            f"{proxy.admin_url}/admin/v1/migrate",
            json={"request_id": moving.request_id, "to": src},
            headers=ADMIN,
        )
        assert answer.status_code == 404, answer.text  # ended: no longer in flight
    await assert_agents_clean(pair)


def test_a_notice_split_across_chunks_is_held_back_only_while_it_may_be_one() -> None:
    from scheduler.proxy.relay import _NOTICE, _notice_prefix, _split

    frame = b'data: {"id":"cmpl-1","choices":[]}\n\n'
    assert _notice_prefix(frame) == 0  # a whole frame goes out at once
    for cut in range(1, len(_NOTICE)):
        assert _notice_prefix(frame + _NOTICE[:cut]) == cut
        # Split anywhere, the frame before the notice goes out and the notice is found whole.
        out, pending, notice = _split(frame + _NOTICE[:cut])
        assert (out, pending, notice) == (frame, _NOTICE[:cut], b"")
        assert _split(pending + _NOTICE[cut:] + b'"http://b"}}\n\n')[2].startswith(_NOTICE)
    assert _notice_prefix(frame + b"data: [DO") == 0


async def test_fleet_counts_a_migrated_request_where_it_runs() -> None:
    from scheduler.fleet import Fleet, FleetSettings, InstanceSpec
    from scheduler.metrics import ProxyMetrics

    fleet = Fleet("round_robin", FleetSettings(block_size=16), ProxyMetrics())
    try:
        await fleet.add_instance(InstanceSpec("a", "http://127.0.0.1:9"))
        await fleet.add_instance(InstanceSpec("b", "http://127.0.0.1:10"))
        src, _ = fleet.dispatch("r", 64, [])
        dst = fleet.instances["b" if src.instance_id == "a" else "a"]
        fleet.request_migrated("r", dst.instance_id)
        count = fleet.inflight.count
        assert (count(src.instance_id), count(dst.instance_id)) == (0, 1)
        assert fleet.router.instance_of("r") == dst.instance_id
        fleet.request_finished("r", src)  # the proxy reports the instance it dispatched to
        assert (count(src.instance_id), count(dst.instance_id)) == (0, 0)
        assert fleet.inflight.instance_of("r") is None
    finally:
        await fleet.stop()


async def test_a_stream_is_in_flight_between_its_attempts() -> None:
    from scheduler.fleet import Fleet, FleetSettings, InstanceSpec
    from scheduler.metrics import ProxyMetrics

    fleet = Fleet("round_robin", FleetSettings(block_size=16), ProxyMetrics())
    try:
        await fleet.add_instance(InstanceSpec("a", "http://127.0.0.1:9"))
        key = fleet.new_key("client-id")
        inst, _ = fleet.dispatch(key, 64, [])
        fleet.stream_opened(key)
        fleet.request_failed(key, inst)  # its attempt ended; the stream is to be continued
        assert fleet.in_flight(key) and fleet.request_key("client-id") == key
        fleet.new_key("client-id")  # another request reusing the id: the first holder keeps it
        assert fleet.request_key("client-id") == key
        assert await fleet.placement(key, 0.05) is None  # not placed yet
        waiting = asyncio.ensure_future(fleet.placement(key, 30))
        await asyncio.sleep(0)
        fleet.dispatch(key, 64, [])  # the continuation
        assert await asyncio.wait_for(waiting, 5) == "a"
        fleet.request_finished(key, inst)
        waiting = asyncio.ensure_future(fleet.placement(key, 30))
        await asyncio.sleep(0)
        fleet.stream_closed(key)  # the stream ended before it was placed again
        assert await asyncio.wait_for(waiting, 5) is None
        assert not fleet.in_flight(key)
    finally:
        await fleet.stop()


async def test_default_llumnix_policy_moves_requests_off_a_preempting_instance() -> None:
    """``kvherd serve`` migrates on its own by default: round robin overloads the small instance
    (it preempts), the llumnix policy moves requests to the big one, and every client still gets
    exactly its unmigrated output."""
    with contextlib.ExitStack() as stack:
        small, big = (
            stack.enter_context(agent_process("--num-gpu-blocks", blocks, kv_events=True))
            for blocks in ("48", "1024")
        )
        flags = ("--policy", "round_robin", "--migration-interval", "0.1", "--load-interval", "0.1")
        async with running_proxy([small, big], *flags) as proxy:
            assert proxy.fleet.migration_spec == "llumnix"

            def body(i: int) -> dict[str, Any]:
                prompt = [(i * 31 + k) % 250 for k in range(40)]
                return {
                    "prompt": prompt,
                    "max_tokens": 200,
                    "ignore_eos": True,
                    "temperature": 0.8,
                    "seed": i,
                    "return_token_ids": True,
                }

            async with httpx.AsyncClient(timeout=120) as client:

                async def tokens(url: str, i: int) -> list[int]:
                    response = await client.post(f"{url}/v1/completions", json=body(i))
                    assert response.status_code == 200, response.text
                    return list(response.json()["choices"][0]["token_ids"])

                got = await asyncio.gather(*(tokens(proxy.url, i) for i in range(12)))
                metrics = (await client.get(f"{proxy.url}/metrics")).text
                expected = await asyncio.gather(*(tokens(big.url, i) for i in range(12)))
        assert got == expected
        committed = [
            line
            for line in metrics.splitlines()
            if line.startswith('kvherd_migrations_total{outcome="committed"}')
        ]
        outcomes = [line for line in metrics.splitlines() if line.startswith("kvherd_migrations_")]
        assert committed and float(committed[0].split()[-1]) >= 1, outcomes
        await assert_agents_clean([small, big])
