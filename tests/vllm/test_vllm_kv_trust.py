"""Only the fleet writes KV into real vLLM: the proxy strips clients' ``kv_transfer_params``, and a
connector with the fleet token neither loads from nor serves to a peer without it.

Through ``kvherd serve`` (tenants by API key) a client's ``kv_transfer_params`` naming a peer are
dropped unless its key has ``kv_transfer_params=allow``: the peer (a TCP listener here) is never
asked. A vLLM server whose connector has the fleet token (``KVHERD_FLEET_TOKEN`` in its
environment), asked directly to load from a rogue block server, loads nothing (the junk fails the
MAC, the request recomputes: same text, 0 cached tokens); its own block server refuses a request
without the token's MAC, counted in ``vllm:kvherd_connector_refused_requests_total``.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from rogue_block_server import RogueBlockServer
from vllm_fleet import KvherdFactory, Prompts, VllmServer, VllmSpec, poll_until, vllm_servers

from kvherd.fleet_token import FLEET_TOKEN_ENV
from kvherd.kv_pull import PullError, fetch_blocks

TOKEN = "vllm-fleet-token"


@pytest.fixture
def rogue() -> Iterator[RogueBlockServer]:
    server = RogueBlockServer(2, claims_mac=True)
    yield server
    server.close()


def _complete(url: str, prompt: str, headers: dict[str, str] | None = None,
              **extra: Any) -> dict[str, Any]:  # fmt: skip
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0.0, **extra}
    r = httpx.post(
        url + "/v1/completions", json=body, headers=headers, timeout=120, trust_env=False
    )
    assert r.status_code == 200, r.text
    return dict(r.json())


def _pull(address: str) -> dict[str, Any]:
    return {"kv_transfer_params": {"kvherd_pull": {"from": address}}}


def test_the_proxy_strips_a_clients_kv_transfer_params(
    kvherd_fleet: KvherdFactory, prompts: Prompts, rogue: RogueBlockServer
) -> None:
    keys = ("--api-key", "plain-key=plain", "--api-key", "ops-key=ops kv_transfer_params=allow")
    prompt = prompts.make("trust-strip", blocks=2)
    with kvherd_fleet(*keys) as proxy:
        answer = _complete(proxy.url, prompt, {"Authorization": "Bearer plain-key"},
                           **_pull(rogue.address))  # fmt: skip
        assert rogue.asked == 0  # vLLM never heard of the peer
        assert "kvherd_pull" not in (answer.get("kv_transfer_params") or {})
        assert proxy.metric("kvherd_kv_transfer_params_stripped_total") == 1
        # A key the operator allows keeps them: the connector is asked (and fails on the junk).
        _complete(proxy.url, prompts.make("trust-allowed", blocks=2),
                  {"Authorization": "Bearer ops-key"}, **_pull(rogue.address))  # fmt: skip
        assert rogue.asked == 1
        assert proxy.metric("kvherd_kv_transfer_params_stripped_total") == 1


@pytest.fixture(scope="module")
def trusted(vllm_python: str, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
            ) -> Iterator[VllmServer]:  # fmt: skip
    spec = VllmSpec("t", connector=True, env=((FLEET_TOKEN_ENV, TOKEN),))
    with vllm_servers(vllm_python, tiny_model, [spec], tmp_path_factory.mktemp("t_logs")) as (t,):
        yield t


def test_a_connector_with_the_fleet_token_loads_nothing_from_a_rogue_peer(
    trusted: VllmServer, prompts: Prompts, rogue: RogueBlockServer
) -> None:
    prompt = prompts.make("trust-rogue", blocks=2)
    answer = _complete(trusted.url, prompt, **_pull(rogue.address))
    assert rogue.asked == 1
    assert answer["kv_transfer_params"] == {"kvherd_pull": {"outcome": "failed", "tokens": 0}}
    assert int(answer["usage"]["prompt_tokens_details"]["cached_tokens"] or 0) == 0
    reference = _complete(trusted.url, prompt, cache_salt="trust-rogue-reference")
    assert answer["choices"][0]["text"] == reference["choices"][0]["text"]


def test_a_connector_with_the_fleet_token_serves_no_block_without_its_mac(
    trusted: VllmServer, prompts: Prompts
) -> None:
    assert trusted.block_address is not None
    for token in (None, "not-the-token"):
        with pytest.raises(PullError) as refused:
            fetch_blocks(trusted.block_address, "x", [b"\0" * 32], 64, lambda i, b: None, 10.0,
                         token)  # fmt: skip
        assert refused.value.reason == "refused"
    # The workers' connector stats reach /metrics with an engine step's output: take one.
    _complete(trusted.url, prompts.make("trust-step", blocks=1))

    def counted() -> bool:
        text = httpx.get(trusted.url + "/metrics", timeout=10, trust_env=False).text
        return any(
            line.startswith("vllm:kvherd_connector_refused_requests_total")
            and float(line.rpartition(" ")[2]) >= 2
            for line in text.splitlines()
        )

    assert poll_until(counted, timeout_s=30.0), trusted.log()
