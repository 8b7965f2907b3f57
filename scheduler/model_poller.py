"""Model polling: what each instance serves, from its ``GET /v1/models``, every `interval_s`.

Contract:
- `parse_models(body)` reads an OpenAI model list into model cards (`ModelIndex.set_models`):
  every entry's ``id``, ``parent`` (vLLM 0.32 lists a LoRA adapter, static ``--lora-modules`` or
  loaded at run time, with ``parent`` = its base model and ``root`` = its path; base models have
  ``parent`` null) and the fields vLLM gives (``object``, ``created``, ``owned_by``, ``root``,
  ``max_model_len``), kept for the proxy's own ``/v1/models``. `ModelListError` when unreadable.
- `ModelPoller` asks every instance of `targets()` each round, concurrently (bounded by
  `timeout_s`, with `headers`), and hands each list read to `on_models(instance_id, cards)`. A
  failed poll changes nothing (the last list stands; health is not its business), logged at debug.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping
from typing import Any

import httpx

from scheduler.core.model_index import ModelCard
from scheduler.periodic import PeriodicTask

log = logging.getLogger("kvherd.models")

_CARD_FIELDS = ("id", "object", "created", "owned_by", "root", "parent", "max_model_len")


class ModelListError(ValueError):
    """A ``/v1/models`` answer that is not an OpenAI model list."""


def parse_models(body: Any) -> list[ModelCard]:
    data = body.get("data") if isinstance(body, Mapping) else None
    if not isinstance(data, list):
        raise ModelListError("a model list is an object with a 'data' list")
    cards: list[ModelCard] = []
    for entry in data:
        if not isinstance(entry, Mapping) or not isinstance(entry.get("id"), str):
            raise ModelListError(f"model entry without a string 'id': {entry!r:.80}")
        parent = entry.get("parent")
        if parent is not None and not isinstance(parent, str):
            raise ModelListError(f"model {entry['id']!r}: 'parent' must be a string or null")
        cards.append({key: entry[key] for key in _CARD_FIELDS if key in entry})
    return cards


class ModelPoller:
    def __init__(
        self,
        targets: Callable[[], dict[str, str]],
        on_models: Callable[[str, list[ModelCard]], None],
        interval_s: float = 2.0,
        timeout_s: float = 2.0,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        self._targets = targets  # instance id -> base URL (the instances whose lists are learned)
        self._on_models = on_models
        self._client = httpx.AsyncClient(timeout=timeout_s, trust_env=False, headers=headers)
        self._task = PeriodicTask("kvherd-model-poller", self.poll_all, interval_s, log)

    async def poll(self, instance_id: str, url: str) -> list[ModelCard] | None:
        try:
            response = await self._client.get(url.rstrip("/") + "/v1/models")
            response.raise_for_status()
            cards = parse_models(response.json())
        except (httpx.HTTPError, ValueError) as exc:
            log.debug("model list of %s not read: %s", instance_id, exc)
            return None
        self._on_models(instance_id, cards)
        return cards

    async def poll_all(self) -> None:
        targets = self._targets()
        await asyncio.gather(*(self.poll(i, u) for i, u in targets.items()))

    def start(self) -> None:
        self._task.start()

    async def stop(self) -> None:
        await self._task.stop()
        await self._client.aclose()
