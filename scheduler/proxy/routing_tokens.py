"""The token ids a request is routed by: what the engine will compute for its prompt.

Contract:
- `prompt_token_ids(body, chat, tokenizer)` returns the prompt's token ids for a completions body
  (text, token ids, or a batch of either: the first prompt routes) or a chat body (the tokenizer's
  chat template rendered, then encoded). Bodies that cannot be routed raise `OpenAIError` (400) naming
  the field.
"""

from __future__ import annotations

from typing import Any

from kvherd.tokenizer import Tokenizer
from kvherd.wire import OpenAIError


def prompt_token_ids(body: dict[str, Any], chat: bool, tokenizer: Tokenizer) -> list[int]:
    """Token ids the routing decision hashes; raises `OpenAIError` for bodies it cannot route."""
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise OpenAIError(400, "'messages' must be a non-empty list", param="messages")
        try:
            text = tokenizer.apply_chat_template(messages)
        except ValueError as exc:
            raise OpenAIError(400, str(exc), param="messages") from exc
        return tokenizer.encode(text)
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return tokenizer.encode(prompt)
    if isinstance(prompt, list) and prompt:
        first = prompt[0]
        if isinstance(first, str):  # a batch of prompts: route on the first
            if all(isinstance(p, str) for p in prompt):
                return tokenizer.encode(first)
        elif isinstance(first, int) and not isinstance(first, bool):
            if all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in prompt):
                return prompt
        elif (
            isinstance(first, list)
            and first
            and all(isinstance(p, list) for p in prompt)
            and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in first)
        ):
            return first
    raise OpenAIError(
        400,
        "'prompt' must be a non-empty string, list of token ids, or list of either",
        param="prompt",
    )
