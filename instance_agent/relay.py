"""Following a request that migrated to another agent, for a client that cannot reattach itself.

Contract:
- `follow` is the source agent's client of the one continuation protocol the proxy speaks too:
  it ``POST``s a resume object (``from`` = `start`, the tokens the client already has) to
  ``DST/kvherd/v1/requests/{request_id}/resume`` with the token ledger
  (`kvherd.wire.TOKEN_IDS_HEADER`) and ``X-Kvherd-Reattach: 1``, and turns the completions
  stream it gets back into the engine's outputs: each ledger line ``{"index", "token_ids"}``
  gives the tokens of the data chunk after it (text, finish reason); a chunk without a ledger
  line carries no tokens. `num_prompt_tokens` and `num_cached_tokens` are the request's, as it
  left the source (the destination adopts the same counts).
- It yields ``(index, RequestOutput)`` for `EngineLoop.hand_off` (``index``: position of the
  output's first new token in the whole output), and follows the request on when it migrates
  again (the destination ends with a migration notice; the next ``/resume`` goes where it points).
- Raises `RelayError` on a refusal (e.g. 404: no such request waiting there), an error frame,
  a malformed frame, or a stream that ends before the request finished. Closing the generator
  closes the connection, which aborts the request at the destination.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

import httpx

from kvherd import sse_lines, wire

if TYPE_CHECKING:
    from instance_agent.engine.llm_engine import RequestOutput

REATTACH_HEADER = "x-kvherd-reattach"
_HEADERS = {wire.TOKEN_IDS_HEADER: "1", REATTACH_HEADER: "1"}


class RelayError(RuntimeError):
    """The destination could not stream the migrated request."""


def resume_object(request_id: str, start: int, num_prompt_tokens: int) -> dict[str, Any]:
    """A plain completions stream of `request_id` from output token `start` (nothing the
    relay does not read: no token ids in the chunks, no usage)."""
    return {
        "from": start,
        "id": f"relay-{request_id}",
        "created": 0,
        "model": "",
        "chat": False,
        "prompt_tokens": num_prompt_tokens,
        "return_token_ids": False,
        "continuous_usage_stats": False,
        "include_usage": False,
    }


async def follow(
    client: httpx.AsyncClient,
    base_url: str,
    request_id: str,
    *,
    start: int,
    num_prompt_tokens: int,
    num_cached_tokens: int,
) -> AsyncIterator[tuple[int, RequestOutput]]:
    """The outputs of `request_id` from token `start` on, running at `base_url`, until it finishes."""
    from instance_agent.engine.llm_engine import RequestOutput

    url = f"{base_url.rstrip('/')}/kvherd/v1/requests/{request_id}/resume"
    resume = resume_object(request_id, start, num_prompt_tokens)
    while True:
        notice: dict[str, Any] | None = None
        async with client.stream("POST", url, json=resume, headers=_HEADERS) as response:
            if response.status_code != 200:
                await response.aread()
                raise RelayError(f"{url} answered {response.status_code}: {response.text[:200]}")
            pending: tuple[int, list[int]] | None = None  # the ledger line of the next chunk
            index = int(resume["from"])
            async for line in sse_lines.alines(response.aiter_bytes()):
                if line.startswith(wire.LEDGER_PREFIX.decode()):
                    entry = _json(line[len(wire.LEDGER_PREFIX) :])
                    if "index" in entry:  # not the other kinds of ledger lines
                        try:
                            pending = int(entry["index"]), [int(t) for t in entry["token_ids"]]
                        except (KeyError, TypeError, ValueError) as exc:
                            raise RelayError(f"malformed ledger line: {exc}") from exc
                    continue
                if not line.startswith("data: "):
                    continue
                if line.encode().startswith(wire.NOTICE_PREFIX):
                    try:
                        notice = wire.parse_migration_notice(line.encode())
                    except ValueError as exc:
                        raise RelayError(str(exc)) from exc
                    break
                data = line[len("data: ") :]
                if data == "[DONE]":
                    break
                record = _json(data)
                if "error" in record:
                    raise RelayError(str(record["error"].get("message")))
                try:
                    choice = record["choices"][0]
                    text, finish = str(choice["text"]), choice["finish_reason"]
                except (KeyError, IndexError, TypeError) as exc:
                    raise RelayError(f"malformed relayed chunk: {exc}") from exc
                index, token_ids = pending if pending is not None else (index, [])
                pending = None
                output = RequestOutput(
                    request_id=request_id,
                    new_token_ids=token_ids,
                    output_token_ids=[],  # not carried: the follower only needs the new tokens
                    text="",
                    text_delta=text,
                    finished=finish is not None,
                    finish_reason=finish,
                    num_prompt_tokens=num_prompt_tokens,
                    num_cached_tokens=num_cached_tokens,
                )
                yield index, output
                if output.finished:
                    return
                index += len(token_ids)
        if notice is None:
            raise RelayError(f"the stream of {request_id} ended before the request finished")
        try:
            url = f"{str(notice['migrated_to']).rstrip('/')}/kvherd/v1/requests/{request_id}/resume"
            resume = dict(notice["resume"])
        except (KeyError, TypeError, ValueError) as exc:
            raise RelayError(f"malformed migration notice: {exc}") from exc


def _json(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise RelayError(f"malformed relayed frame: {exc}") from exc
    if not isinstance(value, dict):
        raise RelayError("malformed relayed frame: not an object")
    return value
