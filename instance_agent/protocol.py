"""OpenAI-compatible request bodies and response/chunk builders.

Contract:
- `CompletionRequest` and `ChatCompletionRequest` are pydantic models of the bodies the agent accepts.
  Types are strict (a string is never coerced to a number); unknown fields are accepted and ignored, as
  vLLM and the OpenAI API do, so a proxy may add its own fields.
- `to_sampling_params` maps a body to the engine's `SamplingParams` and `check_supported` refuses, with a
  400 naming the field, every OpenAI feature the engine does not implement (``n`` > 1, ``best_of``,
  ``logprobs``, ``echo``, ``suffix``, penalties, ``logit_bias``, tools, structured output), so a client
  never silently gets something other than what it asked for.
- `resolve_prompt` turns a completions prompt (text, token ids, or a one-element batch of either) into
  text or validated token ids (each id in ``[0, vocab_size)``); `chat_prompt` checks chat messages and
  collects the chat template's inputs with `kvherd.chat_render` (as the proxy and vLLM do: any role,
  every message field, ``add_generation_prompt``, ``chat_template_kwargs``, ...).
- `prompt_token_ids` is the one prompt -> engine token ids path (chat template included, BOS once):
  the generation routes submit these ids and the render/tokenize routes (`compat_routes`) report
  them. `default_max_tokens` is the ``max_tokens`` a body without one gets.
- `error_from_validation` turns pydantic/FastAPI validation errors into a 400 (`kvherd.wire.OpenAIError`)
  naming the first offending field.
- The chunk and response builders produce exactly the JSON shapes of OpenAI/vLLM: ``text_completion``
  and ``chat.completion(.chunk)`` objects, ``usage`` with ``prompt_tokens_details.cached_tokens``.
  With ``return_token_ids`` (vLLM's flag) each choice also carries ``token_ids`` and each streamed chunk
  a ``kvherd`` field ``{"token_ids": [...], "index": i}`` (index of the chunk's first output token in
  the whole output), which lets a relay resume a stream exactly once.
- ``kvherd_continuation`` (a kvherd extension, `Continuation`) continues a streamed request whose
  instance was lost: the body is the original one, plus the tokens and text the client already has,
  the sampling seed, and the migration notice's ``resume`` object (stream id, created, ``from``).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Annotated, Any

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    Strict,
    StrictBool,
    StrictFloat,
    StrictInt,
)

from instance_agent.engine.core.request import InvalidRequestError, SamplingParams
from kvherd.chat_render import ChatPrompt, ChatRenderError, parse_chat
from kvherd.tokenizer import Tokenizer, chat_token_ids, lone_surrogate_at
from kvherd.wire import OpenAIError, bad_request

Number = StrictFloat | StrictInt


def _valid_unicode(text: str) -> str:
    # Refuse a lone surrogate here, naming the field (a 400): see `lone_surrogate_at`.
    at = lone_surrogate_at(text)
    if at is not None:
        raise ValueError(f"not valid Unicode: lone surrogate at {at}")
    return text


# Every string of a body: no coercion, and encodable (see `_valid_unicode`).
StrictStr = Annotated[str, Strict(), AfterValidator(_valid_unicode)]


def from_invalid_request(exc: InvalidRequestError) -> OpenAIError:
    return OpenAIError(400, exc.message, param=exc.param, code=exc.code)


def error_from_validation(errors: Sequence[Mapping[str, Any]]) -> OpenAIError:
    """A 400 for pydantic/FastAPI validation errors, naming the first offending field."""
    if not errors:
        return bad_request("invalid request body")
    first = errors[0]
    loc = [str(part) for part in first.get("loc", ()) if part != "body"]
    if first.get("type") == "json_invalid":
        detail = first.get("ctx", {}).get("error", first.get("msg", ""))
        return bad_request(f"request body is not valid JSON: {detail}", code="invalid_json")
    if not loc:
        if first.get("type") == "missing":
            return bad_request("request body is required")
        return bad_request("request body must be a JSON object")
    # Union members show up as extra loc parts (e.g. 'str', 'list[int]'); keep field names only.
    fields = [p for p in loc if not (p[:1].islower() and ("[" in p or p in _TYPE_NAMES))]
    param = ".".join(fields) or None
    msg = str(first.get("msg", "invalid value"))
    more = f" (and {len(errors) - 1} more errors)" if len(errors) > 1 else ""
    where = f"{param}: " if param else ""
    return bad_request(f"{where}{msg}{more}", param=param)


_TYPE_NAMES = {"str", "int", "float", "bool", "list", "dict", "none", "function-after"}


# -- request bodies --------------------------------------------------------------------------------
class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")
    include_usage: StrictBool | None = False
    continuous_usage_stats: StrictBool | None = False


class Continuation(BaseModel):
    """What a request had produced when its instance was lost (``kvherd_continuation``)."""

    model_config = ConfigDict(extra="forbid")
    output_token_ids: list[StrictInt]
    emitted_text: StrictStr = ""
    sampling_seed: StrictInt | None = None
    resume: dict[str, Any]


class _GenerationFields(BaseModel):
    """Fields shared by completions and chat completions."""

    model_config = ConfigDict(extra="allow")

    model: StrictStr | None = None
    max_tokens: StrictInt | None = None
    temperature: Number | None = None
    top_p: Number | None = None
    top_k: StrictInt | None = None
    seed: StrictInt | None = None
    stop: StrictStr | list[StrictStr] | None = None
    stop_token_ids: list[StrictInt] | None = None
    ignore_eos: StrictBool = False
    stream: StrictBool | None = False
    stream_options: StreamOptions | None = None
    n: StrictInt | None = 1
    presence_penalty: Number | None = None
    frequency_penalty: Number | None = None
    repetition_penalty: Number | None = None
    logit_bias: dict[str, Any] | None = None
    user: StrictStr | None = None
    cache_salt: StrictStr | None = None
    priority: StrictInt = 0
    return_token_ids: StrictBool | None = False
    kvherd_continuation: Continuation | None = None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options is not None and self.stream_options.include_usage)


class CompletionRequest(_GenerationFields):
    prompt: StrictStr | list[StrictInt] | list[StrictStr] | list[list[StrictInt]]
    best_of: StrictInt | None = None
    logprobs: StrictInt | None = None
    echo: StrictBool | None = False
    suffix: StrictStr | None = None
    add_special_tokens: StrictBool = True


class ChatMessage(BaseModel):
    """One message; its parts and other fields are checked by `kvherd.chat_render`."""

    model_config = ConfigDict(extra="allow")
    role: StrictStr
    content: StrictStr | list[StrictStr | dict[str, Any]] | None = None


class ChatCompletionRequest(_GenerationFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: StrictInt | None = None
    logprobs: StrictBool | None = False
    top_logprobs: StrictInt | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    response_format: dict[str, Any] | None = None


# -- semantic checks -------------------------------------------------------------------------------
def check_supported(body: CompletionRequest | ChatCompletionRequest) -> None:
    """Refuse, with a 400 naming the field, what the engine cannot do faithfully."""
    if body.n is not None and body.n != 1:
        if body.n < 1:
            raise bad_request(f"n must be at least 1, got {body.n}", param="n")
        raise bad_request("n > 1 is not supported; send n separate requests", param="n")
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(body, name)
        if value is not None and value != 0:
            raise bad_request(f"{name} is not supported (only 0)", param=name)
    if body.repetition_penalty is not None and body.repetition_penalty != 1:
        raise bad_request(
            "repetition_penalty is not supported (only 1)", param="repetition_penalty"
        )
    if body.stream_options is not None and not body.stream:
        raise bad_request("stream_options can only be given with stream=true", "stream_options")
    if body.logit_bias:
        raise bad_request("logit_bias is not supported", param="logit_bias")
    if isinstance(body, CompletionRequest):
        if body.best_of is not None and body.best_of != 1:
            raise bad_request("best_of is not supported (only 1)", param="best_of")
        if body.logprobs is not None:
            raise bad_request("logprobs is not supported", param="logprobs")
        if body.echo:
            raise bad_request("echo is not supported", param="echo")
        if body.suffix:
            raise bad_request("suffix is not supported", param="suffix")
    else:
        if body.logprobs or body.top_logprobs is not None:
            raise bad_request("logprobs is not supported", param="logprobs")
        if body.tools:
            raise bad_request("tools are not supported by this model server", param="tools")
        if body.response_format and body.response_format.get("type", "text") != "text":
            raise bad_request(
                "structured output (response_format) is not supported", param="response_format"
            )


def to_sampling_params(
    body: CompletionRequest | ChatCompletionRequest, default_max_tokens: int
) -> SamplingParams:
    """Engine sampling parameters for `body` (validated by `SamplingParams.validate`)."""
    max_tokens = body.max_tokens
    if isinstance(body, ChatCompletionRequest) and body.max_completion_tokens is not None:
        max_tokens = body.max_completion_tokens
    stop = body.stop
    params = SamplingParams(
        max_tokens=default_max_tokens if max_tokens is None else max_tokens,
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        top_k=0 if body.top_k is None else body.top_k,
        seed=body.seed,
        stop=[stop] if isinstance(stop, str) else list(stop or []),
        stop_token_ids=list(body.stop_token_ids or []),
        ignore_eos=body.ignore_eos,
    )
    params.validate()
    return params


def resolve_prompt(
    prompt: str | list[int] | list[str] | list[list[int]], vocab_size: int
) -> str | list[int]:
    """Text or token ids of a completions prompt; batches of more than one prompt are refused."""
    if isinstance(prompt, str):
        if not prompt:
            raise bad_request("prompt must not be empty", param="prompt")
        return prompt
    if not prompt:
        raise bad_request("prompt must not be empty", param="prompt")
    first = prompt[0]
    if isinstance(first, str | list):
        if len(prompt) > 1:
            raise bad_request(
                "batched prompts are not supported; send one prompt per request", param="prompt"
            )
        return resolve_prompt(first, vocab_size)
    token_ids: list[int] = prompt  # type: ignore[assignment]
    for token_id in token_ids:
        if not 0 <= token_id < vocab_size:
            raise bad_request(
                f"token id {token_id} is out of vocabulary (valid: 0..{vocab_size - 1})",
                param="prompt",
                code="invalid_token_id",
            )
    return token_ids


def chat_prompt(body: ChatCompletionRequest) -> ChatPrompt:
    """The chat template's inputs for `body`, built exactly as the proxy builds its routing tokens."""
    try:
        return parse_chat(body.model_dump(exclude_unset=True))
    except ChatRenderError as exc:
        raise bad_request(str(exc), param=exc.param) from exc


def prompt_token_ids(
    body: CompletionRequest | ChatCompletionRequest, tokenizer: Tokenizer, vocab_size: int
) -> list[int]:
    """The engine's prompt ids for `body` (400 if invalid or empty): the one path the generation
    routes and the render/tokenize routes share. Chat: the template rendered and encoded as vLLM
    does (`kvherd.tokenizer.chat_token_ids`); completions: text encoded (``add_special_tokens``)
    or token ids as given."""
    if isinstance(body, ChatCompletionRequest):
        try:
            prompt_ids = chat_token_ids(tokenizer, chat_prompt(body))
        except ChatRenderError as exc:
            raise bad_request(str(exc), param=exc.param) from exc
    else:
        prompt = resolve_prompt(body.prompt, vocab_size)
        prompt_ids = (
            tokenizer.encode(prompt, body.add_special_tokens) if isinstance(prompt, str) else prompt
        )
    if not prompt_ids:
        raise bad_request("the prompt encodes to no tokens", param="prompt")
    return prompt_ids


def default_max_tokens(
    body: CompletionRequest | ChatCompletionRequest, prompt_len: int, max_model_len: int
) -> int:
    """``max_tokens`` when the body gives none: the rest of the context for chat, 16 for completions."""
    if isinstance(body, ChatCompletionRequest):
        return max(1, max_model_len - prompt_len)
    return 16


# -- responses -------------------------------------------------------------------------------------
def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": max(0, cached_tokens)},
    }


def now() -> int:
    return int(time.time())


def _choice(key: str, value: Any, finish_reason: str | None) -> dict[str, Any]:
    """A choice with its content under `key` ("text", "delta" or "message")."""
    return {"index": 0, key: value, "logprobs": None, "finish_reason": finish_reason}


def _chunk(
    object_: str,
    response_id: str,
    created: int,
    model: str,
    choice: dict[str, Any],
    token_ids: list[int] | None,
    index: int,
) -> dict[str, Any]:
    chunk: dict[str, Any] = {
        "id": response_id,
        "object": object_,
        "created": created,
        "model": model,
        "choices": [choice],
    }
    if token_ids is not None:
        choice["token_ids"] = token_ids
        chunk["kvherd"] = {"token_ids": token_ids, "index": index}
    return chunk


def completion_chunk(
    response_id: str,
    created: int,
    model: str,
    text: str,
    finish_reason: str | None,
    token_ids: list[int] | None = None,
    index: int = 0,
) -> dict[str, Any]:
    choice = _choice("text", text, finish_reason)
    return _chunk("text_completion", response_id, created, model, choice, token_ids, index)


def chat_chunk(
    response_id: str,
    created: int,
    model: str,
    delta: dict[str, Any],
    finish_reason: str | None,
    token_ids: list[int] | None = None,
    index: int = 0,
) -> dict[str, Any]:
    choice = _choice("delta", delta, finish_reason)
    return _chunk("chat.completion.chunk", response_id, created, model, choice, token_ids, index)


def usage_chunk(
    response_id: str, created: int, model: str, chat: bool, usage_: dict[str, Any]
) -> dict[str, Any]:
    return {
        "id": response_id,
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": created,
        "model": model,
        "choices": [],
        "usage": usage_,
    }


def _response(
    object_: str,
    response_id: str,
    created: int,
    model: str,
    choice: dict[str, Any],
    usage_: dict[str, Any],
    token_ids: list[int] | None,
    prompt_token_ids: list[int] | None,
) -> dict[str, Any]:
    if token_ids is not None:
        choice["token_ids"] = token_ids
        choice["prompt_token_ids"] = prompt_token_ids
    return {
        "id": response_id,
        "object": object_,
        "created": created,
        "model": model,
        "choices": [choice],
        "usage": usage_,
    }


def completion_response(
    response_id: str,
    created: int,
    model: str,
    text: str,
    finish_reason: str | None,
    usage_: dict[str, Any],
    token_ids: list[int] | None = None,
    prompt_token_ids: list[int] | None = None,
) -> dict[str, Any]:
    choice = _choice("text", text, finish_reason)
    return _response(
        "text_completion", response_id, created, model, choice, usage_, token_ids, prompt_token_ids
    )


def chat_response(
    response_id: str,
    created: int,
    model: str,
    text: str,
    finish_reason: str | None,
    usage_: dict[str, Any],
    token_ids: list[int] | None = None,
    prompt_token_ids: list[int] | None = None,
) -> dict[str, Any]:
    choice = _choice("message", {"role": "assistant", "content": text}, finish_reason)
    return _response(
        "chat.completion", response_id, created, model, choice, usage_, token_ids, prompt_token_ids
    )
