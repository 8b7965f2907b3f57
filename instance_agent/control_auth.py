"""The agent's guard on its control routes: ``/kvherd/v1/*`` needs the fleet token.

Contract: `FleetTokenMiddleware(app, token)` (ASGI) answers any HTTP request under
`kvherd.fleet_token.CONTROL_PREFIX` that lacks ``Authorization: Bearer TOKEN`` with 401 and the
OpenAI error object, before routing or reading the body; every other path passes untouched.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

import orjson

from kvherd.fleet_token import CONTROL_PREFIX, authorized
from kvherd.wire import OpenAIError

_REFUSAL = orjson.dumps(
    OpenAIError(
        401,
        "this control route needs the fleet token (Authorization: Bearer FLEET_TOKEN)",
        type="authentication_error",
        code="invalid_fleet_token",
    ).body()
)


class FleetTokenMiddleware:
    def __init__(self, app: Callable[..., Awaitable[None]], token: str) -> None:
        if not token:
            raise ValueError("the fleet token must be non-empty")
        self.app = app
        self.token = token

    async def __call__(
        self,
        scope: MutableMapping[str, Any],
        receive: Callable[[], Awaitable[MutableMapping[str, Any]]],
        send: Callable[[MutableMapping[str, Any]], Awaitable[None]],
    ) -> None:
        if scope["type"] == "http" and scope["path"].startswith(CONTROL_PREFIX):
            presented = next((v for k, v in scope["headers"] if k == b"authorization"), None)
            if not authorized(presented, self.token):
                await send(
                    {
                        "type": "http.response.start",
                        "status": 401,
                        "headers": [
                            (b"content-type", b"application/json"),
                            (b"content-length", str(len(_REFUSAL)).encode()),
                            (b"www-authenticate", b"Bearer"),
                        ],
                    }
                )
                await send({"type": "http.response.body", "body": _REFUSAL})
                return
        await self.app(scope, receive, send)
