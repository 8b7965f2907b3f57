"""Salted requests against real vLLM: ``cache_salt`` and ``--api-key`` tenancy.

vLLM folds a request's ``cache_salt`` into its first block's hash (and so into every block after
it) and reports it in the events' ``extra_keys``; kvherd must match a salted request exactly where
vLLM will hit, and never match an unsalted request (or another tenant's) against salted blocks.
"""

from __future__ import annotations

from vllm_fleet import (
    VLLM_BLOCK_SIZE,
    KvherdFactory,
    Prompts,
    VllmServer,
    assert_index_matches,
    complete,
)


def _prefix(prompts: Prompts, prompt: str, blocks: int) -> str:
    """The longest word prefix of `prompt` that still has `blocks` full blocks and a bit more."""
    words = prompt.split(" ")
    while prompts.num_tokens(" ".join(words)) > blocks * VLLM_BLOCK_SIZE + VLLM_BLOCK_SIZE // 2:
        words.pop()
    return " ".join(words)


def test_cache_salt_matches_exactly_what_vllm_hits(
    vllm_pair: tuple[VllmServer, VllmServer], kvherd_fleet: KvherdFactory, prompts: Prompts
) -> None:
    """``a`` holds the whole prompt under a salt, ``b`` only its first two blocks unsalted. The
    unsalted prompt must go to ``b`` (the salted blocks are no match for it), the salted one to
    ``a``, each with the hit vLLM then reports."""
    a, b = vllm_pair
    prompt = prompts.make("salt", blocks=5)
    blocks = prompts.full_blocks(prompt)
    assert complete(a.url, prompt, cache_salt="tenant-x").cached_tokens == 0
    assert complete(b.url, _prefix(prompts, prompt, 2)).cached_tokens == 0
    with kvherd_fleet() as proxy:
        before = proxy.matched_blocks()
        unsalted = complete(proxy.url, prompt)
        assert (unsalted.instance, unsalted.cached_tokens) == ("b", 2 * VLLM_BLOCK_SIZE)
        assert proxy.matched_blocks() - before == 2
        before = proxy.matched_blocks()
        salted = complete(proxy.url, prompt, cache_salt="tenant-x")
        assert (salted.instance, salted.cached_tokens) == ("a", blocks * VLLM_BLOCK_SIZE)
        assert proxy.matched_blocks() - before == blocks
        before = proxy.matched_blocks()
        other = complete(proxy.url, prompt, cache_salt="tenant-y")
        assert other.cached_tokens == 0
        assert proxy.matched_blocks() - before == 0


def test_api_key_tenants_route_cache_aware_and_stay_apart(
    vllm_pair: tuple[VllmServer, VllmServer], kvherd_fleet: KvherdFactory, prompts: Prompts
) -> None:
    """With ``--api-key`` every request is salted with its tenant's salt: a tenant's repeat hits
    its own blocks where kvherd sends it, and another tenant never hits (nor matches) them."""
    prompt = prompts.make("tenancy")
    blocks = prompts.full_blocks(prompt)
    with kvherd_fleet("--api-key", "key-alice=alice", "--api-key", "key-bob=bob") as proxy:
        alice = complete(proxy.url, prompt, api_key="key-alice")
        assert alice.cached_tokens == 0
        assert_index_matches(proxy, *vllm_pair)
        before = proxy.matched_blocks()
        bob = complete(proxy.url, prompt, api_key="key-bob")
        assert bob.cached_tokens == 0
        assert proxy.matched_blocks() - before == 0
        assert_index_matches(proxy, *vllm_pair)
        for key, first in (("key-alice", alice), ("key-bob", bob)):
            before = proxy.matched_blocks()
            again = complete(proxy.url, prompt, api_key=key)
            assert (again.instance, again.cached_tokens) == (
                first.instance,
                blocks * VLLM_BLOCK_SIZE,
            )
            assert proxy.matched_blocks() - before == blocks
