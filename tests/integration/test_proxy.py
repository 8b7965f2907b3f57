"""The reverse proxy against real agents on loopback: routing, retries, tenancy, admin, bad input.

Agents are real ``kvherd agent`` processes (tiny model); proxies run in the test's event loop through
the same `serve_fleet` that ``kvherd serve`` runs, on real sockets.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest
from agent_process import AgentProcess, agent_process, free_port

from scheduler.core.tenancy import TenantRegistry
from scheduler.fleet import Fleet
from scheduler.serve_cli import add_arguments, serve_fleet

TOKEN = "admin-secret"
SYSTEM = "You are a meticulous assistant for the kvherd test-suite. " * 12  # ~45 blocks of 16


@contextlib.contextmanager
def agents(count: int, *args: str, kv_events: bool = True) -> Iterator[list[AgentProcess]]:
    """`count` agents started in parallel (startup is dominated by imports)."""
    with contextlib.ExitStack() as stack, ThreadPoolExecutor(count) as pool:
        futures = [
            pool.submit(stack.enter_context, agent_process(*args, kv_events=kv_events))
            for _ in range(count)
        ]
        yield [f.result() for f in futures]


@pytest.fixture(scope="module")
def fleet_agents() -> Iterator[list[AgentProcess]]:
    with agents(2) as started:
        yield started


def instance_arg(agent: AgentProcess) -> str:
    spec = agent.url
    if agent.kv_events_endpoint:
        spec += f",kv_events={agent.kv_events_endpoint},replay={agent.replay_endpoint}"
    return spec


class RunningProxy:
    def __init__(self, fleet: Fleet, port: int, admin_port: int) -> None:
        self.fleet = fleet
        self.url = f"http://127.0.0.1:{port}"
        self.admin_url = f"http://127.0.0.1:{admin_port}"


@contextlib.asynccontextmanager
async def running_proxy(
    instances: list[AgentProcess], *flags: str, expose: bool = True
) -> AsyncIterator[RunningProxy]:
    port, admin_port = free_port(), free_port()
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    argv = ["--port", str(port), "--admin-port", str(admin_port), "--admin-token", TOKEN]
    argv += ["--log-level", "warning", *flags]
    if expose:
        argv.append("--expose-instance")
    for agent in instances:
        argv += ["--instance", instance_arg(agent)]
    args = parser.parse_args(argv)
    ready: asyncio.Future[Fleet] = asyncio.get_running_loop().create_future()
    task: asyncio.Future[int]
    stop = asyncio.Event()

    async def on_ready(fleet: Fleet) -> None:
        ready.set_result(fleet)

    task = asyncio.ensure_future(
        serve_fleet(args, on_ready=on_ready, stop=stop, handle_signals=False)
    )
    try:
        pending: set[asyncio.Future[Any]] = {ready, task}
        done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            raise RuntimeError(f"proxy exited with {task.result()}")
        yield RunningProxy(ready.result(), port, admin_port)
    finally:
        stop.set()
        assert await asyncio.wait_for(task, 30) == 0


async def wait_for(condition: Any, timeout: float = 20.0, interval: float = 0.05) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not condition():
        if asyncio.get_running_loop().time() > deadline:
            raise TimeoutError("condition not met in time")
        await asyncio.sleep(interval)


async def complete(
    client: httpx.AsyncClient, base: str, prompt: str, **extra: Any
) -> httpx.Response:
    body = {"prompt": prompt, "max_tokens": 2, "temperature": 0, **extra.pop("body", {})}
    return await client.post(f"{base}/v1/completions", json=body, **extra)


def cached_tokens(response: httpx.Response) -> int:
    return int(response.json()["usage"]["prompt_tokens_details"]["cached_tokens"])


def indexed_blocks(fleet: Fleet, instance_id: str) -> int:
    index = fleet.cluster.prefix_index
    return index.num_blocks(instance_id) if instance_id in index else 0


async def test_shared_prefix_routes_to_holder_and_load_spreads(
    fleet_agents: list[AgentProcess],
) -> None:
    async with running_proxy(fleet_agents) as proxy, httpx.AsyncClient(timeout=60) as client:
        first = await complete(client, proxy.url, SYSTEM + "Question zero?")
        assert first.status_code == 200, first.text
        holder = first.headers["x-kvherd-instance"]
        # The holder's KV events reach the proxy's index.
        await wait_for(lambda: indexed_blocks(proxy.fleet, holder) >= len(SYSTEM) // 16 - 1)
        for i in range(1, 6):
            response = await complete(client, proxy.url, SYSTEM + f"Question {i}?")
            assert response.status_code == 200
            assert response.headers["x-kvherd-instance"] == holder
            assert cached_tokens(response) >= (len(SYSTEM) // 16 - 1) * 16
        # Unrelated prompts arriving together spread over both instances.
        burst = await asyncio.gather(
            *(
                complete(
                    client, proxy.url, f"{i} unrelated topic {i * 7919}", body={"max_tokens": 8}
                )
                for i in range(8)
            )
        )
        assert all(r.status_code == 200 for r in burst)
        served = {r.headers["x-kvherd-instance"] for r in burst}
        assert served == set(proxy.fleet.instances)
        assert all(proxy.fleet.inflight.count(i) == 0 for i in proxy.fleet.instances)


async def test_approximate_index_without_events(fleet_agents: list[AgentProcess]) -> None:
    async with (
        running_proxy(fleet_agents, "--no-kv-events") as proxy,
        httpx.AsyncClient(timeout=60) as client,
    ):
        assert proxy.fleet.cluster.prefix_index.num_blocks() == 0
        prompt = SYSTEM + "approximate: "
        first = await complete(client, proxy.url, prompt + "a")
        holder = first.headers["x-kvherd-instance"]
        for suffix in "bcd":
            response = await complete(client, proxy.url, prompt + suffix)
            assert response.headers["x-kvherd-instance"] == holder
            assert cached_tokens(response) > 0
        assert proxy.fleet.cluster.prefix_index.num_blocks() == 0  # no events consumed


async def test_streaming_relays_sse_and_request_id(fleet_agents: list[AgentProcess]) -> None:
    body = {"prompt": "stream me", "max_tokens": 6, "temperature": 0, "seed": 1, "stream": True}
    async with running_proxy(fleet_agents) as proxy, httpx.AsyncClient(timeout=60) as client:
        async with client.stream(
            "POST", f"{proxy.url}/v1/completions", json=body, headers={"X-Request-Id": "rid-42"}
        ) as response:
            assert response.status_code == 200
            assert response.headers["x-request-id"] == "rid-42"
            assert response.headers["content-type"].startswith("text/event-stream")
            via_proxy = b"".join([chunk async for chunk in response.aiter_raw()])
        served = next(
            a
            for a in fleet_agents
            if a.url == proxy.fleet.instances[response.headers["x-kvherd-instance"]].url
        )
        direct = await client.post(f"{served.url}/v1/completions", json=body)
        events = [line for line in via_proxy.split(b"\n\n") if line]
        assert events[-1] == b"data: [DONE]"
        direct_events = [line for line in direct.content.split(b"\n\n") if line]
        assert len(events) == len(direct_events)
        texts = [
            httpx.Response(200, content=e[6:]).json()["choices"][0]["text"] for e in events[:-1]
        ]
        direct_texts = [
            httpx.Response(200, content=e[6:]).json()["choices"][0]["text"]
            for e in direct_events[:-1]
        ]
        assert texts == direct_texts


async def test_instance_is_hidden_unless_exposed(fleet_agents: list[AgentProcess]) -> None:
    async with (
        running_proxy(fleet_agents, expose=False) as proxy,
        httpx.AsyncClient(timeout=60) as client,
    ):
        response = await complete(client, proxy.url, "which instance?")
        assert response.status_code == 200
        assert "x-kvherd-instance" not in response.headers
        assert "server" not in response.headers
        assert response.headers["x-request-id"]


async def test_killed_instance_requests_retried_elsewhere(
    fleet_agents: list[AgentProcess],
) -> None:
    with agent_process(kv_events=True) as victim:
        async with (
            running_proxy(
                [fleet_agents[0], victim], "--policy", "round_robin", "--health-interval", "60"
            ) as proxy,
            httpx.AsyncClient(timeout=60) as client,
        ):
            victim.process.send_signal(signal.SIGKILL)
            victim.process.wait()
            responses = await asyncio.gather(
                *(complete(client, proxy.url, f"after the kill {i}") for i in range(6))
            )
            assert [r.status_code for r in responses] == [200] * 6
            survivors = {r.headers["x-kvherd-instance"] for r in responses}
            assert survivors == {next(iter(proxy.fleet.instances))}
            metrics = (await client.get(f"{proxy.url}/metrics")).text
            assert "kvherd_retries_total" in metrics
            retries = next(
                float(line.split()[-1])
                for line in metrics.splitlines()
                if line.startswith("kvherd_retries_total")
            )
            assert retries >= 1
            # Consecutive failures eject the dead instance.
            victim_id = next(
                i for i, inst in proxy.fleet.instances.items() if inst.url == victim.url
            )
            await wait_for(lambda: not proxy.fleet.cluster.get(victim_id).healthy)
            assert (
                'kvherd_ejections_total{instance="' + victim_id
                in (await client.get(f"{proxy.url}/metrics")).text
            )


async def test_tenants_never_share_blocks(fleet_agents: list[AgentProcess]) -> None:
    async with (
        running_proxy(
            fleet_agents,
            "--api-key",
            "key-alice=alice",
            "--api-key",
            "key-bob=bob",
            "--tenant-salt-secret",
            "salt secret",
        ) as proxy,
        httpx.AsyncClient(timeout=60) as client,
    ):
        alice = {"Authorization": "Bearer key-alice"}
        bob = {"Authorization": "Bearer key-bob"}
        prompt = SYSTEM + "tenant question"
        assert (await complete(client, proxy.url, prompt)).status_code == 401
        assert (
            await complete(client, proxy.url, prompt, headers={"Authorization": "Bearer nope"})
        ).status_code == 401
        first = await complete(client, proxy.url, prompt, headers=alice)
        assert first.status_code == 200
        again = await complete(client, proxy.url, prompt, headers=alice)
        assert cached_tokens(again) > 0
        # Bob, even when he sends Alice's salt himself, never hits Alice's blocks.
        alice_salt = TenantRegistry(salt_secret="salt secret").salt_for("alice")
        variants: list[dict[str, Any]] = [{}, {"cache_salt": alice_salt}, {"cache_salt": None}]
        for i, body in enumerate(variants):
            shared = f"variant {i}: {prompt}"
            assert (await complete(client, proxy.url, shared, headers=alice)).status_code == 200
            response = await complete(client, proxy.url, shared, headers=bob, body=body)
            assert response.status_code == 200
            assert cached_tokens(response) == 0, i
        # Bob's own repeat does hit his own blocks.
        bob_again = await complete(client, proxy.url, f"variant 0: {prompt}", headers=bob)
        assert cached_tokens(bob_again) > 0


async def test_admin_requires_token_and_manages_fleet(fleet_agents: list[AgentProcess]) -> None:
    async with running_proxy(fleet_agents[:1]) as proxy, httpx.AsyncClient(timeout=30) as client:
        base = f"{proxy.admin_url}/admin/v1"
        auth = {"Authorization": f"Bearer {TOKEN}"}
        calls = [
            ("GET", "/instances", None),
            ("POST", "/instances", {"instance_id": "x", "url": "http://127.0.0.1:1"}),
            ("DELETE", "/instances/x", None),
            ("POST", "/instances/x/drain", {}),
            ("POST", "/instances/x/heartbeat", {}),
            ("PUT", "/policy", {"policy": "round_robin"}),
            ("GET", "/nope", None),
        ]
        for method, path, body in calls:
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": TOKEN}):
                response = await client.request(method, base + path, json=body, headers=headers)
                assert response.status_code == 401, (method, path, headers)
                assert response.json()["error"]["type"] == "authentication_error"
        assert len(proxy.fleet.instances) == 1
        listed = (await client.get(base + "/instances", headers=auth)).json()["data"]
        assert listed[0]["health"] == "healthy" and listed[0]["kv_events"] is not None
        one = await client.get(f"{base}/instances/{listed[0]['instance_id']}", headers=auth)
        assert (one.json()["instance_id"], one.json()["url"]) == (
            listed[0]["instance_id"],
            listed[0]["url"],
        )
        assert (await client.get(base + "/instances/ghost", headers=auth)).status_code == 404
        other = fleet_agents[1]
        spec = {
            "instance_id": "second",
            "url": other.url,
            "model": "tiny",
            "block_size": 16,
            "kv_events_endpoint": other.kv_events_endpoint,
            "replay_endpoint": other.replay_endpoint,
        }
        created = await client.post(base + "/instances", json=spec, headers=auth)
        assert created.status_code == 201, created.text
        assert (await client.post(base + "/instances", json=spec, headers=auth)).status_code == 200
        refused: list[tuple[Any, int]] = [
            ({**spec, "url": "http://10.1.2.3:8000"}, 403),
            ({**spec, "kv_events_endpoint": "tcp://10.1.2.3:5557"}, 403),
            ({**spec, "block_size": 32}, 400),
            ({**spec, "url": "ftp://127.0.0.1"}, 400),
            ({"url": other.url}, 400),
            ([1, 2], 400),
        ]
        for body, status in refused:
            response = await client.post(base + "/instances", json=body, headers=auth)
            assert response.status_code == status, (body, response.text)
            assert set(response.json()["error"]) == {"message", "type", "param", "code"}
        bad_json = await client.post(base + "/instances", content=b"{", headers=auth)
        assert bad_json.status_code == 400
        hb = await client.post(base + "/instances/second/heartbeat", json={}, headers=auth)
        assert hb.status_code == 200
        unknown = await client.post(base + "/instances/ghost/heartbeat", json={}, headers=auth)
        assert unknown.status_code == 404
        drained = await client.post(base + "/instances/second/drain", json={}, headers=auth)
        assert drained.json()["draining"] is True
        for i in range(3):
            response = await complete(client, proxy.url, f"drained {i}")
            assert response.headers["x-kvherd-instance"] != "second"
        policy = await client.put(base + "/policy", json={"policy": "least_requests"}, headers=auth)
        assert policy.json()["policy"] == "least_requests"
        bad_policy = await client.put(base + "/policy", json={"policy": "nope"}, headers=auth)
        assert bad_policy.status_code == 400
        assert (await client.get(base + "/policy", headers=auth)).json()["policy"] == (
            "least_requests"
        )
        assert (await client.delete(base + "/instances/second", headers=auth)).status_code == 200
        assert (await client.delete(base + "/instances/second", headers=auth)).status_code == 404
        assert "second" not in proxy.fleet.instances


async def test_bad_input_gets_400_and_proxy_stays_up(fleet_agents: list[AgentProcess]) -> None:
    async with running_proxy(fleet_agents) as proxy, httpx.AsyncClient(timeout=30) as client:
        url = f"{proxy.url}/v1/completions"
        chat = f"{proxy.url}/v1/chat/completions"
        cases: list[tuple[str, bytes]] = [
            (url, b"{not json"),
            (url, b"[1, 2, 3]"),
            (url, b"{}"),
            (url, b'{"prompt": 5}'),
            (url, b'{"prompt": []}'),
            (url, b'{"prompt": [1, -2]}'),
            (url, b'{"prompt": [true]}'),
            (url, b'{"prompt": "x", "cache_salt": 7}'),
            (url, b'{"prompt": "x", "max_tokens": "many"}'),  # the agent's 400, relayed
            (chat, b'{"messages": "hi"}'),
            (chat, b'{"messages": [{"role": 7, "content": "x"}]}'),
            (chat, b'{"messages": [{"role": "user", "content": {"a": 1}}]}'),
            (url, b"\xff\xfe"),
            (url, b'{"prompt": "' + b"x" * (9 * 1024 * 1024) + b'"}'),
        ]
        for target, body in cases:
            response = await client.post(target, content=body)
            assert response.status_code == 400, (body[:60], response.text)
            error = response.json()["error"]
            assert set(error) == {"message", "type", "param", "code"}
        assert (await client.get(url)).status_code == 405
        ok = await complete(client, proxy.url, "still alive")
        assert ok.status_code == 200
        models = (await client.get(f"{proxy.url}/v1/models")).json()
        assert [m["id"] for m in models["data"]] == ["tiny"]
        assert (await client.get(f"{proxy.url}/health")).status_code == 200
        metrics = (await client.get(f"{proxy.url}/metrics")).text
        assert 'kvherd_requests_total{status="400"}' in metrics
        assert "kvherd_routing_decision_seconds_bucket" in metrics
        assert "kvherd_matched_prefix_blocks_bucket" in metrics
        assert "kvherd_instance_inflight" in metrics


async def test_saturated_fleet_answers_429(fleet_agents: list[AgentProcess]) -> None:
    flags = ["--max-inflight-per-instance", "1", "--queue-size", "1", "--queue-timeout", "30"]
    async with (
        running_proxy(fleet_agents, *flags) as proxy,
        httpx.AsyncClient(timeout=120) as client,
    ):
        responses = await asyncio.gather(
            *(
                complete(
                    client, proxy.url, f"busy {i}", body={"max_tokens": 48, "ignore_eos": True}
                )
                for i in range(6)
            )
        )
        statuses = sorted(r.status_code for r in responses)
        # Two run, one waits in the queue, the rest are refused at once.
        assert statuses == [200, 200, 200, 429, 429, 429], statuses
        refused = next(r for r in responses if r.status_code == 429)
        assert refused.json()["error"]["type"] == "rate_limit_error"


async def test_two_proxies_share_nothing_but_both_route_by_cache(
    fleet_agents: list[AgentProcess],
) -> None:
    async with (
        running_proxy(fleet_agents) as one,
        running_proxy(fleet_agents) as two,
        httpx.AsyncClient(timeout=60) as client,
    ):
        prompt = SYSTEM + "two proxies: "
        first = await complete(client, one.url, prompt + "first")
        holder = first.headers["x-kvherd-instance"]
        # Proxy two never routed this prefix; it learns where it lives from the events.
        await wait_for(lambda: indexed_blocks(two.fleet, holder) >= len(SYSTEM) // 16)
        for proxy in (two, one, two):
            response = await complete(client, proxy.url, prompt + proxy.url)
            assert response.headers["x-kvherd-instance"] == holder
            assert cached_tokens(response) > 0


def abort_count(metrics_text: str) -> float:
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in metrics_text.splitlines()
        if line.startswith("vllm:request_success_total") and 'finished_reason="abort"' in line
    )


async def test_client_disconnect_aborts_the_upstream_request(
    fleet_agents: list[AgentProcess],
) -> None:
    long = {"max_tokens": 1000, "ignore_eos": True}
    async with running_proxy(fleet_agents[:1]) as proxy, httpx.AsyncClient(timeout=60) as client:
        agent_metrics = f"{fleet_agents[0].url}/metrics"
        before = abort_count((await client.get(agent_metrics)).text)
        # Streamed: the client reads one chunk and hangs up.
        async with client.stream(
            "POST", f"{proxy.url}/v1/completions", json={"prompt": "go", "stream": True, **long}
        ) as response:
            assert response.status_code == 200
            async for _ in response.aiter_raw():
                break
        # Not streamed: the client gives up while the instance is still generating.
        with pytest.raises(httpx.ReadTimeout):
            await client.post(
                f"{proxy.url}/v1/completions", json={"prompt": "go", **long}, timeout=0.5
            )
        deadline = asyncio.get_running_loop().time() + 30
        while abort_count((await client.get(agent_metrics)).text) < before + 2:
            assert asyncio.get_running_loop().time() < deadline, "upstream requests not aborted"
            await asyncio.sleep(0.05)
        await wait_for(lambda: all(proxy.fleet.inflight.count(i) == 0 for i in proxy.fleet.instances))
        metrics = (await client.get(f"{proxy.url}/metrics")).text
        assert 'kvherd_requests_total{status="client_closed"} 2.0' in metrics
