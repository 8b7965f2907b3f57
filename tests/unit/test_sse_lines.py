"""`kvherd.sse_lines`: SSE lines end at LF only, whatever the JSON strings in them hold."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import httpx

from kvherd import sse_lines

# vLLM writes JSON with non-ASCII characters raw: these three end a line for str.splitlines.
TEXT = "a\u2028b\u2029c\x85d"
STREAM = (
    b"data: " + json.dumps({"choices": [{"text": TEXT}]}, ensure_ascii=False).encode() + b"\r\n\r\n"
    b"data: [DONE]\n\n"
)


def _chunks(size: int) -> list[bytes]:
    return [STREAM[i : i + size] for i in range(0, len(STREAM), size)]


def test_a_frame_with_unicode_line_breaks_in_its_text_stays_one_line() -> None:
    # What httpx's own line iterator makes of it: the frame cut at the first U+2028.
    assert next(httpx.Response(200, content=STREAM).iter_lines()).endswith('"text": "a')
    for size in (1, 3, 7, len(STREAM)):
        lines = list(sse_lines.lines(_chunks(size)))
        assert lines == [lines[0], "", "data: [DONE]", ""]
        assert json.loads(lines[0].removeprefix("data: "))["choices"][0]["text"] == TEXT


def test_the_async_form_and_a_last_line_without_its_end() -> None:
    async def chunks() -> AsyncIterator[bytes]:
        for chunk in [*_chunks(5), b"data: tail"]:
            yield chunk

    async def collect() -> list[str]:
        return [line async for line in sse_lines.alines(chunks())]

    lines = asyncio.run(collect())
    assert lines[2:] == ["data: [DONE]", "", "data: tail"]
    assert json.loads(lines[0].removeprefix("data: "))["choices"][0]["text"] == TEXT
