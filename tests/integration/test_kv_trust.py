"""Only the fleet writes KV: with a fleet token, no client and no rogue peer can make an agent load KV.

Two real agents share a fleet token. A pull header without the token is refused (401, nothing
pulled); with it, the pull lands and the output is the holder's, bit for bit. A rogue block server
(a real TCP server here, speaking the wire's frames without the token) cannot get a block accepted:
blocks without MACs or with wrong ones are dropped and the request recomputes, same output. The
agent's own block server refuses a request without the token's MAC. Through the proxy, a client's
``kv_transfer_params`` are stripped unless its API key allows them.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from agent_process import AgentProcess, agent_processes
from rogue_block_server import RogueBlockServer
from test_proxy import running_proxy

from kvherd.fleet_token import FLEET_TOKEN_ENV, auth_headers
from kvherd.kv_pull import PullError, fetch_blocks

pytestmark = pytest.mark.timeout(180)

TOKEN = "the-fleet-token"
FLEET = auth_headers(TOKEN)
BLOCK = 16
PROMPT = [(i * 13 + 1) % 250 for i in range(24 * BLOCK + 3)]  # 24 full blocks and a tail


@pytest.fixture(scope="module")
def pair() -> Iterator[list[AgentProcess]]:
    env = {FLEET_TOKEN_ENV: TOKEN}
    with agent_processes(2, "--block-size", str(BLOCK), "--pull-timeout", "2.0", kv_events=False,
                         env=env) as agents:  # fmt: skip
        yield agents


def state(agent: AgentProcess) -> dict[str, Any]:
    got = httpx.get(f"{agent.url}/kvherd/v1/state", params={"check_integrity": "true"},
                    headers=FLEET)  # fmt: skip
    assert got.status_code == 200, got.text
    return dict(got.json())


def complete(agent: AgentProcess, prompt: list[int], headers: dict[str, str]) -> httpx.Response:
    body = {"prompt": prompt, "max_tokens": 10, "temperature": 0.0}
    return httpx.post(f"{agent.url}/v1/completions", json=body, headers=headers, timeout=60)


def untrusted(agent: AgentProcess, kind: str) -> float:
    text = httpx.get(f"{agent.url}/metrics").text
    for line in text.splitlines():
        if line.startswith("kvherd_kv_untrusted_total{") and f'kind="{kind}"' in line:
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no kvherd_kv_untrusted_total for {kind}:\n{text}")


def cached(response: httpx.Response) -> int:
    return int(response.json()["usage"]["prompt_tokens_details"]["cached_tokens"])


def assert_clean(agent: AgentProcess) -> None:
    snapshot = state(agent)
    assert snapshot["integrity"] == "ok" and snapshot["block_owners"] == [], snapshot


def test_a_pull_header_needs_the_fleet_token(pair: list[AgentProcess]) -> None:
    holder, puller = pair
    prompt = [1, *PROMPT]
    expected = complete(holder, prompt, {})
    assert expected.status_code == 200, expected.text
    ask = {"X-Kvherd-Pull": f"{state(holder)['pull_address']} blocks=24"}
    before = untrusted(puller, "pull_header")
    refused = complete(puller, prompt, ask)
    assert refused.status_code == 401, refused.text
    assert refused.json()["error"]["code"] == "invalid_fleet_token"
    assert untrusted(puller, "pull_header") == before + 1
    wrong = complete(puller, prompt, {**ask, "Authorization": "Bearer not-the-token"})
    assert wrong.status_code == 401
    # Nothing was pulled: the puller computes the prompt itself.
    plain = complete(puller, [2, *PROMPT], {})
    assert plain.status_code == 200 and cached(plain) == 0
    landed = complete(puller, prompt, {**ask, **FLEET})
    assert landed.status_code == 200, landed.text
    assert landed.headers["x-kvherd-pull-outcome"].split()[0] == "landed"
    assert cached(landed) == 24 * BLOCK
    assert landed.json()["choices"][0]["text"] == expected.json()["choices"][0]["text"]
    assert_clean(holder)
    assert_clean(puller)


@pytest.mark.parametrize("claims_mac", [False, True], ids=["no-mac", "forged-mac"])
def test_a_rogue_block_server_cannot_land_a_block(
    pair: list[AgentProcess], claims_mac: bool
) -> None:
    holder, puller = pair
    prompt = [3 + claims_mac, *PROMPT]
    expected = complete(holder, prompt, {}).json()["choices"][0]["text"]
    rogue = RogueBlockServer(24, claims_mac)
    try:
        before = untrusted(puller, "pulled_block")
        got = complete(puller, prompt, {"X-Kvherd-Pull": f"{rogue.address} blocks=24", **FLEET})
        assert got.status_code == 200, got.text
        assert rogue.asked == 1
        assert got.headers["x-kvherd-pull-outcome"].split()[0] == "failed"
        assert cached(got) == 0  # recomputed: nothing of the junk is in its cache
        assert got.json()["choices"][0]["text"] == expected
        assert untrusted(puller, "pulled_block") == before + 1
        # The prompt's blocks now in its cache are its own: a second request hits them, same text.
        again = complete(puller, prompt, {})
        assert cached(again) == 24 * BLOCK and again.json()["choices"][0]["text"] == expected
    finally:
        rogue.close()
    assert_clean(puller)


def test_the_agents_block_server_refuses_a_request_without_the_mac(
    pair: list[AgentProcess],
) -> None:
    holder, _ = pair
    address = state(holder)["pull_address"]
    before = untrusted(holder, "block_request")
    with pytest.raises(PullError) as refused:
        fetch_blocks(address, "any-layout", [b"\0" * 32], 64, lambda i, b: None, 5.0)
    assert refused.value.reason == "refused"
    with pytest.raises(PullError):
        fetch_blocks(address, "any-layout", [b"\0" * 32], 64, lambda i, b: None, 5.0, "wrong")
    assert untrusted(holder, "block_request") == before + 2


async def test_the_proxy_strips_kv_transfer_params_unless_the_key_allows_them(
    pair: list[AgentProcess],
) -> None:
    flags = ("--fleet-token", TOKEN, "--api-key", "plain-key=plain",
             "--api-key", "ops-key=ops kv_transfer_params=allow")  # fmt: skip
    async with running_proxy(pair, *flags) as proxy, httpx.AsyncClient(timeout=60) as client:
        body = {"prompt": "hello", "max_tokens": 2, "temperature": 0.0,
                "kv_transfer_params": {"kvherd_pull": {"from": "tcp://10.9.9.9:1"}}}  # fmt: skip

        async def stripped() -> float:
            text = (await client.get(f"{proxy.url}/metrics")).text
            line = next(x for x in text.splitlines() if x.startswith("kvherd_kv_transfer_params_s"))
            return float(line.rsplit(" ", 1)[1])

        url = f"{proxy.url}/v1/completions"
        plain = await client.post(url, json=body, headers={"Authorization": "Bearer plain-key"})
        assert plain.status_code == 200, plain.text
        assert await stripped() == 1
        ops = await client.post(url, json=body, headers={"Authorization": "Bearer ops-key"})
        assert ops.status_code == 200, ops.text
        assert await stripped() == 1
