"""Following a request that migrated to another agent: the attach stream's wire format and client.

Contract:
- A destination agent serves ``GET /kvherd/v1/requests/{request_id}/stream`` for a request it runs
  without a client (adopted by a migration): server-sent events, one ``data: {json}`` frame per
  engine output ``{"request_id", "index", "token_ids", "text", "finished", "finish_reason",
  "num_prompt_tokens", "num_cached_tokens"}`` (``index``: position of the first of ``token_ids`` in
  the whole output), an error frame ``{"error": {...}}`` if the request is aborted there, then
  ``data: [DONE]``. 404 if no such request is waiting for a follower. Closing the connection
  aborts the request on the destination.
- `follow` is the source agent's client: it yields ``(index, RequestOutput)`` for
  `EngineLoop.hand_off`, and raises `RelayError` on an error frame, a refusal or a stream that
  ends before the request finished.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

import httpx

if TYPE_CHECKING:
    from instance_agent.engine.llm_engine import RequestOutput


class RelayError(RuntimeError):
    """The destination could not stream the migrated request."""


def encode_output(output: RequestOutput, index: int) -> bytes:
    """One frame; `index` is the position of the output's first new token."""
    record = {
        "request_id": output.request_id,
        "index": index,
        "token_ids": output.new_token_ids,
        "text": output.text_delta,
        "finished": output.finished,
        "finish_reason": output.finish_reason,
        "num_prompt_tokens": output.num_prompt_tokens,
        "num_cached_tokens": output.num_cached_tokens,
    }
    return b"data: " + json.dumps(record, separators=(",", ":")).encode() + b"\n\n"


def _decode(record: dict[str, Any]) -> tuple[int, RequestOutput]:
    from instance_agent.engine.llm_engine import RequestOutput

    token_ids = [int(t) for t in record["token_ids"]]
    output = RequestOutput(
        request_id=str(record["request_id"]),
        new_token_ids=token_ids,
        output_token_ids=[],  # not carried: the follower only needs the new tokens
        text="",
        text_delta=str(record["text"]),
        finished=bool(record["finished"]),
        finish_reason=record["finish_reason"],
        num_prompt_tokens=int(record["num_prompt_tokens"]),
        num_cached_tokens=int(record["num_cached_tokens"]),
    )
    return int(record["index"]), output


async def follow(
    client: httpx.AsyncClient, base_url: str, request_id: str
) -> AsyncIterator[tuple[int, RequestOutput]]:
    """The outputs of `request_id` running on the agent at `base_url`, until it finishes."""
    url = f"{base_url.rstrip('/')}/kvherd/v1/requests/{request_id}/stream"
    async with client.stream("GET", url) as response:
        if response.status_code != 200:
            await response.aread()
            raise RelayError(f"{url} answered {response.status_code}: {response.text[:200]}")
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[len("data: ") :]
            if data == "[DONE]":
                break
            record = json.loads(data)
            if "error" in record:
                raise RelayError(str(record["error"].get("message")))
            try:
                index, output = _decode(record)
            except (KeyError, TypeError, ValueError) as exc:
                raise RelayError(f"malformed relay frame: {exc}") from exc
            yield index, output
            if output.finished:
                return
    raise RelayError(f"the stream of {request_id} ended before the request finished")
