"""`DestinationLink` over the destination agent's HTTP API (``/kvherd/v1/migration/...``).

Contract: each call POSTs one control message as JSON and parses the reply; a transport error, a
timeout, a non-200 status or a reply that does not parse raises `DestinationError`, which the
source driver turns into an aborted migration (the request continues on the source).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import httpx

from migration.core.protocol import (
    AbortRequest,
    AckResponse,
    CommitRequest,
    DestinationError,
    MessageError,
    ReserveRequest,
    ReserveResponse,
)

R = TypeVar("R")


class HttpDestination:
    def __init__(self, base_url: str, client: httpx.AsyncClient) -> None:
        self.base_url = base_url.rstrip("/")
        self.client = client

    async def reserve(self, msg: ReserveRequest) -> ReserveResponse:
        return await self._post("reserve", msg.to_json(), ReserveResponse.from_json)

    async def commit(self, msg: CommitRequest) -> AckResponse:
        return await self._post("commit", msg.to_json(), AckResponse.from_json)

    async def abort(self, msg: AbortRequest) -> AckResponse:
        return await self._post("abort", msg.to_json(), AckResponse.from_json)

    async def _post(self, what: str, body: dict[str, Any], parse: Callable[[Any], R]) -> R:
        url = f"{self.base_url}/kvherd/v1/migration/{what}"
        try:
            response = await self.client.post(url, json=body)
        except httpx.HTTPError as e:
            raise DestinationError(f"{what} at {self.base_url} failed: {e!r}") from e
        if response.status_code != 200:
            raise DestinationError(
                f"{what} at {self.base_url}: HTTP {response.status_code} {response.text[:200]}"
            )
        try:
            return parse(response.json())
        except (ValueError, MessageError) as e:
            raise DestinationError(f"{what} at {self.base_url}: bad reply: {e}") from e
