"""A minimal, fast OpenAI-compatible server: the benchmark backend for bench/proxy_bench.py.

Contract: answers ``POST /v1/completions`` and ``POST /v1/chat/completions`` (JSON, or SSE when the
body has ``"stream": true``) with a fixed short completion, ``GET /v1/models`` and ``GET /health``,
over HTTP/1.1 keep-alive, and takes ``POST /v1/traces`` (an OTLP/HTTP sink: 200, body ignored);
for the peer routers in front of it (bench/proxy_bench.py): sglang-router's probes
``GET /server_info`` and ``/model_info`` (no model path, so it loads no tokenizer), and
vllm-router's ``POST /v1/completions/render``, which its cache_aware policy asks on every request
(one rendered prompt: the prompt's UTF-8 bytes as token ids, kvherd's ``byte`` tokenizer);
with ``--queued N`` also ``GET /metrics`` in vLLM's names, saying N
requests wait (a backend that looks saturated to admission: bench/refusal_cost.py). It does no
model work at all, so a benchmark in front of it measures the proxy's own cost. It is a plain
asyncio protocol (uvloop when installed) rather than a web framework, because a framework's
per-request overhead would hide the proxy's.

Run: ``python bench/fast_backend.py --port 9000``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from typing import cast

_COMPLETION = json.dumps(
    {
        "id": "cmpl-fast",
        "object": "text_completion",
        "created": 0,
        "model": "tiny",
        "choices": [{"index": 0, "text": " ok", "logprobs": None, "finish_reason": "length"}],
        "usage": {"prompt_tokens": 8, "completion_tokens": 1, "total_tokens": 9},
    },
    separators=(",", ":"),
).encode()
_CHAT = json.dumps(
    {
        "id": "chatcmpl-fast",
        "object": "chat.completion",
        "created": 0,
        "model": "tiny",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "ok"},
                "finish_reason": "length",
            }
        ],
        "usage": {"prompt_tokens": 8, "completion_tokens": 1, "total_tokens": 9},
    },
    separators=(",", ":"),
).encode()
_SSE = (
    b'data: {"id":"cmpl-fast","object":"text_completion","created":0,"model":"tiny",'
    b'"choices":[{"index":0,"text":" ok","logprobs":null,"finish_reason":"length"}]}\n\n'
    b"data: [DONE]\n\n"
)
_MODELS = json.dumps(
    {
        "object": "list",
        "data": [{"id": "tiny", "object": "model", "created": 0, "owned_by": "kvherd"}],
    }
).encode()
# SGLang's /server_info and /model_info, without a model path: given one, sglang-router tries to
# download its tokenizer from the Hugging Face hub.
_SERVER_INFO = json.dumps({"dp_size": 1}).encode()
_MODEL_INFO = json.dumps({"is_generation": True}).encode()
_NOT_FOUND = json.dumps(
    {"error": {"message": "not found", "type": "not_found_error", "param": None, "code": 404}}
).encode()


def _response(status: bytes, body: bytes, content_type: bytes = b"application/json") -> bytes:
    return (
        b"HTTP/1.1 "
        + status
        + b"\r\ncontent-type: "
        + content_type
        + b"\r\ncontent-length: "
        + str(len(body)).encode()
        + b"\r\n\r\n"
        + body
    )


_RESPONSES = {
    b"/v1/completions": _response(b"200 OK", _COMPLETION),
    b"/v1/chat/completions": _response(b"200 OK", _CHAT),
    b"/v1/models": _response(b"200 OK", _MODELS),
    b"/health": _response(b"200 OK", b""),
    b"/v1/traces": _response(b"200 OK", b"", b"application/x-protobuf"),
    b"/server_info": _response(b"200 OK", _SERVER_INFO),
    b"/model_info": _response(b"200 OK", _MODEL_INFO),
}
_STREAM = _response(b"200 OK", _SSE, b"text/event-stream")
_MISSING = _response(b"404 Not Found", _NOT_FOUND)
_RENDER = b"/v1/completions/render"


def _render(body: bytes) -> bytes:
    """vLLM's /v1/completions/render answer: one GenerateRequest, the prompt's bytes as tokens."""
    prompt = json.loads(body).get("prompt", "")
    tokens = list(prompt.encode()) if isinstance(prompt, str) else prompt
    return _response(b"200 OK", json.dumps([{"request_id": "fast", "token_ids": tokens}]).encode())


class _HTTPProtocol(asyncio.Protocol):
    """HTTP/1.1 with Content-Length bodies and pipelining; enough for OpenAI clients and proxies."""

    __slots__ = ("_buffer", "_transport")

    def __init__(self) -> None:
        self._buffer = b""
        self._transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(
            asyncio.Transport, transport
        )  # uvloop's transports are not subclasses

    def data_received(self, data: bytes) -> None:
        self._buffer += data
        out: list[bytes] = []
        while True:
            head_end = self._buffer.find(b"\r\n\r\n")
            if head_end < 0:
                break
            head = self._buffer[:head_end]
            length = 0
            lowered = head.lower()
            cl = lowered.find(b"content-length:")
            if cl >= 0:
                line_end = lowered.find(b"\r\n", cl)
                length = int(lowered[cl + 15 : line_end if line_end >= 0 else None])
            total = head_end + 4 + length
            if len(self._buffer) < total:
                break
            body = self._buffer[head_end + 4 : total]
            self._buffer = self._buffer[total:]
            path = head[head.find(b" ") + 1 : head.find(b" HTTP/")].split(b"?")[0]
            if path == _RENDER:
                out.append(_render(body))
            elif b'"stream":true' in body.replace(b" ", b"") and path != b"/v1/models":
                out.append(_STREAM)
            else:
                out.append(_RESPONSES.get(path, _MISSING))
        if out and self._transport is not None:
            self._transport.write(b"".join(out))


async def serve(host: str, port: int) -> None:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(_HTTPProtocol, host, port, backlog=1024, reuse_address=True)
    async with server:
        await server.serve_forever()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=9000)
    parser.add_argument("--queued", type=int, default=None, help="serve /metrics saying N wait")
    args = parser.parse_args()
    if args.queued is not None:
        metrics = (
            b"vllm:num_requests_running 1\nvllm:num_requests_waiting %d\n" % args.queued
        )
        _RESPONSES[b"/metrics"] = _response(b"200 OK", metrics, b"text/plain; version=0.0.4")
    try:
        import uvloop

        uvloop.install()
    except ImportError:  # plain asyncio still works, just slower
        pass
    print(
        f"fast backend on http://{args.host}:{args.port} (started {time.strftime('%X')})",
        flush=True,
    )
    asyncio.run(serve(args.host, args.port))


if __name__ == "__main__":
    main()
