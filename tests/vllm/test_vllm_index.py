"""kvherd's precise prefix index, fed by real vLLM KV events, in both publisher topologies.

Server ``a`` binds its PUB (kvherd connects), server ``b`` connects its PUB to the SUB kvherd binds
(``--kv-events-bind``). Prompts are sent straight to vLLM where the point is that only vLLM's
events can have told kvherd about them (kvherd's own routing history would not).
"""

from __future__ import annotations

import pytest
from vllm_fleet import (
    VLLM_BLOCK_SIZE,
    KvherdFactory,
    Prompts,
    VllmServer,
    assert_index_matches,
    chat,
    complete,
    indexed_blocks,
)

TOPOLOGIES = pytest.mark.parametrize(
    ("name", "shared_bind"),
    [("a", True), ("b", True), ("b", False)],
    ids=["pub-binds", "pub-connects-shared-sub", "pub-connects-own-sub"],
)


def test_index_holds_what_vllm_events_say(
    vllm_pair: tuple[VllmServer, VllmServer], kvherd_fleet: KvherdFactory, prompts: Prompts
) -> None:
    a, b = vllm_pair
    with kvherd_fleet() as proxy:
        for i in range(3):
            complete(proxy.url, prompts.make(f"index-{i}"))
        chat(proxy.url, [{"role": "user", "content": prompts.make("index-chat")}])
        for server in (a, b):
            complete(server.url, prompts.make(f"index-direct-{server.spec.name}"))
        assert_index_matches(proxy, a, b)
        for server in (a, b):
            blocks = indexed_blocks(proxy, server.spec.name)
            assert blocks is not None and blocks >= 4, proxy.instance(server.spec.name)
            stream = proxy.instance(server.spec.name)["kv_events"]["stream"]
            assert stream["batches"] > 0 and stream["history_lost"] == 0, stream


@TOPOLOGIES
def test_prompt_cached_behind_kvherds_back_routes_to_that_instance(
    vllm_pair: tuple[VllmServer, VllmServer],
    kvherd_fleet: KvherdFactory,
    prompts: Prompts,
    name: str,
    shared_bind: bool,
) -> None:
    a, b = vllm_pair
    server = {"a": a, "b": b}[name]
    prompt = prompts.make(f"route-{name}-{shared_bind}")
    with kvherd_fleet(shared_bind=shared_bind) as proxy:
        assert complete(server.url, prompt).cached_tokens == 0  # only vLLM's events tell kvherd
        assert_index_matches(proxy, a, b)
        before = proxy.matched_blocks()
        served = complete(proxy.url, prompt)
        blocks = prompts.full_blocks(prompt)
        assert served.instance == name
        assert served.cached_tokens == blocks * VLLM_BLOCK_SIZE
        assert proxy.matched_blocks() - before == blocks  # kvherd's match is vLLM's hit


def test_replay_after_proxy_restart(
    vllm_pair: tuple[VllmServer, VllmServer], kvherd_fleet: KvherdFactory, prompts: Prompts
) -> None:
    """A restarted kvherd learns from vLLM's replay buffer what was cached before it subscribed:
    what it routed itself before the restart and what vLLM cached while no kvherd was running."""
    a, b = vllm_pair
    routed = prompts.make("restart-routed")
    with kvherd_fleet() as proxy:
        first = complete(proxy.url, routed)
        assert first.instance in ("a", "b")
    while_down = {s.spec.name: prompts.make(f"restart-down-{s.spec.name}") for s in (a, b)}
    for server in (a, b):  # no subscriber: b's PUB has no peer at all, a's has no SUB
        assert complete(server.url, while_down[server.spec.name]).cached_tokens == 0
    with kvherd_fleet() as proxy:  # its index equals vLLM's events before it is handed over
        for prompt, instance in [
            (routed, first.instance),
            *((p, n) for n, p in while_down.items()),
        ]:
            before = proxy.matched_blocks()
            served = complete(proxy.url, prompt)
            blocks = prompts.full_blocks(prompt)
            assert (served.instance, served.cached_tokens) == (instance, blocks * VLLM_BLOCK_SIZE)
            assert proxy.matched_blocks() - before == blocks
        for server in (a, b):
            stream = proxy.instance(server.spec.name)["kv_events"]["stream"]
            assert stream["history_lost"] == 0, stream
            assert "malformed replay reply" not in proxy.log()
