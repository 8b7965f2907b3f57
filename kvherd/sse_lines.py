"""The lines of a server-sent event stream, split where SSE splits them.

Contract:
- `lines(chunks)` and `alines(chunks)` turn a response's bytes (httpx's ``iter_bytes`` /
  ``aiter_bytes``) into its lines, decoded as UTF-8, without their LF or CR LF ending; a last line
  without one is yielded too.
- Lines end at LF only. httpx's ``iter_lines`` also ends them at U+2028, U+2029, U+0085 and the
  other ``str.splitlines`` breaks, which JSON leaves unescaped inside strings: a completion whose
  text holds one (random tiny models write them) split its ``data:`` frame in two, and the frame's
  JSON failed to parse.
"""

from __future__ import annotations

from collections.abc import AsyncIterable, AsyncIterator, Iterable, Iterator


def _text(line: bytes) -> str:
    return line.removesuffix(b"\r").decode("utf-8", errors="replace")


def _split(pending: bytes, chunk: bytes) -> tuple[list[str], bytes]:
    """The complete lines of `pending` + `chunk`, and the unended rest."""
    *complete, rest = (pending + chunk).split(b"\n")
    return [_text(line) for line in complete], rest


def lines(chunks: Iterable[bytes]) -> Iterator[str]:
    pending = b""
    for chunk in chunks:
        complete, pending = _split(pending, chunk)
        yield from complete
    if pending:
        yield _text(pending)


async def alines(chunks: AsyncIterable[bytes]) -> AsyncIterator[str]:
    pending = b""
    async for chunk in chunks:
        complete, pending = _split(pending, chunk)
        for line in complete:
            yield line
    if pending:
        yield _text(pending)
