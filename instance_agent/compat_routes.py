"""Endpoints peer routers and vLLM clients probe: model identity, tokenization, request rendering.

sglang-router names a worker's model from ``/server_info`` (``served_model_name``) and reads
``/model_info``; vllm-router's ``cache_aware`` and ``kv_aware`` policies tokenize every request
through each worker's ``/v1/completions/render`` or ``/v1/chat/completions/render`` (falling back
to ``/tokenize``) and match those ids against the blocks the worker's KV events announce. So a
kvherd agent answers them as SGLang and vLLM do, with the engine's own token ids.

Contract (`create_compat_router(served)`):
- ``GET /server_info`` and ``GET /get_server_info`` (SGLang's names): ``served_model_name``,
  ``model_path``, ``tokenizer_path`` (the checkpoint directory when it holds a tokenizer, else
  null), ``context_length`` / ``max_model_len``, ``page_size`` /
  ``block_size`` (tokens per KV block), ``max_total_num_tokens``, ``tp_size``, ``dp_size``,
  ``enable_prefix_caching``, ``version``.
- ``GET /model_info`` and ``GET /get_model_info``: SGLang's shape (``model_path``,
  ``tokenizer_path``, ``is_generation``, ``model_type``, ``architectures``, ...).
- ``POST /tokenize`` (vLLM's): ``{"prompt": ...}`` (completions prompt, ``add_special_tokens``
  default true) or ``{"messages": [...]}`` (chat: template, ``add_generation_prompt``,
  ``continue_final_message``, ``chat_template_kwargs``, ``tools``; ``add_special_tokens`` default
  false) -> ``{"count", "max_model_len", "tokens", "token_strs": null}``.
  ``return_token_strs`` is refused (the engine's tokenizer has no token strings to give).
- ``POST /detokenize`` ``{"tokens": [...]}`` -> ``{"prompt": text}``.
- ``POST /v1/completions/render`` -> a list of one vLLM ``GenerateRequest``
  (``request_id``, ``token_ids``, ``sampling_params``, ``model``, ``stream``, ...);
  ``POST /v1/chat/completions/render`` -> one ``GenerateRequest``. The bodies are validated as the
  generation routes validate them (`protocol.check_supported`, sampling parameters).
- The token ids are `protocol.prompt_token_ids`: the very ids ``/v1/completions`` and
  ``/v1/chat/completions`` submit to the engine (chat template included, BOS once), and so the ids
  the agent's KV events carry.
- Errors are the OpenAI error object: 400 for an invalid body, 404 for a name that is neither the
  model nor one of its LoRA adapters (`resolve_model`, the generation routes' check too).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import asdict
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, StrictInt, StrictStr, ValidationError

from instance_agent import protocol
from instance_agent.protocol import ChatCompletionRequest, CompletionRequest
from kvherd import __version__
from kvherd.tokenizer import has_tokenizer_files
from kvherd.wire import bad_request, model_not_found

if TYPE_CHECKING:
    from instance_agent.engine.llm_engine import LLMEngine

_M = TypeVar("_M", bound=BaseModel)


class ServedModel(Protocol):
    """What the routes read of the agent (`server.Agent` is one)."""

    served_model_name: str
    model_root: str

    @property
    def engine(self) -> LLMEngine: ...


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: StrictStr | None = None
    tokens: list[StrictInt]


def create_compat_router(served: ServedModel) -> APIRouter:
    router = APIRouter()
    # A checkpoint directory's tokenizer; None for the built-in presets' byte tokenizer, so a peer
    # router does not look a preset's name up on HuggingFace.
    tokenizer_path = served.model_root if has_tokenizer_files(served.model_root) else None

    def server_info() -> dict[str, Any]:
        engine = served.engine
        block_size = engine.block_manager.block_size
        return {
            "served_model_name": served.served_model_name,
            "model_path": served.model_root,
            "tokenizer_path": tokenizer_path,
            "context_length": engine.max_model_len,
            "max_model_len": engine.max_model_len,
            "page_size": block_size,
            "block_size": block_size,
            "max_total_num_tokens": engine.block_manager.num_blocks * block_size,
            "tp_size": 1,
            "dp_size": 1,
            "enable_prefix_caching": engine.config.enable_prefix_caching,
            "version": __version__,
        }

    def model_info() -> dict[str, Any]:
        config = served.engine.model_config
        return {
            "model_path": served.model_root,
            "tokenizer_path": tokenizer_path,
            "served_model_name": served.served_model_name,
            "is_generation": True,
            "preferred_sampling_params": None,
            "has_image_understanding": False,
            "has_audio_understanding": False,
            "model_type": config.model_type,
            "architectures": config.to_hf_dict()["architectures"],
        }

    for path in ("/server_info", "/get_server_info"):
        router.add_api_route(path, server_info, methods=["GET"])
    for path in ("/model_info", "/get_model_info"):
        router.add_api_route(path, model_info, methods=["GET"])

    def token_ids(body: CompletionRequest | ChatCompletionRequest) -> list[int]:
        resolve_model(served, body.model)
        engine = served.engine
        return protocol.prompt_token_ids(body, engine.tokenizer, engine.model_config.vocab_size)

    @router.post("/tokenize")
    async def tokenize(request: Request) -> dict[str, Any]:
        raw = await _json_object(request)
        if raw.get("return_token_strs"):
            raise bad_request("return_token_strs is not supported", param="return_token_strs")
        body: CompletionRequest | ChatCompletionRequest = (
            _validate(ChatCompletionRequest, raw)
            if "messages" in raw
            else _validate(CompletionRequest, raw)
        )
        ids = token_ids(body)
        return {
            "count": len(ids),
            "max_model_len": served.engine.max_model_len,
            "tokens": ids,
            "token_strs": None,
        }

    @router.post("/detokenize")
    async def detokenize(request: Request) -> dict[str, str]:
        body = _validate(DetokenizeRequest, await _json_object(request))
        resolve_model(served, body.model)
        engine = served.engine
        vocab_size = engine.model_config.vocab_size
        for token_id in body.tokens:
            if not 0 <= token_id < vocab_size:
                raise bad_request(
                    f"token id {token_id} is out of vocabulary (valid: 0..{vocab_size - 1})",
                    param="tokens",
                    code="invalid_token_id",
                )
        return {"prompt": engine.tokenizer.decode(body.tokens)}

    def generate_request(
        body: CompletionRequest | ChatCompletionRequest, request_id: str
    ) -> dict[str, Any]:
        """vLLM's ``GenerateRequest`` for `body`: what the generation route would submit."""
        protocol.check_supported(body)
        ids = token_ids(body)
        max_tokens = protocol.default_max_tokens(body, len(ids), served.engine.max_model_len)
        params = protocol.to_sampling_params(body, max_tokens)
        return {
            "request_id": request_id,
            "token_ids": ids,
            "features": None,
            "sampling_params": asdict(params),
            "model": body.model,
            "stream": bool(body.stream),
            "stream_options": (
                body.stream_options.model_dump() if body.stream and body.stream_options else None
            ),
            "cache_salt": body.cache_salt,
            "priority": body.priority,
        }

    @router.post("/v1/completions/render")
    async def render_completion(body: CompletionRequest) -> list[dict[str, Any]]:
        return [generate_request(body, f"cmpl-{uuid.uuid4().hex}")]

    @router.post("/v1/chat/completions/render")
    async def render_chat(body: ChatCompletionRequest) -> dict[str, Any]:
        return generate_request(body, f"chatcmpl-{uuid.uuid4().hex}")

    return router


def resolve_model(served: ServedModel, model: str | None) -> str | None:
    """The LoRA adapter a request's `model` names (None: the base model, or no name); any other
    name is the 404 of an unknown model."""
    if model is None or model == served.served_model_name:
        return None
    if model in served.engine.lora_adapters:
        return model
    raise model_not_found(model, [served.served_model_name])


async def _json_object(request: Request) -> dict[str, Any]:
    try:
        body = json.loads(await request.body())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise bad_request(f"request body is not valid JSON: {exc}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise bad_request("request body must be a JSON object")
    return body


def _validate(model: type[_M], body: dict[str, Any]) -> _M:
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise protocol.error_from_validation(exc.errors()) from None
