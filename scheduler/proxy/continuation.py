"""What the proxy relayed of a stream, and how to continue it on another instance when its own is lost.

Contract:
- `StreamLedger.feed(data)` takes upstream SSE bytes (migration notices already consumed) and
  returns the bytes to relay now: whole events only (the tail of a partial event waits for its
  end), without the agents' token-ledger comment lines (`kvherd.wire.LEDGER_PREFIX`). Every event
  relayed is kept, raw, and parsed only when a continuation is needed, so the happy path costs a
  search per chunk. An error frame from the instance (its engine died, its request was aborted)
  is not relayed: `feed` raises `UpstreamError` and the stream is continued like a broken one.
- A stream from a vLLM instance (`StreamLedger.from_vllm`) went out with ``return_token_ids``
  (`with_token_ids`: vLLM then names each chunk's ``token_ids`` and, once, the
  ``prompt_token_ids``); when the client did not ask for them they are relayed as ``null``, the
  bytes vLLM sends without the flag (a few byte searches per chunk, no parsing).
- `continuation(body)` reads what the client has and says how to continue (`Continued`), or None
  when the stream cannot be continued exactly. From a kvherd agent's ledger: the original body
  plus ``kvherd_continuation`` (`instance_agent.protocol.Continuation`: the output token ids, the
  text the client has seen, the sampling seed, the resume object with ``from`` = tokens relayed),
  for another agent; None without a ledger or with a gap in the token indexes. From vLLM: a
  streamed ``/v1/completions`` request for another vLLM instance with prompt = the prompt's token
  ids (as vLLM reported them) + the tokens relayed, ``max_tokens``/``min_tokens`` reduced by them
  and the same sampling parameters. It starts after the last token whose text was sent (vLLM
  primes its detokenizer with a token prompt, which sends the whole prompt's text when the
  prompt ends inside a character): greedy, the tokens after it are generated again, checked and
  not relayed twice, only the text they complete; sampled, they are replaced (not continued
  when the client has their ids). Its chunks are re-framed as the original stream's
  (its id, created, model; chat chunks for a chat stream; usage counting the original prompt and
  every generated token). Exact for greedy decoding; unseeded random sampling continues (a
  sample of the same distribution given the same tokens, not checked at the boundary); None (the
  error frame) for what a continuation cannot reproduce: a seed with random sampling (vLLM's
  seeded generator is not resumable), presence/frequency penalties (they count output tokens
  only), ``n`` > 1, logprobs, echo, structured output or tool calls. The continuation's own
  chunks extend the same ledger. Not exact either: a ``stop`` string that would have spanned the
  point where the stream was cut, or text vLLM held back to match one there.
- `output_tokens()`: the output tokens relayed so far (read like a continuation: once, at the end).
- `complete()`: the ``[DONE]`` frame was relayed. `finished`: a frame with a ``finish_reason``
  was; `closing_frames()` then end the client's stream when the instance was lost before its end
  (the usage chunk when asked for and not yet relayed, ``[DONE]``).
- `error_frame(message)`: the OpenAI error object as the stream's last data frame, then ``[DONE]``.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import orjson

from kvherd import wire
from scheduler.forwarding import UpstreamError

_LEDGER = re.compile(rb"^" + re.escape(wire.LEDGER_PREFIX) + rb"[^\n]*\n", re.MULTILINE)
# How vLLM's token id lists start (``"token_ids":[`` and ``"prompt_token_ids":[``). A quote
# inside a JSON string is escaped, so only keys match.
_TOKEN_IDS = b'token_ids":['
_ERROR = b'data: {"error"'
_DONE = b"data: [DONE]"

# Request fields a vLLM continuation carries over as they are (sampling, stopping, caching).
_CARRIED = (
    "model", "temperature", "top_p", "top_k", "min_p", "seed", "repetition_penalty",
    "logit_bias", "allowed_token_ids", "bad_words", "stop", "stop_token_ids",
    "include_stop_str_in_output", "ignore_eos", "skip_special_tokens",
    "spaces_between_special_tokens", "cache_salt", "priority", "user",
)  # fmt: skip
# Fields whose effect a continuation cannot reproduce when they are set (not null/false/0).
_NOT_CONTINUABLE = (
    "presence_penalty", "frequency_penalty", "logprobs", "top_logprobs", "prompt_logprobs",
    "echo", "best_of", "response_format", "structured_outputs", "guided_json", "guided_regex",
    "guided_choice", "guided_grammar", "use_beam_search",
)  # fmt: skip


def with_token_ids(body: dict[str, Any]) -> dict[str, Any] | None:
    """`body` asking vLLM for its token ids; None when the client already asked."""
    if body.get("return_token_ids") is True:
        return None
    return {**body, "return_token_ids": True}


@dataclass(slots=True)
class Continued:
    """How to continue a stream: `body` for `path` (None: the stream's own) on a kvherd agent
    (`on_agent`) or a vLLM instance, after `done` output tokens."""

    body: dict[str, Any]
    done: int
    on_agent: bool
    path: bytes | None = None


class StreamLedger:
    """The events of one client stream, across the instances that served it."""

    __slots__ = ("_done", "_events", "_pending", "_reframe", "_vllm", "finished")

    def __init__(self) -> None:
        self._events: list[bytes] = []
        self._pending = b""
        self.finished = False
        self._done = False
        self._vllm: _VllmStream | None = None
        self._reframe: _Reframe | None = None

    @classmethod
    def from_vllm(
        cls, body: dict[str, Any], chat: bool, decode: Callable[[list[int]], str]
    ) -> StreamLedger:
        """The ledger of a stream a vLLM instance serves `body` (sent `with_token_ids`);
        `decode` is the model's detokenizer (where a greedy continuation may start)."""
        ledger = cls()
        ledger._vllm = _VllmStream(body, chat, decode)
        return ledger

    def complete(self) -> bool:
        """The stream's ``[DONE]`` was relayed."""
        return self._done

    def last_events(self) -> bytes:
        """The last two pieces of events relayed (where a stream's usage chunk is)."""
        return b"".join(self._events[-2:])

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
        out = events
        if self._reframe is not None:  # raises before anything is kept if it cannot be
            events, out = self._reframe.events(events)
        self._events.append(events)
        if b'"finish_reason":"' in events:
            self.finished = True
        if _DONE in events:
            self._done = True
        vllm = self._vllm
        if vllm is not None:
            if self._reframe is not None:
                return out
            return _null_token_ids(events) if vllm.strip else events
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
                    relayed.data(orjson.loads(line[6:]), self._vllm is not None)
        if self._vllm is not None:
            relayed.resume = self._vllm.resume(relayed)
        return relayed

    def output_tokens(self) -> int | None:
        """The output tokens relayed (the agents' ledger, vLLM's token ids); None if unreadable."""
        try:
            return len(self._parse().token_ids)
        except (ValueError, TypeError, KeyError, IndexError, AttributeError):  # JSON errors too
            return None

    def continuation(self, body: dict[str, Any]) -> Continued | None:
        try:
            relayed = self._parse()
        except (orjson.JSONDecodeError, TypeError, KeyError, IndexError, AttributeError):
            return None
        if relayed.resume is None or relayed.gap:
            return None
        done = len(relayed.token_ids)
        if self._vllm is not None:
            plan = self._vllm.continuation(relayed)
            if plan is None:
                return None
            continued, start, regenerated = plan
            self._reframe = _Reframe(relayed.resume, start, regenerated, self._vllm)
            return Continued(continued, done, False, b"/v1/completions")
        resume = dict(relayed.resume)
        resume["from"] = done
        agent_body = dict(body)
        agent_body["kvherd_continuation"] = {
            "output_token_ids": relayed.token_ids,
            "emitted_text": relayed.text,
            "sampling_seed": relayed.sampling_seed,
            "resume": resume,
        }
        return Continued(agent_body, done, True)

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


def _null_token_ids(events: bytes) -> bytes:
    """`events` with every token id list written ``null`` (a few searches, no parsing)."""
    at = events.find(_TOKEN_IDS)
    if at < 0:
        return events
    parts = []
    start = 0
    while at >= 0:
        begin = at + len(_TOKEN_IDS) - 1
        parts.append(events[start:begin])
        parts.append(b"null")
        start = events.index(b"]", begin) + 1
        at = events.find(_TOKEN_IDS, start)
    parts.append(events[start:])
    return b"".join(parts)


def continuable_on_vllm(body: dict[str, Any]) -> bool:
    """Whether a vLLM stream of this request could be continued at all (module contract: not
    with a seed and random sampling, penalties, ``n`` > 1, logprobs, echo, structured output or
    tool calls), whatever it has streamed."""
    if any(body.get(name) for name in _NOT_CONTINUABLE):
        return False
    if body.get("n") not in (None, 1):
        return False
    if body.get("tools") and body.get("tool_choice") != "none":
        return False
    temperature = body.get("temperature")
    greedy = isinstance(temperature, (int, float)) and temperature < 1e-5  # vLLM's test
    return greedy or body.get("seed") is None  # vLLM's seeded generator cannot be resumed


def error_frame(message: str) -> bytes:
    error = wire.OpenAIError(502, message, type="server_error")
    return wire.sse(error.body()) + wire.SSE_DONE


class _Relayed:
    """The parsed events: ledger state, tokens, text (and what vLLM's chunks name)."""

    __slots__ = (
        "emitted", "first", "gap", "prompt_ids", "resume", "sampling_seed", "text", "token_ids",
        "usage",
    )  # fmt: skip

    def __init__(self) -> None:
        self.resume: dict[str, Any] | None = None
        self.sampling_seed: int | None = None
        self.token_ids: list[int] = []
        self.text = ""
        self.usage = False
        self.gap = False
        self.first: dict[str, Any] | None = None  # vLLM: the stream's first chunk
        self.prompt_ids: list[int] | None = None  # vLLM: the prompt's token ids
        self.emitted = 0  # vLLM: output tokens up to the last chunk with text

    def ledger(self, entry: dict[str, Any]) -> None:
        if "resume" in entry:
            if self.resume is None:  # a continuation repeats it: the first one is the stream's
                self.resume = dict(entry["resume"])
                self.sampling_seed = entry.get("sampling_seed")
            return
        if int(entry["index"]) != len(self.token_ids):
            self.gap = True
        self.token_ids.extend(int(t) for t in entry["token_ids"])

    def data(self, chunk: dict[str, Any], vllm: bool) -> None:
        if chunk.get("usage") and not chunk.get("choices"):
            self.usage = True
        if vllm:
            if self.first is None:
                self.first = chunk
            if self.prompt_ids is None and chunk.get("prompt_token_ids") is not None:
                self.prompt_ids = [int(t) for t in chunk["prompt_token_ids"]]  # chat
        for choice in chunk.get("choices") or ():
            if "text" in choice:
                self.text += choice["text"] or ""
            else:
                self.text += (choice.get("delta") or {}).get("content") or ""
            if vllm:
                self._vllm_choice(choice)
                if choice.get("text") or (choice.get("delta") or {}).get("content"):
                    self.emitted = len(self.token_ids)

    def _vllm_choice(self, choice: dict[str, Any]) -> None:
        if choice.get("index") != 0:
            self.gap = True  # several choices: not continued
        if self.prompt_ids is None and choice.get("prompt_token_ids") is not None:
            self.prompt_ids = [int(t) for t in choice["prompt_token_ids"]]  # completions
        if "token_ids" in choice:  # absent only from a chat stream's role chunk
            ids = choice["token_ids"]
            if ids is None:
                self.gap = True
            else:
                self.token_ids.extend(int(t) for t in ids)


class _VllmStream:
    """A client's streamed request as a vLLM instance serves it."""

    __slots__ = ("body", "chat", "decode", "strip")

    def __init__(
        self, body: dict[str, Any], chat: bool, decode: Callable[[list[int]], str]
    ) -> None:
        self.body = body
        self.chat = chat
        self.decode = decode
        self.strip = body.get("return_token_ids") is not True  # the proxy asked for the ids

    def _options(self) -> dict[str, Any]:
        options = self.body.get("stream_options")
        return options if isinstance(options, dict) else {}

    def resume(self, relayed: _Relayed) -> dict[str, Any] | None:
        """The stream's resume object (`instance_agent`'s shape), from its first chunk."""
        first, prompt_ids = relayed.first, relayed.prompt_ids
        if first is None or prompt_ids is None:
            return None
        options = self._options()
        return {
            "from": len(relayed.token_ids),
            "id": first["id"],
            "created": first["created"],
            "model": first["model"],
            "chat": self.chat,
            "prompt_tokens": len(prompt_ids),
            "return_token_ids": not self.strip,
            "continuous_usage_stats": options.get("continuous_usage_stats") is True,
            "include_usage": options.get("include_usage") is True,
        }

    def continuation(self, relayed: _Relayed) -> tuple[dict[str, Any], int, list[int]] | None:
        """The ``/v1/completions`` body that continues the stream on vLLM, the output token it
        starts at and the tokens the client has that it generates again (None: not exactly).

        vLLM detokenizes a token prompt by priming a ``DecodeStream`` with it, which yields the
        whole prompt's text when the prompt ends inside a character (a byte-level token whose
        text was held back). So a continuation starts after the last token whose text was sent
        and ends no character early. Greedy, the tokens after it are generated again (the same
        ones) and only their text relayed; sampled, they are replaced (the client saw no text
        of them), which a client that has their ids would notice: not continued."""
        body = self.body
        if not continuable_on_vllm(body) or relayed.prompt_ids is None:
            return None
        temperature = body.get("temperature")
        greedy = isinstance(temperature, (int, float)) and temperature < 1e-5  # vLLM's test
        ids = relayed.token_ids
        done = relayed.emitted
        while done > 0 and self.decode(ids[max(0, done - 4) : done]).endswith("\ufffd"):
            done -= 1  # a UTF-8 character takes at most 4 byte tokens
        if not greedy and done < len(ids) and not self.strip:
            return None
        continued: dict[str, Any] = {
            name: body[name] for name in _CARRIED if body.get(name) is not None
        }
        continued["prompt"] = relayed.prompt_ids + ids[:done]
        continued["stream"] = True
        continued["return_token_ids"] = True
        max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
        if isinstance(max_tokens, int):
            if max_tokens <= done:
                return None
            continued["max_tokens"] = max_tokens - done
        min_tokens = body.get("min_tokens")
        if isinstance(min_tokens, int) and min_tokens:
            continued["min_tokens"] = max(0, min_tokens - done)
        options = self._options()
        if options:
            continued["stream_options"] = {
                "include_usage": options.get("include_usage") is True,
                "continuous_usage_stats": options.get("continuous_usage_stats") is True,
            }
        return continued, done, ids[done:] if greedy else []


class _Reframe:
    """A vLLM continuation's completion chunks as the original stream's."""

    __slots__ = (
        "chat", "created", "done", "id", "keep_ids", "model", "prompt_tokens", "regenerated",
    )  # fmt: skip

    def __init__(
        self, resume: dict[str, Any], done: int, regenerated: list[int], stream: _VllmStream
    ) -> None:
        self.regenerated = regenerated  # tokens the client has, generated again first
        self.id = resume["id"]
        self.created = resume["created"]
        self.model = resume["model"]
        self.prompt_tokens = int(resume["prompt_tokens"])
        self.chat = stream.chat
        self.keep_ids = not stream.strip
        self.done = done

    def events(self, events: bytes) -> tuple[bytes, bytes]:
        """`events` as the ledger keeps them (without the tokens generated again) and as the
        client gets them."""
        kept, out = [], []
        for event in events.split(b"\n\n"):
            if event.startswith(b"data: ") and not event.startswith(_DONE):
                chunk = self._new_tokens(orjson.loads(event[6:]))
                if chunk is None:
                    continue
                kept.append(b"data: " + orjson.dumps(chunk) + b"\n\n")
                out.append(b"data: " + orjson.dumps(self._chunk(chunk)) + b"\n\n")
            elif event:
                kept.append(event + b"\n\n")
                out.append(event + b"\n\n")
        return b"".join(kept), b"".join(out)

    def _new_tokens(self, chunk: dict[str, Any]) -> dict[str, Any] | None:
        """`chunk` without the tokens the client has (None: nothing left to relay)."""
        if not self.regenerated:
            return chunk
        for choice in chunk.get("choices") or ():
            ids = choice.get("token_ids") or []
            again = min(len(ids), len(self.regenerated))
            if ids[:again] != self.regenerated[:again]:
                raise UpstreamError("the continuation generated other tokens than the stream")
            del self.regenerated[:again]
            choice["token_ids"] = ids[again:]
            if (
                again
                and not ids[again:]
                and not choice.get("text")
                and not choice.get("finish_reason")
            ):
                return None  # its empty text went out with the original
        return chunk

    def _chunk(self, chunk: dict[str, Any]) -> dict[str, Any]:
        usage = chunk.get("usage")
        if usage:
            completion = int(usage["completion_tokens"]) + self.done
            usage["prompt_tokens"] = self.prompt_tokens
            usage["total_tokens"] = self.prompt_tokens + completion
            usage["completion_tokens"] = completion
            details = usage.get("prompt_tokens_details")
            if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
                details["cached_tokens"] = min(details["cached_tokens"], self.prompt_tokens)
        framed = dict(chunk)  # vLLM's key order; usage and system_fingerprint stay
        framed["id"] = self.id
        if self.chat:
            framed["object"] = "chat.completion.chunk"
        framed["created"] = self.created
        framed["model"] = self.model
        framed["choices"] = [self._choice(choice) for choice in chunk.get("choices") or ()]
        return framed

    def _choice(self, choice: dict[str, Any]) -> dict[str, Any]:
        ids = choice.get("token_ids") if self.keep_ids else None
        if not self.chat:
            return {**choice, "prompt_token_ids": None, "token_ids": ids}
        framed: dict[str, Any] = {
            "index": choice.get("index", 0),
            "delta": {"content": choice.get("text") or ""},
            "logprobs": None,
            "finish_reason": choice.get("finish_reason"),
        }
        if choice.get("finish_reason") is not None:
            framed["stop_reason"] = choice.get("stop_reason")
        framed["token_ids"] = ids
        return framed
