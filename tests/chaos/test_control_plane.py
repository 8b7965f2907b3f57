"""The control plane hardened: the admin API loads no arbitrary code, agents' control routes need the
fleet token (and every fleet component sends it), client request ids never reach the agents.

Agents are real ``kvherd agent`` processes (tiny model); the proxy is `serve_fleet` on real sockets.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from agent_process import AgentProcess, agent_process, free_port
from test_proxy import TOKEN, RunningProxy, running_proxy, wait_for

from scheduler.serve_cli import add_arguments, serve_fleet

pytestmark = pytest.mark.timeout(240)

FLEET = "fleet-token-for-tests"
ADMIN = {"Authorization": f"Bearer {TOKEN}"}
AUTH = {"Authorization": f"Bearer {FLEET}"}
PROMPT = [(i * 7 + 5) % 250 for i in range(40)]
PIPELINE = """
plugins:
  - type: queue-scorer
  - type: max-score-picker
schedulingProfiles:
  - name: default
    plugins:
      - pluginRef: queue-scorer
        weight: 1
      - pluginRef: max-score-picker
"""


@contextlib.contextmanager
def token_agents(count: int) -> Iterator[list[AgentProcess]]:
    env = {"KVHERD_FLEET_TOKEN": FLEET}
    with contextlib.ExitStack() as stack, ThreadPoolExecutor(count) as pool:
        futures = [
            pool.submit(stack.enter_context, agent_process(kv_events=True, env=env))
            for _ in range(count)
        ]
        yield [f.result() for f in futures]


@pytest.fixture(scope="module")
def pair() -> Iterator[list[AgentProcess]]:
    with token_agents(2) as started:
        yield started


def is_error_object(response: httpx.Response, status: int) -> bool:
    error = response.json().get("error")
    return (
        response.status_code == status
        and isinstance(error, dict)
        and set(error) == {"message", "type", "param", "code"}
    )


async def test_admin_policy_switch_runs_no_code_and_reads_no_file_outside_the_policy_dir(
    tmp_path: Path,
) -> None:
    policy_dir = tmp_path / "policies"
    policy_dir.mkdir()
    (policy_dir / "queue.yaml").write_text(PIPELINE)
    (tmp_path / "outside.yaml").write_text(PIPELINE)
    marker = tmp_path / "pwned"
    flags = ("--policy-dir", str(policy_dir), "--policy", "round_robin")
    async with running_proxy([], *flags) as proxy, httpx.AsyncClient(timeout=30) as client:
        url = f"{proxy.admin_url}/admin/v1/policy"
        refused = [
            {"policy": "os:system", "parameters": {"command": f"touch {marker}"}},
            {"policy": "subprocess:run", "parameters": {"args": ["touch", str(marker)]}},
            {"policy": "policies.registry:os.system", "parameters": {"command": f"touch {marker}"}},
            {"policy": "../../etc/passwd"},
            {"policy": "../../../../../../../etc/passwd.yaml"},
            {"policy": "../outside.yaml"},
            {"policy": str(tmp_path / "outside.yaml")},
        ]
        for body in refused:
            response = await client.put(url, json=body, headers=ADMIN)
            assert is_error_object(response, 400), (body, response.text)
            assert response.json()["error"]["param"] == "policy"
        assert not marker.exists()
        current = await client.get(url, headers=ADMIN)
        assert current.json()["policy"] == "round_robin"  # the old policy stayed
        # What the operator put in the policy directory loads.
        loaded = await client.put(url, json={"policy": "queue.yaml"}, headers=ADMIN)
        assert loaded.status_code == 200, loaded.text
        assert loaded.json()["name"] == "queue"
        assert (await client.put(url, json={"policy": "llumnix"}, headers=ADMIN)).status_code == 200


async def test_every_admin_route_needs_the_admin_token() -> None:
    """Without, with a wrong, or with a malformed admin token every admin route (and an unknown
    one) answers 401 with the OpenAI error object, and nothing changes."""
    calls = [
        ("GET", "/instances", None),
        ("GET", "/instances/x", None),
        ("POST", "/instances", {"instance_id": "x", "url": "http://127.0.0.1:1"}),
        ("POST", "/instances/x/heartbeat", {}),
        ("DELETE", "/instances/x", None),
        ("POST", "/instances/x/drain", {}),
        ("POST", "/migrate", {"request_id": "r", "to": "x"}),
        ("GET", "/policy", None),
        ("PUT", "/policy", {"policy": "os:system", "parameters": {"command": "true"}}),
        ("POST", "/policy", {"policy": "round_robin"}),
        ("GET", "/no-such-route", None),
    ]
    wrong = [
        {},
        {"Authorization": "Bearer wrong"},
        {"Authorization": TOKEN},
        {"Authorization": f"Basic {TOKEN}"},
        {"Authorization": f"Bearer {TOKEN}x"},
        {"Authorization": f"Bearer {FLEET}"},  # the fleet's token is not the admin's
    ]
    flags = ("--policy", "llumnix", "--fleet-token", FLEET)
    async with running_proxy([], *flags) as proxy, httpx.AsyncClient(timeout=30) as client:
        for method, path, body in calls:
            for headers in wrong:
                response = await client.request(
                    method, f"{proxy.admin_url}/admin/v1{path}", json=body, headers=headers
                )
                assert is_error_object(response, 401), (method, path, headers, response.text)
        policy = await client.get(f"{proxy.admin_url}/admin/v1/policy", headers=ADMIN)
        assert policy.json()["policy"] == "llumnix"
        assert proxy.fleet.instances == {}


async def test_agent_control_routes_need_the_fleet_token(pair: list[AgentProcess]) -> None:
    agent = pair[0]
    control = [
        ("GET", "/kvherd/v1/state"),
        ("GET", "/kvherd/v1/state?block_hashes=true"),
        ("POST", "/kvherd/v1/migrate"),
        ("POST", "/kvherd/v1/migration/reserve"),
        ("POST", "/kvherd/v1/migration/commit"),
        ("POST", "/kvherd/v1/migration/abort"),
        ("POST", "/kvherd/v1/requests/someone/resume?wait=0"),
        ("GET", "/kvherd/v1/no-such-route"),
    ]
    wrong = [{}, {"Authorization": "Bearer nope"}, {"Authorization": FLEET}, {"X-Token": FLEET}]
    async with httpx.AsyncClient(base_url=agent.url, timeout=30) as client:
        for method, path in control:
            for headers in wrong:
                response = await client.request(method, path, headers=headers, content=b"{}")
                assert is_error_object(response, 401), (method, path, headers, response.text)
            allowed = await client.request(method, path, headers=AUTH, content=b"{}")
            assert allowed.status_code != 401, (method, path)
        state = await client.get("/kvherd/v1/state", headers=AUTH)
        assert state.status_code == 200 and state.json()["instance_id"]
        # The OpenAI routes, health and metrics stay open (the proxy and probes read them).
        for path in ("/health", "/v1/models", "/metrics"):
            assert (await client.get(path)).status_code == 200, path
        body = {"prompt": "open", "max_tokens": 2}
        assert (await client.post("/v1/completions", json=body)).status_code == 200


@pytest.mark.parametrize("flags", [(), ("--fleet-token", "not-the-fleets")], ids=["none", "wrong"])
async def test_serve_without_the_fleet_token_says_so(
    pair: list[AgentProcess], flags: tuple[str, ...], capsys: pytest.CaptureFixture[str]
) -> None:
    """Agents guard their state route with the token: ``kvherd serve`` stops (exit 2) naming the
    fleet token, not calling them foreign engines ("not a kvherd agent")."""
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    argv = ["--port", str(free_port()), "--admin-port", str(free_port()), "--admin-token", TOKEN]
    for agent in pair:
        argv += ["--instance", agent.instance_spec()]
    assert await serve_fleet(parser.parse_args([*argv, *flags]), handle_signals=False) == 2
    err = capsys.readouterr().err
    assert "fleet token" in err and "--fleet-token" in err, err
    assert "not a kvherd agent" not in err, err
    assert ("none was given" in err) == (not flags), err


async def running_key(proxy: RunningProxy, client_id: str, min_tokens: int) -> tuple[str, str]:
    """(the fleet's key, its instance) of a request in flight, once it has `min_tokens` tokens."""
    fleet = proxy.fleet
    found: list[str] = []

    def generated() -> bool:
        key = fleet.request_key(client_id)
        instance_id = fleet.router.instance_of(key)
        if instance_id is None:
            return False
        url = f"{fleet.instances[instance_id].url}/kvherd/v1/state"
        running = httpx.get(url, headers=AUTH).json()["running"]
        mine = [r for r in running if r["request_id"] == key]
        found[:] = [key, instance_id]
        return bool(mine) and mine[0]["num_output_tokens"] >= min_tokens

    await wait_for(generated, timeout=60, interval=0.005)
    return found[0], found[1]


async def stream_tokens(
    client: httpx.AsyncClient, url: str, body: dict[str, Any], request_id: str
) -> tuple[list[int], str]:
    tokens: list[int] = []
    async with client.stream(
        "POST", f"{url}/v1/completions", json=body, headers={"X-Request-Id": request_id}
    ) as response:
        assert response.status_code == 200
        echoed = response.headers["x-request-id"]
        async for line in response.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[6:])
                assert "error" not in chunk, chunk
                for choice in chunk["choices"]:
                    tokens.extend(choice.get("token_ids") or [])
    return tokens, echoed


async def test_the_fleet_token_reaches_every_control_call_and_client_ids_stay_the_clients(
    pair: list[AgentProcess],
) -> None:
    flags = ("--fleet-token", FLEET, "--migration-policy", "none", "--load-interval", "0.05")
    async with running_proxy(pair, *flags) as proxy, httpx.AsyncClient(timeout=120) as client:
        fleet = proxy.fleet
        # Static instances were probed (state route) and are polled with the token.
        assert all(inst.spec.kvherd_agent for inst in fleet.instances.values())
        await wait_for(
            lambda: all(fleet.cluster.get(i).report_time is not None for i in fleet.instances)
        )
        body = {"prompt": PROMPT, "max_tokens": 400, "ignore_eos": True, "temperature": 0.0}
        body |= {"return_token_ids": True, "stream": True}
        # Two requests in flight under one client id: neither is refused, both see their id.
        reused = [
            asyncio.ensure_future(stream_tokens(client, proxy.url, body, "same-id"))
            for _ in range(2)
        ]
        key, src = await running_key(proxy, "same-id", 5)
        assert key != "same-id"  # the agents see the fleet's id, never the client's
        dst = next(i for i in fleet.instances if i != src)
        # The operator names the request by its client id; the driver's order, the agents'
        # migration stages and the proxy's resume at the destination all carry the token.
        moved = await client.post(
            f"{proxy.admin_url}/admin/v1/migrate",
            json={"request_id": "same-id", "to": dst},
            headers=ADMIN,
        )
        assert moved.status_code == 200 and moved.json()["status"] == "committed", moved.text
        results = await asyncio.gather(*reused)
        assert [echoed for _, echoed in results] == ["same-id", "same-id"]
        assert results[0][0] == results[1][0] and len(results[0][0]) == 400
        metrics = (await client.get(f"{proxy.url}/metrics")).text
        assert "kvherd_migration_reattachments_total 1.0" in metrics
        # A plain request that migrates is relayed agent to agent (the stream follow route).
        plain = {**body, "stream": False}
        pending = asyncio.ensure_future(
            client.post(f"{proxy.url}/v1/completions", json=plain, headers={"X-Request-Id": "p"})
        )
        key, src = await running_key(proxy, "p", 5)
        dst = next(i for i in fleet.instances if i != src)
        moved = await client.post(
            f"{proxy.admin_url}/admin/v1/migrate",
            json={"request_id": key, "to": dst},
            headers=ADMIN,
        )
        assert moved.json()["status"] == "committed", moved.text
        response = await pending
        assert response.status_code == 200 and response.headers["x-request-id"] == "p"
        assert response.json()["choices"][0]["token_ids"] == results[0][0]


def test_an_agent_without_a_token_refuses_a_public_bind() -> None:
    env = {k: v for k, v in os.environ.items() if k != "KVHERD_FLEET_TOKEN"}
    cmd = [sys.executable, "-m", "kvherd", "agent", "--host", "0.0.0.0", "--port", str(free_port())]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "without a fleet token" in done.stderr + done.stdout
