"""kvherd's routing tokens equal vLLM's own (``/tokenize``) on the chat corpus and completions.

kvherd's side is `scheduler.proxy.routing_tokens.prompt_token_ids` with the tokenizer ``kvherd
serve --tokenizer DIR`` loads, called in-process; vLLM's is a live server's ``/tokenize`` with the
same body. A chat request through kvherd then hits vLLM's cache exactly where kvherd says it does.
"""

from __future__ import annotations

from typing import Any

import pytest
from chat_corpus import CHATS, CHATS_RICH, COMPLETIONS, REFUSED
from vllm_fleet import (
    VLLM_BLOCK_SIZE,
    KvherdFactory,
    Prompts,
    VllmServer,
    assert_index_matches,
    chat,
)

from kvherd.wire import OpenAIError
from scheduler.proxy.routing_tokens import prompt_token_ids


def _vllm_tokens(server: VllmServer, body: dict[str, Any]) -> list[int]:
    status, answer = server.tokenize(body)
    assert status == 200, answer
    tokens: list[int] = answer["tokens"]
    return tokens


@pytest.mark.parametrize(("case", "body"), COMPLETIONS, ids=[c for c, _ in COMPLETIONS])
def test_completion_tokens_equal_vllm(
    vllm_pair: tuple[VllmServer, VllmServer], tokenizer: Any, case: str, body: dict[str, Any]
) -> None:
    ours = prompt_token_ids(body, False, tokenizer)
    prompt = body["prompt"]
    first = prompt[0] if isinstance(prompt, list) else prompt
    if isinstance(first, str):
        oracle = {"prompt": first, "add_special_tokens": body.get("add_special_tokens", True)}
        assert ours == _vllm_tokens(vllm_pair[0], oracle)
    else:  # token ids: vLLM computes on them as given
        assert ours == (first if isinstance(first, list) else prompt)


@pytest.mark.parametrize(
    ("case", "body"), CHATS + CHATS_RICH, ids=[c for c, _ in CHATS + CHATS_RICH]
)
def test_chat_tokens_equal_vllm(
    vllm_pair: tuple[VllmServer, VllmServer], tokenizer: Any, case: str, body: dict[str, Any]
) -> None:
    assert prompt_token_ids(body, True, tokenizer) == _vllm_tokens(vllm_pair[0], body)


@pytest.mark.parametrize(("case", "body"), REFUSED, ids=[c for c, _ in REFUSED])
def test_refused_chats_are_refused_by_both(
    vllm_pair: tuple[VllmServer, VllmServer], tokenizer: Any, case: str, body: dict[str, Any]
) -> None:
    status, answer = vllm_pair[0].tokenize(body)
    assert status == 400, answer
    with pytest.raises(OpenAIError) as refused:
        prompt_token_ids(body, True, tokenizer)
    assert refused.value.status == 400


def test_chat_through_kvherd_hits_what_kvherd_matched(
    vllm_pair: tuple[VllmServer, VllmServer],
    kvherd_fleet: KvherdFactory,
    tokenizer: Any,
    prompts: Prompts,
) -> None:
    """BOS once and vLLM's rendering: the repeat of a long chat lands on the instance that cached
    it, and kvherd's matched blocks are exactly vLLM's ``cached_tokens``."""
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": prompts.make("chat-system")},
        {"role": "developer", "content": [{"type": "text", "text": "be brief"}]},
        {
            "role": "user",
            "content": [{"type": "text", "text": "hi"}, {"type": "text", "text": "!"}],
        },
    ]
    ours = prompt_token_ids({"messages": messages}, True, tokenizer)
    with kvherd_fleet() as proxy:
        first = chat(proxy.url, messages)
        assert first.prompt_tokens == len(ours)
        assert first.cached_tokens == 0
        assert_index_matches(proxy, *vllm_pair)
        before = proxy.matched_blocks()
        again = chat(proxy.url, messages)
        blocks = len(ours) // VLLM_BLOCK_SIZE
        assert (again.instance, again.cached_tokens) == (first.instance, blocks * VLLM_BLOCK_SIZE)
        assert proxy.matched_blocks() - before == blocks
