"""The token ids a request is routed by: what the engine will compute for its prompt.

Contract:
- `prompt_token_ids(body, chat, tokenizer)` returns the prompt's token ids exactly as vLLM computes
  them, so the block hashes match the ones its KV events report.
- Completions: a text prompt is encoded with the body's ``add_special_tokens`` (default true, as in
  vLLM); token ids are taken as they are; of a batch (texts or token-id lists) the first prompt
  routes.
- Chat: `kvherd.chat_render.parse_chat` collects the template inputs (messages with their fields,
  ``tools``, ``chat_template_kwargs``, ``add_generation_prompt``, ``continue_final_message``,
  ``documents``, ``reasoning_effort``), the tokenizer renders them and encodes the text with the
  body's ``add_special_tokens`` (default false: BOS comes from the template, once).
- Bodies that cannot be routed raise `OpenAIError` (400) naming the field, token ids beyond what a
  block hash holds (`kvherd.block_hash.MAX_TOKEN_ID`) included; the instance checks them against
  its vocabulary.
"""

from __future__ import annotations

from typing import Any

from kvherd.block_hash import MAX_TOKEN_ID
from kvherd.chat_render import ChatRenderError, parse_chat
from kvherd.tokenizer import Tokenizer, chat_token_ids
from kvherd.wire import OpenAIError


def prompt_token_ids(body: dict[str, Any], chat: bool, tokenizer: Tokenizer) -> list[int]:
    """Token ids the routing decision hashes; raises `OpenAIError` for bodies it cannot route."""
    if chat:
        try:
            return chat_token_ids(tokenizer, parse_chat(body))
        except ChatRenderError as exc:
            raise OpenAIError(400, str(exc), param=exc.param) from exc
    special = body.get("add_special_tokens", True)
    if not isinstance(special, bool):
        raise OpenAIError(400, "'add_special_tokens' must be a boolean", param="add_special_tokens")
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return tokenizer.encode(prompt, special)
    if isinstance(prompt, list) and prompt:
        first = prompt[0]
        if isinstance(first, str):  # a batch of prompts: route on the first
            if all(isinstance(p, str) for p in prompt):
                return tokenizer.encode(first, special)
        elif _is_token_ids(prompt):
            return prompt
        elif all(isinstance(p, list) for p in prompt) and first and _is_token_ids(first):
            return first
    raise OpenAIError(
        400,
        "'prompt' must be a non-empty string, list of token ids (0 to 2**32 - 1), or list of either",
        param="prompt",
    )


def _is_token_ids(items: list[Any]) -> bool:
    return all(
        isinstance(t, int) and not isinstance(t, bool) and 0 <= t <= MAX_TOKEN_ID for t in items
    )
