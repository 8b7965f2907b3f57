"""A request body turned into what the fleet routes: parsed, salted, checked, tokenized, hashed.

Contract:
- `RequestReader.read(raw, path, chat, tenant)` returns a frozen `RoutedRequest` or raises
  `OpenAIError` (400): the body as a JSON object; its prompt's token ids as the engine computes
  them (`scheduler.proxy.routing_tokens`); the cache salt (the tenant's, written into the body and
  ``raw`` re-encoded, when tenancy is on; else the client's own ``cache_salt``, which must be a
  string); the priority class (`resolve_priority`: the body's ``priority``, else the
  ``X-Kvherd-Priority`` header's, else the tenant's default, else 0; written into the body when it
  named none, for the engines); the context check (vLLM's 400 ``context_length_exceeded`` for a
  prompt no instance can hold, unchecked while some instance did not state its ``max_model_len``);
  the block hashes, chained with the salt (and a LoRA adapter's name, on every block, as vLLM
  hashes) at the model's block size (`Fleet.block_size_of_model`).
- The model (``model``; absent or empty: any instance, as vLLM takes its default model): the
  instances that serve it (`Fleet.models`, one lookup) become the request's `only`; a LoRA
  adapter's name its `adapter`; its base model (an adapter's parent) picks the tokenizer
  (`ModelTokenizers.for_model`) and the block size, both kept on the request. A model nobody
  serves is vLLM's 404 (``The model `X` does not exist. Valid aliases: ...``, type
  ``NotFoundError``, param ``model``, code 404), unless `loadable` (adapter -> its base model)
  says the proxy may load it as an adapter (`lora_load` then names it); a model that is not a
  string a 400. The model is checked before the prompt is tokenized.
- Bodies over `OFF_LOOP_BODY_BYTES` are parsed and tokenized, and prompts over `OFF_LOOP_TOKENS`
  hashed, in worker threads (`OFF_LOOP_WORKERS` at a time), so a few huge prompts cannot stall
  every other request on the event loop.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

import orjson

from kvherd.block_hash import block_hash_chain
from kvherd.tokenizer import ByteTokenizer, Tokenizer
from kvherd.wire import OpenAIError, model_not_found
from scheduler.core.model_index import UnknownModelError
from scheduler.core.tenancy import Tenant
from scheduler.proxy.model_tokenizers import ModelTokenizers
from scheduler.proxy.routing_tokens import prompt_token_ids

if TYPE_CHECKING:
    from scheduler.fleet import Fleet

OFF_LOOP_BODY_BYTES = 64 * 1024
OFF_LOOP_TOKENS = 16 * 1024
OFF_LOOP_WORKERS = 2


@dataclass(frozen=True, slots=True)
class RoutedRequest:
    """One client request as the fleet routes and forwards it."""

    path: bytes  # b"/v1/completions" or b"/v1/chat/completions"
    chat: bool
    body: dict[str, Any]  # the parsed body (the salt set); continuations start from it
    raw: bytes  # what is forwarded: the client's bytes, re-encoded only when the salt changed
    num_tokens: int
    block_hashes: list[int]
    tenant: Tenant | None
    max_tokens: Any  # as the client gave it (``max_completion_tokens`` or ``max_tokens``)
    streamed: bool
    priority: int = 0  # its class in the admission queue and at the engines (lower first)
    only: frozenset[str] | None = None  # the instances serving its model (None: any)
    adapter: str | None = None  # its LoRA adapter
    lora_load: str | None = None  # an adapter no instance serves yet, for the proxy to load
    model: str | None = None  # the model it names
    block_size: int = 16  # its model's: the blocks `block_hashes` covers
    tokenizer: Tokenizer = field(default_factory=ByteTokenizer)  # its model's
    token_ids: list[int] = field(default_factory=list)  # its prompt's, as the engine computes them
    keyed: bool = False  # its blocks are hashed with a salt or an adapter's name

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_tokens if isinstance(self.max_tokens, int) else None


class _Target(NamedTuple):  # a tuple: built once per request, at a tuple's cost
    """What a request's ``model`` names (see the module contract)."""

    model: str | None = None
    only: frozenset[str] | None = None
    adapter: str | None = None
    lora_load: str | None = None
    base: str | None = None  # its base model (an adapter's parent)


_ANY = _Target()


class RequestReader:
    def __init__(
        self,
        fleet: Fleet,
        tokenizers: ModelTokenizers,
        loadable: Mapping[str, str | None] | None = None,
    ) -> None:
        self.fleet = fleet
        self.tokenizers = tokenizers
        self.loadable = loadable or {}  # adapters the proxy may load on demand -> base model
        self._off_loop = asyncio.Semaphore(OFF_LOOP_WORKERS)

    async def read(
        self,
        raw: bytes,
        path: bytes,
        chat: bool,
        tenant: Tenant | None,
        priority: int | None = None,
    ) -> RoutedRequest:
        if len(raw) > OFF_LOOP_BODY_BYTES:
            async with self._off_loop:
                body, target, tokenizer, token_ids = await asyncio.to_thread(self._parse, raw, chat)
        else:
            body, target, tokenizer, token_ids = self._parse(raw, chat)
        changed = False
        given = body.get("priority")
        if given is None:
            resolved = resolve_priority(priority, tenant)
            if resolved:
                body["priority"] = resolved
                changed = True
        elif type(given) is int:
            resolved = given
        else:
            raise OpenAIError(400, "'priority' must be an integer", param="priority")
        if tenant is not None:
            salt: str | None = tenant.cache_salt
            if body.get("cache_salt") != salt:
                body["cache_salt"] = salt
                changed = True
        else:
            client_salt = body.get("cache_salt")
            if client_salt is not None and not isinstance(client_salt, str):
                raise OpenAIError(400, "'cache_salt' must be a string", param="cache_salt")
            salt = client_salt or None
        if changed:
            raw = orjson.dumps(body)
        adapter = target.adapter
        max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
        self._check_context(len(token_ids), max_tokens, chat)
        block_size = self.fleet.block_size_of_model(target.base)
        if len(token_ids) > OFF_LOOP_TOKENS:
            async with self._off_loop:
                hashes = await asyncio.to_thread(
                    block_hash_chain, token_ids, block_size, salt, lora_name=adapter
                )
        else:
            hashes = block_hash_chain(token_ids, block_size, salt, lora_name=adapter)
        streamed = body.get("stream") is True
        return RoutedRequest(
            path, chat, body, raw, len(token_ids), hashes, tenant, max_tokens, streamed,
            resolved, target.only, adapter, target.lora_load, target.model, block_size, tokenizer,
            token_ids, salt is not None or adapter is not None,
        )  # fmt: skip

    def _model(self, model: Any) -> _Target:
        """What the request's `model` names (see the module contract)."""
        if model is None or model == "":
            return _ANY
        if not isinstance(model, str):
            raise OpenAIError(400, "'model' must be a string", param="model")
        index = self.fleet.models
        try:
            only = index.route(model)
        except UnknownModelError:
            if model in self.loadable:
                return _Target(model, None, model, model, self.loadable[model])
            bases = [c["id"] for c in index.cards() if not c.get("parent")]
            raise model_not_found(model, bases) from None
        parent = index.parent(model)
        if parent is None:
            return _Target(model, only, None, None, model)
        return _Target(model, only, model, None, parent)

    def _parse(
        self, raw: bytes, chat: bool
    ) -> tuple[dict[str, Any], _Target, Tokenizer, list[int]]:
        """The body as JSON, what its model names, its model's tokenizer and the token ids it
        routes by (`OpenAIError` when it cannot be routed)."""
        try:
            body = orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            raise OpenAIError(
                400, f"request body is not valid JSON: {exc}", code="invalid_json"
            ) from exc
        if not isinstance(body, dict):
            raise OpenAIError(400, "request body must be a JSON object")
        target = self._model(body.get("model"))
        tokenizer = self.tokenizers.for_model(target.base)
        return body, target, tokenizer, prompt_token_ids(body, chat, tokenizer)

    def _check_context(self, num_tokens: int, max_tokens: Any, chat: bool) -> None:
        """400, as vLLM words it, for a request no instance's context can hold."""
        limit = self.fleet.max_model_len()
        if limit is None:
            return
        budget = max_tokens if type(max_tokens) is int and max_tokens > 0 else 0
        if num_tokens + max(budget, 1) <= limit:
            return
        where = "messages" if chat else "prompt"
        if budget:
            detail = (
                f"you requested {num_tokens + budget} tokens ({num_tokens} in the {where}, "
                f"{budget} in the completion). Please reduce the length of the {where} or "
                "completion."
            )
        else:
            detail = (
                f"your {where} has {num_tokens} tokens. Please reduce the length of the {where}."
            )
        raise OpenAIError(
            400,
            f"This model's maximum context length is {limit} tokens. However, {detail}",
            param=where,
            code="context_length_exceeded",
        )


def resolve_priority(header: int | None, tenant: Tenant | None) -> int:
    """The class of a request whose body names none: the header's, else its tenant's default."""
    if header is not None:
        return header
    if tenant is not None and tenant.options.priority is not None:
        return tenant.options.priority
    return 0


def parse_slo_header(value: bytes) -> float:
    """``X-Kvherd-Slo-Ttft-Ms``: the TTFT asked for, a positive number of milliseconds up to an
    hour, in seconds (`OpenAIError` 400 otherwise)."""
    try:
        ms = float(value.strip()) if len(value) <= 32 else math.nan
    except ValueError:
        ms = math.nan
    if not 0.0 < ms <= 3_600_000.0:  # NaN fails too
        raise OpenAIError(
            400,
            "X-Kvherd-Slo-Ttft-Ms must be a number of milliseconds in (0, 3600000]",
            param="X-Kvherd-Slo-Ttft-Ms",
        )
    return ms / 1000.0


def parse_priority_header(value: bytes) -> int:
    """``X-Kvherd-Priority``: an integer (`OpenAIError` 400 otherwise)."""
    text = value.strip()
    if not text.removeprefix(b"-").isdigit() or len(text) > 18:
        raise OpenAIError(400, "X-Kvherd-Priority must be an integer", param="X-Kvherd-Priority")
    return int(text)
