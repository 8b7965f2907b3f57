"""LoRA adapters loaded and unloaded at run time (``kvherd agent --allow-runtime-lora``), as vLLM does.

Contract (`create_lora_router(agent, fleet_token)`; vLLM 0.32's routes, bodies and answers):
- ``POST /v1/load_lora_adapter`` ``{"lora_name", "lora_path"}``: the PEFT adapter is read off the
  engine thread, then made resident between two steps (`LLMEngine.install_lora`; a full set of
  slots evicts the least recently used adapter no request runs with, which leaves ``/v1/models``).
  200 ``Success: LoRA adapter 'X' added successfully.``; 400 ``InvalidUserInput`` for a name
  already loaded, the model's own name, weights that do not fit the model, or every slot in use;
  404 ``NotFoundError`` when the path holds no adapter.
- ``POST /v1/unload_lora_adapter`` ``{"lora_name"}``: 200 ``Success: LoRA adapter 'X' removed
  successfully.``; 404 for a name not loaded; 400 while requests run with it.
- The path is read from this host's disk: with a fleet token both routes need it
  (``Authorization: Bearer FLEET_TOKEN``, what ``kvherd serve --lora-load-on-demand`` sends).
"""

from __future__ import annotations

import asyncio
import logging
import os

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ConfigDict, StrictStr

from instance_agent.engine.core.lora_slots import LoraSlotError
from instance_agent.server import Agent
from kvherd.fleet_token import authorized
from kvherd.wire import OpenAIError

log = logging.getLogger(__name__)


class LoadLoraRequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    lora_name: StrictStr
    lora_path: StrictStr


class UnloadLoraRequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    lora_name: StrictStr


def _user_error(message: str) -> OpenAIError:
    return OpenAIError(400, message, type="InvalidUserInput", code=400)


def _not_found(message: str) -> OpenAIError:
    return OpenAIError(404, message, type="NotFoundError", code=404)


def create_lora_router(agent: Agent, fleet_token: str | None = None) -> APIRouter:
    router = APIRouter()

    def check_token(request: Request) -> None:
        presented = request.headers.get("authorization")
        if fleet_token and not authorized(presented.encode() if presented else None, fleet_token):
            raise OpenAIError(
                401,
                "loading LoRA adapters needs the fleet token (Authorization: Bearer FLEET_TOKEN)",
                type="authentication_error",
                code="invalid_fleet_token",
            )

    @router.post("/v1/load_lora_adapter")
    async def load(body: LoadLoraRequest, request: Request) -> PlainTextResponse:
        check_token(request)
        name, path = body.lora_name, body.lora_path
        if not name or not path:
            raise _user_error("Both 'lora_name' and 'lora_path' must be provided.")
        if name == agent.served_model_name:
            raise _user_error(f"'{name}' is the served model's own name, not an adapter's.")
        if name in agent.engine.lora_adapters:
            raise _user_error(f"The lora adapter '{name}' has already been loaded.")
        if not os.path.isfile(os.path.join(path, "adapter_config.json")):
            raise _not_found(f"Loading lora {name} failed: No adapter found for {path}")
        try:
            adapter = await asyncio.to_thread(agent.engine.read_lora, name, path)
            evicted = await agent.engine_loop.call(lambda engine: engine.install_lora(adapter))
        except ValueError as exc:  # LoraSlotError too: already loaded, slots all in use
            raise _user_error(str(exc)) from None
        if evicted is not None:
            log.info("LoRA adapter %s evicted to load %s", evicted, name)
        log.info("LoRA adapter %s loaded from %s", name, path)
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    @router.post("/v1/unload_lora_adapter")
    async def unload(body: UnloadLoraRequest, request: Request) -> PlainTextResponse:
        check_token(request)
        name = body.lora_name
        if name not in agent.engine.lora_adapters:
            raise _not_found(f"The lora adapter '{name}' cannot be found.")
        try:
            await agent.engine_loop.call(lambda engine: engine.unload_lora(name))
        except LoraSlotError as exc:
            if name not in agent.engine.lora_adapters:  # unloaded meanwhile
                raise _not_found(str(exc)) from None
            raise _user_error(str(exc)) from None
        log.info("LoRA adapter %s unloaded", name)
        return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")

    return router
