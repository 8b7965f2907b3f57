"""Wire forms every kvherd process shares: the OpenAI error object, SSE frames, the migration notice.

Contract:
- `MAX_BODY_BYTES`: the largest request body any kvherd process accepts (agents and the proxy
  alike, so the proxy never forwards a body its instances refuse).
- `OpenAIError` carries an HTTP status and the error object ``{"error": {"message", "type", "param",
  "code"}}``; agents and the proxy answer every refused input with it.
- `sse(payload)` is one server-sent event frame as OpenAI and vLLM write them (compact JSON);
  `SSE_DONE` ends a stream.
- A streamed request that live-migrates ends its source's SSE (without ``[DONE]``) with one notice
  frame, `migration_notice(dst_url, request_id, resume)`. `NOTICE_PREFIX` is how every such frame
  starts, byte for byte, so a relay can find it in a byte stream without parsing every frame, and
  `parse_migration_notice` reads one back (`ValueError` when malformed). The notice is consumed by
  the proxy or relay; clients never see it.
- Token ledger: a streamed request sent with ``X-Kvherd-Token-Ids: 1`` (`TOKEN_IDS_HEADER`) gets
  SSE comment lines ``: kvherd {json}`` (`ledger_line`, starting with `LEDGER_PREFIX`) before its
  data lines: the first data frame's says how to continue the stream elsewhere
  (``{"resume": {...}, "sampling_seed": S}``, the notice's ``resume`` object), every frame with
  tokens says which (``{"index": i, "token_ids": [...]}``). A relay keeps them to continue a
  stream whose instance was lost and strips them; SSE clients would ignore them anyway. A
  migration's ``resume`` carries ``token_ledger`` so the destination keeps writing them.
"""

from __future__ import annotations

import json
from typing import Any

# A prompt this long cannot fit any model kvherd serves; parsing it would only cost memory.
MAX_BODY_BYTES = 4 * 1024 * 1024


class OpenAIError(Exception):
    """An HTTP error answered with the OpenAI error object."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | int | None = None,  # vLLM's errors carry the HTTP status here
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


def bad_request(message: str, param: str | None = None, code: str | None = None) -> OpenAIError:
    return OpenAIError(400, message, param=param, code=code)


def model_not_found(model: str, aliases: list[str]) -> OpenAIError:
    """vLLM 0.32's answer to a `model` it does not serve, byte for byte (`aliases`: the base
    models served; adapters are not named)."""
    return OpenAIError(
        404,
        f"The model `{model}` does not exist. Valid aliases: {', '.join(aliases)}.",
        type="NotFoundError",
        param="model",
        code=404,
    )


def sse(payload: dict[str, Any]) -> bytes:
    """One server-sent event frame, as OpenAI and vLLM write them."""
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"

NOTICE_PREFIX = b'data: {"kvherd":{"migrated_to":'

TOKEN_IDS_HEADER = "x-kvherd-token-ids"
LEDGER_PREFIX = b": kvherd "


def ledger_line(payload: dict[str, Any]) -> bytes:
    """One token-ledger comment line (see the module contract)."""
    return LEDGER_PREFIX + json.dumps(payload, separators=(",", ":")).encode() + b"\n"


def migration_notice(dst_url: str, request_id: str, resume: dict[str, Any]) -> bytes:
    """The frame that ends a migrated request's stream at its source."""
    frame = sse({"kvherd": {"migrated_to": dst_url, "request_id": request_id, "resume": resume}})
    assert frame.startswith(NOTICE_PREFIX)
    return frame


def parse_migration_notice(frame: bytes) -> dict[str, Any]:
    """The notice object (``migrated_to``, ``request_id``, ``resume``) of one notice frame."""
    if not frame.startswith(b"data: "):
        raise ValueError("not an SSE data frame")
    try:
        obj = json.loads(frame[len(b"data: ") :].split(b"\n\n", 1)[0])
        notice = obj["kvherd"]
        str(notice["migrated_to"])
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"malformed migration notice: {exc}") from exc
    if not isinstance(notice, dict):
        raise ValueError("malformed migration notice")
    return notice
