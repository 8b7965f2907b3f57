"""Loading a LoRA adapter on demand (``--lora-load-on-demand``): once, on the instance chosen.

Contract:
- `parse_lora_module(text)`: ``NAME=PATH`` or vLLM's JSON form ``{"name", "path",
  "base_model_name"}`` (``--lora-modules``, repeatable): the adapters the proxy may load, PATH as
  the instances see it. Without a base model, any vLLM instance may be asked.
- `LoraLoader.ensure(request)` for a request whose adapter no instance serves
  (`RoutedRequest.lora_load`): the dispatch policy picks among the instances serving the base
  model that load adapters at run time (vLLM; kvherd agents with ``--allow-runtime-lora``;
  `Fleet.choose_instance`: LoRA affinity prefers a free adapter slot, load can win), the proxy
  sends that instance vLLM's ``POST /v1/load_lora_adapter`` ``{"lora_name",
  "lora_path"}`` (it needs ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True``; vLLM 0.32 answers 200 with
  the text ``Success: LoRA adapter 'X' added successfully.``, 400 ``InvalidUserInput`` when the
  name is already loaded, 404 ``NotFoundError`` ``Loading lora X failed: No adapter found for
  <path>`` for a bad path), the fleet records it (`Fleet.served_adapter`), and the request is
  returned routed to the instances that now serve it. Concurrent requests for the adapter await
  the same load. An "already loaded" answer counts as loaded (the proxy's list was behind).
- A failed load (refused, unreachable, no instance) is a 502 ``lora_load_failed`` naming the
  instance and its answer, for every request that waited on it; the next request tries again.
  Each load is counted in ``kvherd_lora_loads_total{outcome}`` (``loaded``, ``failed``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass

import httpx

from kvherd.wire import OpenAIError
from scheduler.core.model_index import UnknownModelError
from scheduler.fleet import Fleet, NoCapacityError
from scheduler.metrics import ProxyMetrics
from scheduler.proxy.routed_request import RoutedRequest

log = logging.getLogger("kvherd.lora")

LOAD_PATH = "/v1/load_lora_adapter"


@dataclass(frozen=True, slots=True)
class LoraModule:
    name: str
    path: str
    base: str | None = None  # the base model it applies to (None: whatever the instance serves)


def parse_lora_module(text: str) -> LoraModule:
    if text.lstrip().startswith("{"):
        spec = json.loads(text)
        if not isinstance(spec, dict) or not all(
            isinstance(spec.get(key), str) and spec[key] for key in ("name", "path")
        ):
            raise ValueError(f"--lora-modules {text!r}: JSON needs string 'name' and 'path'")
        base = spec.get("base_model_name")
        if base is not None and not isinstance(base, str):
            raise ValueError(f"--lora-modules {text!r}: 'base_model_name' must be a string")
        return LoraModule(spec["name"], spec["path"], base)
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise ValueError(f"--lora-modules {text!r}: expected NAME=PATH or a JSON object")
    return LoraModule(name, path)


class LoraLoader:
    def __init__(
        self,
        fleet: Fleet,
        modules: Mapping[str, LoraModule],
        metrics: ProxyMetrics,
        headers: Mapping[str, str] | None = None,
        timeout_s: float = 60.0,
    ) -> None:
        self.fleet = fleet
        self.modules = dict(modules)
        self.metrics = metrics
        self._client = httpx.AsyncClient(timeout=timeout_s, trust_env=False, headers=headers)
        self._loading: dict[str, asyncio.Future[str]] = {}  # adapter -> the instance loading it

    async def ensure(self, request: RoutedRequest) -> RoutedRequest:
        name = request.lora_load
        assert name is not None, "ensure() is for requests with an adapter to load"
        flight = self._loading.get(name)
        if flight is None:
            flight = asyncio.ensure_future(self._load(self.modules[name], request))
            self._loading[name] = flight
            flight.add_done_callback(lambda _: self._loading.pop(name, None))
        loaded_on = await asyncio.shield(flight)
        try:
            only = self.fleet.models.route(name)
        except UnknownModelError:  # a model poll answered before the load and came back since
            only = frozenset({loaded_on})
        return dataclasses.replace(request, only=only, adapter=name, lora_load=None)

    async def _load(self, module: LoraModule, request: RoutedRequest) -> str:
        fleet = self.fleet
        candidates = frozenset(
            i
            for i, inst in fleet.instances.items()
            if (inst.spec.runtime_lora or not inst.spec.kvherd_agent)
            and (module.base is None or module.base in (fleet.models.models_of(i) or [module.base]))
        )
        try:
            inst = fleet.choose_instance(
                request.num_tokens, request.block_hashes, candidates, module.name,
                request.block_size,
            )  # fmt: skip
        except NoCapacityError:
            self.metrics.lora_load("failed")
            raise _failed(
                module, "no instance that loads adapters and serves its base model is available"
            ) from None
        body = {"lora_name": module.name, "lora_path": module.path}
        try:
            response = await self._client.post(inst.url.rstrip("/") + LOAD_PATH, json=body)
        except httpx.HTTPError as exc:
            self.metrics.lora_load("failed")
            raise _failed(module, f"instance {inst.instance_id}: {exc}") from exc
        if response.status_code != 200 and "already been loaded" not in response.text:
            self.metrics.lora_load("failed")
            raise _failed(
                module,
                f"instance {inst.instance_id} answered HTTP {response.status_code}: "
                f"{response.text[:500]}",
            )
        self.metrics.lora_load("loaded")
        fleet.served_adapter(inst.instance_id, module.name, module.path, module.base)
        log.info("LoRA adapter %s loaded on %s", module.name, inst.instance_id)
        return inst.instance_id

    async def close(self) -> None:
        await self._client.aclose()


def _failed(module: LoraModule, why: str) -> OpenAIError:
    return OpenAIError(
        502,
        f"loading LoRA adapter `{module.name}` failed: {why}",
        type="server_error",
        param="model",
        code="lora_load_failed",
    )
