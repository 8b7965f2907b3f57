"""What the proxy relayed of a stream, and how to continue it on another instance when its own is lost.

Contract:
- `StreamLedger.feed(data)` takes upstream SSE bytes (migration notices already consumed) and
  returns the bytes to relay now: whole events only (the tail of a partial event waits for its
  end), without the agents' token-ledger comment lines (`kvherd.wire.LEDGER_PREFIX`). Every event
  relayed is kept, raw, and parsed only when a continuation is needed, so the happy path costs a
  search per chunk. An error frame from the instance (its engine died, its request was aborted)
  is not relayed: `feed` raises `UpstreamError` and the stream is continued like a broken one.
- `continuation_body(body)` reads what the client has: the original body (a dict) plus
  ``kvherd_continuation`` (`instance_agent.protocol.Continuation`: the output token ids, the text
  the client has seen, the sampling seed, the resume object with ``from`` = tokens relayed). None
  when the stream cannot be continued exactly: no ledger (not a kvherd agent) or a gap in the
  token indexes. The continuation's own ledger lines extend the same ledger.
- `complete()`: the ``[DONE]`` frame was relayed. `finished`: a frame with a ``finish_reason``
  was; `closing_frames()` then end the client's stream when the instance was lost before its end
  (the usage chunk when asked for and not yet relayed, ``[DONE]``).
- `error_frame(message)`: the OpenAI error object as the stream's last data frame, then ``[DONE]``.
"""

from __future__ import annotations

import re
from typing import Any

import orjson

from kvherd import wire
from scheduler.proxy.forwarding import UpstreamError

_LEDGER = re.compile(rb"^" + re.escape(wire.LEDGER_PREFIX) + rb"[^\n]*\n", re.MULTILINE)
_ERROR = b'data: {"error"'
_DONE = b"data: [DONE]"


class StreamLedger:
    """The events of one client stream, across the instances that served it."""

    __slots__ = ("_done", "_events", "_pending", "finished")

    def __init__(self) -> None:
        self._events: list[bytes] = []
        self._pending = b""
        self.finished = False
        self._done = False

    def complete(self) -> bool:
        """The stream's ``[DONE]`` was relayed."""
        return self._done

    def feed(self, data: bytes) -> bytes:
        if self._pending:
            data = self._pending + data
        end = data.rfind(b"\n\n")
        if end < 0:
            self._pending = data
            return b""
        end += 2
        events, self._pending = data[:end], data[end:]
        if _ERROR in events:
            at = events.find(_ERROR)
            if at == 0 or events[at - 1 : at] == b"\n":  # a data line, not text inside one
                before = events.rfind(b"\n\n", 0, at) + 2 if at else 0
                if before:
                    self._keep(events[:before])
                message = events[at : events.find(b"\n", at)].decode("utf-8", "replace")
                raise UpstreamError(f"instance ended the stream with an error: {message[:200]}")
        return self._keep(events)

    def _keep(self, events: bytes) -> bytes:
        self._events.append(events)
        if b'"finish_reason":"' in events:
            self.finished = True
        if _DONE in events:
            self._done = True
        if wire.LEDGER_PREFIX in events:
            return _LEDGER.sub(b"", events)
        return events

    # -- reading what was relayed (only when a continuation is needed) ----------------------------
    def _parse(self) -> _Relayed:
        relayed = _Relayed()
        for chunk in self._events:
            for line in chunk.split(b"\n"):
                if line.startswith(wire.LEDGER_PREFIX):
                    relayed.ledger(orjson.loads(line[len(wire.LEDGER_PREFIX) :]))
                elif line.startswith(b"data: ") and not line.startswith(_DONE):
                    relayed.data(orjson.loads(line[6:]))
        return relayed

    def continuation_body(self, body: dict[str, Any]) -> dict[str, Any] | None:
        try:
            relayed = self._parse()
        except (orjson.JSONDecodeError, TypeError, KeyError, IndexError, AttributeError):
            return None
        if relayed.resume is None or relayed.gap:
            return None
        resume = dict(relayed.resume)
        resume["from"] = len(relayed.token_ids)
        continued = dict(body)
        continued["kvherd_continuation"] = {
            "output_token_ids": relayed.token_ids,
            "emitted_text": relayed.text,
            "sampling_seed": relayed.sampling_seed,
            "resume": resume,
        }
        return continued

    def closing_frames(self) -> bytes:
        frames = b""
        relayed = self._parse()
        resume = relayed.resume
        if resume is not None and resume.get("include_usage") and not relayed.usage:
            prompt_tokens = int(resume.get("prompt_tokens", 0))
            completion_tokens = len(relayed.token_ids)
            usage = {
                "prompt_tokens": prompt_tokens,
                "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens,
                "prompt_tokens_details": {"cached_tokens": 0},
            }
            chat = bool(resume.get("chat"))
            frames += wire.sse(
                {
                    "id": resume.get("id"),
                    "object": "chat.completion.chunk" if chat else "text_completion",
                    "created": resume.get("created"),
                    "model": resume.get("model"),
                    "choices": [],
                    "usage": usage,
                }
            )
        return frames + wire.SSE_DONE


def error_frame(message: str) -> bytes:
    error = wire.OpenAIError(502, message, type="server_error")
    return wire.sse(error.body()) + wire.SSE_DONE


class _Relayed:
    """The parsed events: ledger state, tokens, text."""

    __slots__ = ("gap", "resume", "sampling_seed", "text", "token_ids", "usage")

    def __init__(self) -> None:
        self.resume: dict[str, Any] | None = None
        self.sampling_seed: int | None = None
        self.token_ids: list[int] = []
        self.text = ""
        self.usage = False
        self.gap = False

    def ledger(self, entry: dict[str, Any]) -> None:
        if "resume" in entry:
            if self.resume is None:  # a continuation repeats it: the first one is the stream's
                self.resume = dict(entry["resume"])
                self.sampling_seed = entry.get("sampling_seed")
            return
        if int(entry["index"]) != len(self.token_ids):
            self.gap = True
        self.token_ids.extend(int(t) for t in entry["token_ids"])

    def data(self, chunk: dict[str, Any]) -> None:
        if chunk.get("usage") and not chunk.get("choices"):
            self.usage = True
        for choice in chunk.get("choices") or ():
            if "text" in choice:
                self.text += choice["text"] or ""
            else:
                self.text += (choice.get("delta") or {}).get("content") or ""
