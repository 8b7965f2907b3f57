"""P/D disaggregation through ``kvherd serve``: real agents with roles, on loopback.

A prefill agent and a decode agent behind the proxy (`serve_fleet`): a request the P/D policy
disaggregates reserves on the decode agent as the prefill agent admits it, is prefilled there (a
chunked prefill's full blocks moving while later chunks compute), its first token streamed from
there, and handed to the decode agent by live migration. The client must get exactly what a
colocated run on one agent gives (greedy and seeded sampling, streamed and not, completions and
chat, usage included); the fault paths (a decode instance that refuses the reservation before
the prefill, is dead, or dies mid-handoff; a client that leaves mid-prefill; a request that
finishes at its first token; a dead prefill instance) must be invisible too; and no agent may keep
a block or a reservation afterwards.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import json
import os
import random
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import pytest
from agent_process import AgentProcess, agent_process, free_port
from fault_relay import Fault, FaultRelay
from test_migration_proxy import assert_agents_clean
from test_proxy import TOKEN, RunningProxy, agents, instance_arg, running_proxy

pytestmark = pytest.mark.timeout(240)

GREEDY = {"temperature": 0.0}
SEEDED = {"temperature": 0.9, "top_p": 0.95, "seed": 77}
ADMIN = {"Authorization": f"Bearer {TOKEN}"}
MAX_TOKENS = 40
# Longer than the kvherd P/D policy's local_prefill_tokens (256): disaggregated.
PROMPT_TOKENS = 320
_prompts = itertools.count(1)


def fresh_prompt() -> list[int]:
    """Token ids no other test sent (so no instance caches them)."""
    rng = random.Random(next(_prompts))
    return [rng.randrange(3, 250) for _ in range(PROMPT_TOKENS)]


# Flags every proxy here runs with: no automatic migration (only handoffs move requests), and
# frequent load polls so the proxy learns the agents' roles at once.
FLAGS = ("--migration-policy", "none", "--load-interval", "0.05")


@pytest.fixture(scope="module")
def pd_pair() -> Iterator[list[AgentProcess]]:
    """A prefill agent and a decode agent (roles reported in their state)."""
    with contextlib.ExitStack() as stack:
        prefill = stack.enter_context(agent_process("--role", "prefill", kv_events=True))
        decode = stack.enter_context(agent_process("--role", "decode", kv_events=True))
        yield [prefill, decode]


@pytest.fixture
async def proxy(pd_pair: list[AgentProcess]) -> AsyncIterator[RunningProxy]:
    async with running_proxy(pd_pair, *FLAGS) as running:
        await roles_known(running, 2)
        yield running


async def roles_known(proxy: RunningProxy, count: int) -> None:
    for _ in range(400):
        if sum(role != "mixed" for role in proxy.fleet.roles().values()) >= count:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"roles not learned: {proxy.fleet.roles()}")


async def run(
    client: httpx.AsyncClient, base: str, body: dict[str, Any], chat: bool = False
) -> dict[str, Any]:
    """One request; returns tokens, text, usage and the response headers."""
    path = "/v1/chat/completions" if chat else "/v1/completions"
    if not body.get("stream"):
        response = await client.post(base + path, json=body)
        assert response.status_code == 200, response.text
        data = response.json()
        choice = data["choices"][0]
        text = choice["message"]["content"] if chat else choice["text"]
        return {
            "tokens": choice.get("token_ids"),
            "text": text,
            "usage": data["usage"],
            "finish": choice["finish_reason"],
            "headers": response.headers,
        }
    tokens: list[int] = []
    text = ""
    usage = None
    finish = None
    async with client.stream("POST", base + path, json=body) as response:
        assert response.status_code == 200
        headers = response.headers
        async for line in response.aiter_lines():
            # No ledger line, handoff report or migration notice reaches the client.
            assert not line.startswith(":") and "migrated_to" not in line, line
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            if chunk.get("usage") and not chunk["choices"]:
                usage = chunk["usage"]
            for choice in chunk["choices"]:
                tokens.extend(choice.get("token_ids") or [])
                if chat:
                    text += (choice.get("delta") or {}).get("content") or ""
                else:
                    text += choice["text"]
                finish = choice.get("finish_reason") or finish
    return {"tokens": tokens, "text": text, "usage": usage, "finish": finish, "headers": headers}


def completion(prompt: list[int], sampling: dict[str, Any], stream: bool) -> dict[str, Any]:
    body: dict[str, Any] = {
        "prompt": prompt,
        "max_tokens": MAX_TOKENS,
        "ignore_eos": True,
        "return_token_ids": True,
        "stream": stream,
        **sampling,
    }
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


def same_output(got: dict[str, Any], expected: dict[str, Any]) -> None:
    assert got["tokens"] == expected["tokens"]
    assert got["text"] == expected["text"]
    assert got["finish"] == expected["finish"]
    for key in ("prompt_tokens", "completion_tokens", "total_tokens"):
        assert got["usage"][key] == expected["usage"][key], (got["usage"], expected["usage"])


def metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    return 0.0


async def handoffs(client: httpx.AsyncClient, proxy: RunningProxy) -> dict[str, float]:
    text = (await client.get(f"{proxy.url}/metrics")).text
    found = {
        outcome: metric(text, f'kvherd_pd_handoffs_total{{outcome="{outcome}"}}')
        for outcome in ("ok", "fallback", "failed")
    }
    found["deduplicated"] = metric(text, 'kvherd_pd_handoff_blocks_total{kind="deduplicated"}')
    found["sent"] = metric(text, 'kvherd_pd_handoff_blocks_total{kind="sent"}')
    found["bytes_count"] = metric(text, "kvherd_pd_handoff_bytes_count")
    return found


@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "plain"])
@pytest.mark.parametrize("sampling", [GREEDY, SEEDED], ids=["greedy", "seeded"])
async def test_pd_completion_is_bit_identical_to_colocated(
    proxy: RunningProxy, pd_pair: list[AgentProcess], sampling: dict[str, Any], stream: bool
) -> None:
    prefill, _ = pd_pair
    prompt = fresh_prompt()
    async with httpx.AsyncClient(timeout=60) as client:
        before = await handoffs(client, proxy)
        got = await run(client, proxy.url, completion(prompt, sampling, stream))
        after = await handoffs(client, proxy)
        # Colocated: the whole request on one agent.
        expected = await run(client, prefill.url, completion(prompt, sampling, stream))
        same_output(got, expected)
        assert len(got["tokens"]) == MAX_TOKENS
        assert after["ok"] == before["ok"] + 1, after
        assert after["bytes_count"] == before["bytes_count"] + 1
        assert "x-kvherd-handoff" not in got["headers"]
        # The request was prefilled on the prefill agent (first token from there) and finished
        # on the decode agent: the router's accounting followed it.
        assert got["headers"]["x-kvherd-instance"] == proxy_id(proxy, prefill)
    await assert_agents_clean(pd_pair)


def proxy_id(proxy: RunningProxy, agent: AgentProcess) -> str:
    return next(i for i, inst in proxy.fleet.instances.items() if inst.url == agent.url)


@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "plain"])
async def test_pd_chat_is_bit_identical_to_colocated(
    proxy: RunningProxy, pd_pair: list[AgentProcess], stream: bool
) -> None:
    prefill, _ = pd_pair
    rng = random.Random(1000 + int(stream))
    words = " ".join(f"w{rng.randrange(10**6)}" for _ in range(60))  # ~400 byte tokens
    body: dict[str, Any] = {
        "messages": [{"role": "user", "content": f"Summarise: {words}"}],
        "max_tokens": MAX_TOKENS,
        "ignore_eos": True,
        "stream": stream,
        **SEEDED,
    }
    if stream:
        body["stream_options"] = {"include_usage": True}
    async with httpx.AsyncClient(timeout=60) as client:
        before = await handoffs(client, proxy)
        got = await run(client, proxy.url, body, chat=True)
        after = await handoffs(client, proxy)
        expected = await run(client, prefill.url, body, chat=True)
    same_output(got, expected)
    assert after["ok"] == before["ok"] + 1, after
    await assert_agents_clean(pd_pair)


async def test_shared_prefix_handoff_sends_only_missing_blocks(
    proxy: RunningProxy, pd_pair: list[AgentProcess]
) -> None:
    shared = fresh_prompt()
    async with httpx.AsyncClient(timeout=60) as client:
        first = await handoffs(client, proxy)
        await run(client, proxy.url, completion(shared + fresh_prompt()[:8], GREEDY, True))
        second = await handoffs(client, proxy)
        # The decode agent now caches the shared blocks; a new long suffix is disaggregated
        # again and only its own blocks move.
        await run(client, proxy.url, completion(shared + fresh_prompt(), GREEDY, True))
        third = await handoffs(client, proxy)
    assert second["ok"] == first["ok"] + 1 and third["ok"] == second["ok"] + 1, third
    assert second["deduplicated"] == first["deduplicated"]
    shared_blocks = PROMPT_TOKENS // 16
    assert third["deduplicated"] - second["deduplicated"] >= shared_blocks
    assert third["sent"] - second["sent"] < second["sent"] - first["sent"] + PROMPT_TOKENS // 16
    await assert_agents_clean(pd_pair)


async def test_roles_are_visible_in_state_admin_and_metrics(
    proxy: RunningProxy, pd_pair: list[AgentProcess]
) -> None:
    prefill, decode = pd_pair
    async with httpx.AsyncClient(timeout=30) as client:
        assert (await client.get(f"{prefill.url}/kvherd/v1/state")).json()["role"] == "prefill"
        assert (await client.get(f"{decode.url}/kvherd/v1/state")).json()["role"] == "decode"
        listed = (await client.get(f"{proxy.admin_url}/admin/v1/instances", headers=ADMIN)).json()
        roles = {item["url"]: item["role"] for item in listed["data"]}
        assert roles == {prefill.url: "prefill", decode.url: "decode"}
        text = (await client.get(f"{proxy.url}/metrics")).text
        pid, did = proxy_id(proxy, prefill), proxy_id(proxy, decode)
        assert f'kvherd_instance_role{{instance="{pid}",role="prefill"}} 1.0' in text
        assert f'kvherd_instance_role{{instance="{did}",role="decode"}} 1.0' in text


async def test_short_prompt_stays_on_the_decode_instance(
    proxy: RunningProxy, pd_pair: list[AgentProcess]
) -> None:
    _, decode = pd_pair
    async with httpx.AsyncClient(timeout=60) as client:
        before = await handoffs(client, proxy)
        got = await run(client, proxy.url, completion(fresh_prompt()[:40], GREEDY, True))
        after = await handoffs(client, proxy)
    assert got["headers"]["x-kvherd-instance"] == proxy_id(proxy, decode)
    assert after == before  # no handoff was asked for


# -- faults ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def small_decode() -> Iterator[AgentProcess]:
    """A decode agent too small to take a 320-token request (it refuses the reservation)."""
    with agent_process("--role", "decode", "--num-gpu-blocks", "12", kv_events=True) as agent:
        yield agent


@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "plain"])
async def test_refused_handoff_decodes_on_the_prefill_instance(
    pd_pair: list[AgentProcess], small_decode: AgentProcess, stream: bool
) -> None:
    prefill, _ = pd_pair
    prompt = fresh_prompt()
    async with running_proxy([prefill, small_decode], *FLAGS) as proxy:
        await roles_known(proxy, 2)
        async with httpx.AsyncClient(timeout=60) as client:
            got = await run(client, proxy.url, completion(prompt, SEEDED, stream))
            counts = await handoffs(client, proxy)
            expected = await run(client, prefill.url, completion(prompt, SEEDED, stream))
    same_output(got, expected)
    assert counts["fallback"] == 1 and counts["ok"] == 0, counts
    await assert_agents_clean([prefill, small_decode])


@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "plain"])
async def test_dead_decode_instance_is_invisible(pd_pair: list[AgentProcess], stream: bool) -> None:
    prefill, _ = pd_pair
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens: the handoff cannot connect
    prompt = fresh_prompt()
    flags = (*FLAGS, "--health-interval", "60", "--instance", f"{dead},role=decode,id=gone")
    async with running_proxy([prefill], *flags) as proxy:
        await roles_known(proxy, 2)
        async with httpx.AsyncClient(timeout=60) as client:
            got = await run(client, proxy.url, completion(prompt, GREEDY, stream))
            counts = await handoffs(client, proxy)
            expected = await run(client, prefill.url, completion(prompt, GREEDY, stream))
    same_output(got, expected)
    assert counts["fallback"] == 1, counts
    await assert_agents_clean([prefill])


@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "plain"])
async def test_dead_prefill_instance_is_retried_on_the_decode_instance(
    pd_pair: list[AgentProcess], stream: bool
) -> None:
    _, decode = pd_pair
    dead = f"http://127.0.0.1:{free_port()}"
    prompt = fresh_prompt()
    flags = (*FLAGS, "--health-interval", "60", "--instance", f"{dead},role=prefill,id=gone")
    async with running_proxy([decode], *flags) as proxy:
        await roles_known(proxy, 2)
        async with httpx.AsyncClient(timeout=60) as client:
            got = await run(client, proxy.url, completion(prompt, SEEDED, stream))
            expected = await run(client, decode.url, completion(prompt, SEEDED, stream))
    same_output(got, expected)
    assert got["headers"]["x-kvherd-instance"] == proxy_id(proxy, decode)
    await assert_agents_clean([decode])


async def test_colocated_fleet_is_not_paired() -> None:
    """A fleet of mixed agents never asks for a handoff (the P/D path stays off)."""
    with agents(2) as mixed:
        async with running_proxy(mixed, *FLAGS) as proxy:
            async with httpx.AsyncClient(timeout=60) as client:
                got = await run(client, proxy.url, completion(fresh_prompt(), GREEDY, True))
                counts = await handoffs(client, proxy)
            assert not proxy.fleet.cluster.disaggregated
    assert len(got["tokens"]) == MAX_TOKENS
    assert counts["ok"] == counts["fallback"] == counts["failed"] == 0


async def test_instance_role_override(pd_pair: list[AgentProcess]) -> None:
    """``--instance URL,role=mixed`` wins over the role the agent reports."""
    prefill, decode = pd_pair
    argv = [f"{instance_arg(prefill)},role=mixed", f"{instance_arg(decode)},role=mixed"]
    flags = [*FLAGS]
    for spec in argv:
        flags += ["--instance", spec]
    async with running_proxy([], *flags) as proxy:
        async with httpx.AsyncClient(timeout=30) as client:
            for _ in range(20):  # reports that name roles arrive; the override stays
                await client.get(f"{proxy.url}/health")
        assert set(proxy.fleet.roles().values()) == {"mixed"}
        assert not proxy.fleet.cluster.disaggregated


def test_up_starts_prefill_and_decode_agents() -> None:
    """``kvherd up --prefill 1 --decode 1``: roles registered, a long prompt handed off."""
    from test_up import _wait_ready

    port, admin_port = free_port(), free_port()
    env = {**os.environ, "KVHERD_ADMIN_TOKEN": TOKEN}
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvherd", "up", "--prefill", "1", "--decode", "1",
         "--port", str(port), "--admin-port", str(admin_port), "--log-level", "warning",
         "--migration-policy", "none", "--stop-timeout", "20"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )  # fmt: skip
    try:
        _wait_ready(proc, timeout=240)
        admin = f"http://127.0.0.1:{admin_port}/admin/v1/instances"
        listed = httpx.get(admin, headers=ADMIN, timeout=10).json()["data"]
        roles = {item["instance_id"]: item["role"] for item in listed}
        assert roles == {"agent-0": "prefill", "agent-1": "decode"}
        base = f"http://127.0.0.1:{port}"
        body = {"prompt": fresh_prompt(), "max_tokens": 200, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=60) as response:
            assert response.status_code == 200
            assert response.read().endswith(b"data: [DONE]\n\n")
        text = httpx.get(f"{base}/metrics", timeout=10).text
        assert metric(text, 'kvherd_pd_handoffs_total{outcome="ok"}') == 1.0
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0


@pytest.fixture(scope="module")
def second_prefill() -> Iterator[AgentProcess]:
    with agent_process("--role", "prefill", kv_events=True) as agent:
        yield agent


async def test_two_prefill_instances_hand_off_to_one_decode_instance_at_once(
    pd_pair: list[AgentProcess], second_prefill: AgentProcess
) -> None:
    prefill, decode = pd_pair
    fleet = [prefill, second_prefill, decode]
    prompts = [fresh_prompt() for _ in range(4)]

    def long(prompt: list[int]) -> dict[str, Any]:
        return {**completion(prompt, SEEDED, True), "max_tokens": 400}

    async with running_proxy(fleet, *FLAGS) as proxy:
        await roles_known(proxy, 3)
        async with httpx.AsyncClient(timeout=120) as client:
            got = await asyncio.gather(*(run(client, proxy.url, long(p)) for p in prompts))
            counts = await handoffs(client, proxy)
            served = {r["headers"]["x-kvherd-instance"] for r in got}
            expected = [await run(client, decode.url, long(p)) for p in prompts]
    for one, reference in zip(got, expected, strict=True):
        same_output(one, reference)
    assert counts["ok"] == 4 and counts["fallback"] == 0, counts
    assert served == {proxy_id(proxy, prefill), proxy_id(proxy, second_prefill)}
    await assert_agents_clean(fleet)


async def test_handoff_header_needs_the_fleet_token() -> None:
    """The OpenAI routes are open: only a caller with the fleet token may ask for a handoff."""
    token = "pd-fleet-secret"
    with agent_process("--role", "prefill", "--fleet-token", token) as agent:
        body = completion(fresh_prompt(), GREEDY, False)
        nowhere = {"X-Kvherd-Handoff": f"http://127.0.0.1:{free_port()}"}
        async with httpx.AsyncClient(timeout=60) as client:
            refused = await client.post(f"{agent.url}/v1/completions", json=body, headers=nowhere)
            assert refused.status_code == 401, refused.text
            assert refused.json()["error"]["code"] == "invalid_fleet_token"
            auth = {**nowhere, "Authorization": f"Bearer {token}"}
            served = await client.post(f"{agent.url}/v1/completions", json=body, headers=auth)
            assert served.status_code == 200, served.text
            report = json.loads(served.headers["x-kvherd-handoff"])
            assert report["outcome"] == "fallback" and report["reason"] == "dst_failed", report
            state = await client.get(
                f"{agent.url}/kvherd/v1/state?check_integrity=true",
                headers={"Authorization": f"Bearer {token}"},
            )
            assert state.json()["integrity"] == "ok"
            assert state.json()["block_owners"] == []


async def handed_off(
    client: httpx.AsyncClient,
    prefill: AgentProcess,
    decode: AgentProcess | str,
    prompt: list[int],
    sampling: dict[str, Any] = SEEDED,
    max_tokens: int = MAX_TOKENS,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """A plain request sent to the prefill agent with the handoff header (as the proxy sends
    it): the output and the agent's handoff report."""
    body = {**completion(prompt, sampling, False), "max_tokens": max_tokens}
    dst = decode if isinstance(decode, str) else decode.url
    got = await client.post(
        f"{prefill.url}/v1/completions", json=body, headers={"X-Kvherd-Handoff": dst}
    )
    assert got.status_code == 200, got.text
    data = got.json()
    output = {
        "tokens": data["choices"][0]["token_ids"],
        "text": data["choices"][0]["text"],
        "usage": data["usage"],
        "finish": data["choices"][0]["finish_reason"],
    }
    return output, json.loads(got.headers["x-kvherd-handoff"])


async def test_prefill_agent_reserves_at_admission_then_hands_off_in_one_stop_and_copy_stage(
    pd_pair: list[AgentProcess],
) -> None:
    """Stage 0 reserves on the decode agent at admission (it copies nothing); a prompt prefilled
    in one chunk and held at its first token then moves in one stop-and-copy stage."""
    prefill, decode = pd_pair
    prompt = fresh_prompt()
    async with httpx.AsyncClient(timeout=60) as client:
        got, report = await handed_off(client, prefill, decode, prompt)
        expected = await run(client, prefill.url, completion(prompt, SEEDED, False))
    assert report["outcome"] == "ok", report
    assert report["stages"] == 2, report
    assert report["blocks_sent"] + report["blocks_skipped"] == -(-PROMPT_TOKENS // 16), report
    assert report["final_blocks"] == report["blocks_sent"], report
    same_output(got, expected)
    await assert_agents_clean(pd_pair)


async def test_handoffs_out_of_one_prefill_agent_run_concurrently(
    pd_pair: list[AgentProcess],
) -> None:
    """Requests prefilled together leave together (up to MAX_HANDOFFS_OUT at once), each in one
    stop-and-copy stage after its reservation, with the outputs a colocated run gives."""
    prefill, decode = pd_pair
    prompts = [fresh_prompt() for _ in range(4)]
    async with httpx.AsyncClient(timeout=120) as client:
        results = await asyncio.gather(*(handed_off(client, prefill, decode, p) for p in prompts))
        expected = [await run(client, prefill.url, completion(p, SEEDED, False)) for p in prompts]
    reports = [report for _, report in results]
    assert all(r["outcome"] == "ok" and r["stages"] == 2 for r in reports), reports
    assert max(r["in_flight"] for r in reports) >= 2, reports
    for (got, _), reference in zip(results, expected, strict=True):
        same_output(got, reference)
    await assert_agents_clean(pd_pair)


# -- reservation before the prefill, chunks moving while the prefill computes ---------------------
CHUNK_PROMPT = 1024  # tokens; `small` agents prefill it in 8 chunks of 128
RESERVE = "/kvherd/v1/migration/reserve"


@pytest.fixture(scope="module")
def chunked_pair() -> Iterator[list[AgentProcess]]:
    """A prefill agent with a chunked prefill (128 tokens a step, a model slow enough that a
    1024-token prompt takes several steps) and its decode agent."""
    model = ("--model", "small", "--torch-threads", "1")
    with contextlib.ExitStack() as stack:
        prefill = stack.enter_context(
            agent_process("--role", "prefill", *model, "--max-num-batched-tokens", "128")
        )
        decode = stack.enter_context(agent_process("--role", "decode", *model))
        yield [prefill, decode]


def long_prompt() -> list[int]:
    rng = random.Random(next(_prompts))
    return [rng.randrange(3, 250) for _ in range(CHUNK_PROMPT)]


@pytest.mark.parametrize("sampling", [GREEDY, SEEDED], ids=["greedy", "seeded"])
async def test_chunked_prefill_blocks_move_while_later_chunks_compute(
    chunked_pair: list[AgentProcess], sampling: dict[str, Any]
) -> None:
    prefill, decode = chunked_pair
    async with httpx.AsyncClient(timeout=120) as client:
        # The pair's transport is set up by a first handoff (its rendezvous is not the point).
        await handed_off(client, prefill, decode, long_prompt()[:200], sampling, 2)
        prompt = long_prompt()
        got, report = await handed_off(client, prefill, decode, prompt, sampling, 16)
        expected = await run(
            client, prefill.url, {**completion(prompt, sampling, False), "max_tokens": 16}
        )
    assert report["outcome"] == "ok", report
    # Stage 0 at admission, at least one live stage of full blocks while later chunks computed,
    # the stop-and-copy of the rest at the first token: every block once.
    assert report["stages"] >= 3, report
    assert report["blocks_sent"] + report["blocks_skipped"] == CHUNK_PROMPT // 16, report
    assert report["final_blocks"] < report["blocks_sent"], report
    same_output(got, expected)
    await assert_agents_clean(chunked_pair)


async def test_chunked_prefill_through_the_proxy_streams_bit_identically(
    chunked_pair: list[AgentProcess],
) -> None:
    prefill, _ = chunked_pair
    prompt = long_prompt()
    async with running_proxy(chunked_pair, *FLAGS) as proxy:
        await roles_known(proxy, 2)
        async with httpx.AsyncClient(timeout=120) as client:
            got = await run(client, proxy.url, completion(prompt, SEEDED, True))
            counts = await handoffs(client, proxy)
            expected = await run(client, prefill.url, completion(prompt, SEEDED, True))
    same_output(got, expected)
    assert counts["ok"] == 1, counts
    await assert_agents_clean(chunked_pair)


async def test_reservation_refused_before_the_prefill_decodes_here(
    pd_pair: list[AgentProcess], small_decode: AgentProcess
) -> None:
    """The decode agent has no room for the prompt: its stage 0 at admission is refused, nothing
    is ever sent, and the request is prefilled and decoded on the prefill agent."""
    prefill, _ = pd_pair
    prompt = fresh_prompt()
    async with httpx.AsyncClient(timeout=60) as client:
        got, report = await handed_off(client, prefill, small_decode, prompt)
        expected = await run(client, prefill.url, completion(prompt, SEEDED, False))
    assert report["outcome"] == "fallback" and report["reason"] == "dst_refused", report
    assert report["stages"] == 0 and report["blocks_sent"] == 0, report
    same_output(got, expected)
    await assert_agents_clean([prefill, small_decode])


@pytest.mark.parametrize("when", ["after-reservation", "at-next-stage"])
async def test_decode_agent_dying_mid_handoff_is_invisible(
    chunked_pair: list[AgentProcess], when: str
) -> None:
    """The decode agent dies right after accepting the reservation at admission (while the
    prefill computes), or as the next stage (a live one mid-prefill, or the stop-and-copy) is
    reserved: the request is prefilled and decoded on the prefill agent, which holds nothing
    afterwards."""
    prefill, _ = chunked_pair
    prompt = long_prompt()
    decode_agent = agent_process("--role", "decode", "--model", "small", "--torch-threads", "1")
    with decode_agent as decode, FaultRelay(decode.url) as relay:
        kill = functools.partial(os.kill, decode.process.pid, signal.SIGKILL)
        if when == "after-reservation":
            fault = Fault(RESERVE, "after", kill, lambda body: body["stage"] == 0)
        else:
            fault = Fault(RESERVE, "before", kill, lambda body: body["stage"] > 0)
        relay.arm(fault)
        async with httpx.AsyncClient(timeout=120) as client:
            got, report = await handed_off(client, prefill, relay.url, prompt, SEEDED, 16)
            expected = await run(
                client, prefill.url, {**completion(prompt, SEEDED, False), "max_tokens": 16}
            )
        assert relay.fired.is_set()
    assert report["outcome"] == "fallback", report
    assert report["reason"] in ("dst_failed", "transfer_failed"), report
    same_output(got, expected)
    await assert_agents_clean([prefill])


async def test_client_gone_mid_prefill_frees_both_agents(chunked_pair: list[AgentProcess]) -> None:
    """The client leaves once the decode agent holds the reservation made at admission (the
    prefill still computing): the prefill agent aborts the request and the decode agent gets its
    blocks back."""
    prefill, decode = chunked_pair
    body = {**completion(long_prompt(), GREEDY, True), "max_tokens": 400}
    headers = {"X-Kvherd-Handoff": decode.url}
    async with (
        httpx.AsyncClient(timeout=60) as client,
        client.stream(
            "POST", f"{prefill.url}/v1/completions", json=body, headers=headers
        ) as response,
    ):
        assert response.status_code == 200  # the stream's headers come at admission
        for _ in range(1000):
            state = f"{decode.url}/kvherd/v1/state?check_integrity=true"
            if (await client.get(state)).json()["block_owners"]:
                break
            await asyncio.sleep(0.005)
        else:
            raise AssertionError("the decode agent never held the reservation")
    await assert_agents_clean(chunked_pair)


async def test_request_finished_at_its_first_token_frees_the_reservation(
    pd_pair: list[AgentProcess],
) -> None:
    """One output token: the request ends on the prefill agent before any handoff, and the
    reservation made at admission is given back."""
    prefill, decode = pd_pair
    prompt = fresh_prompt()
    async with httpx.AsyncClient(timeout=60) as client:
        got, report = await handed_off(client, prefill, decode, prompt, GREEDY, 1)
    assert report["outcome"] == "fallback", report
    assert report["reason"] in ("request_finished", "finished_first"), report
    assert len(got["tokens"]) == 1
    await assert_agents_clean(pd_pair)
