"""Tokenizers for the engine and the proxy (torch-free: the proxy imports this module).

Contract:
- Every tokenizer offers ``encode(text) -> list[int]``, ``decode(ids) -> str``,
  ``apply_chat_template(messages) -> str``, ``eos_token_id`` and ``vocab_size``.
- `ByteTokenizer` is the default and needs no files: ids 0-255 are the UTF-8 bytes of the text, then
  the special tokens ``<|bos|> <|eos|> <|pad|> <|system|> <|user|> <|assistant|> <|end|>`` (256-262).
  A special token's text inside a prompt encodes to its id (as HF tokenizers do). Decoding skips
  special ids and ids past the tokenizer's vocabulary (a random model may emit them); invalid UTF-8
  decodes to U+FFFD.
- Chat template of `ByteTokenizer`: each message renders as ``<|{role}|>\\n{content}<|end|>\\n`` for
  roles system, user, assistant (and tool); a generation prompt ``<|assistant|>\\n`` follows. Content is
  a string or a list of OpenAI parts ``{"type": "text", "text": ...}``. Other shapes raise `ValueError`.
- `HFTokenizer` wraps ``transformers.AutoTokenizer`` for checkpoint directories that carry tokenizer
  files, loaded with ``local_files_only`` (never the network); transformers is imported lazily.
- `IncrementalDetokenizer` turns a growing list of output ids into text deltas for streaming; a
  character cut in the middle of its UTF-8 bytes is held back until complete (or until `flush`), so the
  concatenated deltas equal ``decode(all ids)``.
"""

from __future__ import annotations

import codecs
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, ClassVar, Protocol

BYTE_SPECIAL_TOKENS: tuple[str, ...] = (
    "<|bos|>",
    "<|eos|>",
    "<|pad|>",
    "<|system|>",
    "<|user|>",
    "<|assistant|>",
    "<|end|>",
)
BYTE_BOS_ID = 256
BYTE_EOS_ID = 257
BYTE_PAD_ID = 258
BYTE_VOCAB_SIZE = 256 + len(BYTE_SPECIAL_TOKENS)

_CHAT_ROLES = ("system", "user", "assistant", "tool")


class Tokenizer(Protocol):
    @property
    def eos_token_id(self) -> int | None: ...

    @property
    def vocab_size(self) -> int: ...

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]]) -> str: ...


def message_text(message: Mapping[str, Any]) -> tuple[str, str]:
    """(role, text) of one chat message; raises `ValueError` for a malformed message."""
    if not isinstance(message, Mapping):
        raise ValueError("each message must be an object with 'role' and 'content'")
    role = message.get("role")
    if role not in _CHAT_ROLES:
        raise ValueError(f"unsupported message role {role!r} (expected one of {_CHAT_ROLES})")
    content = message.get("content")
    if content is None:
        return role, ""
    if isinstance(content, str):
        return role, content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, Mapping) or part.get("type") != "text":
                raise ValueError("only text content parts are supported")
            text = part.get("text")
            if not isinstance(text, str):
                raise ValueError("a text content part needs a string 'text'")
            texts.append(text)
        return role, "".join(texts)
    raise ValueError("message content must be a string or a list of text parts")


class ByteTokenizer:
    """UTF-8 bytes plus a handful of special tokens; see the module docstring."""

    _special_re = re.compile("|".join(re.escape(t) for t in BYTE_SPECIAL_TOKENS))
    _special_ids: ClassVar[dict[str, int]] = {t: 256 + i for i, t in enumerate(BYTE_SPECIAL_TOKENS)}

    @property
    def eos_token_id(self) -> int:
        return BYTE_EOS_ID

    @property
    def bos_token_id(self) -> int:
        return BYTE_BOS_ID

    @property
    def vocab_size(self) -> int:
        return BYTE_VOCAB_SIZE

    def encode(self, text: str) -> list[int]:
        ids: list[int] = []
        pos = 0
        for match in self._special_re.finditer(text):
            ids.extend(text[pos : match.start()].encode("utf-8"))
            ids.append(self._special_ids[match.group()])
            pos = match.end()
        ids.extend(text[pos:].encode("utf-8"))
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]]) -> str:
        if isinstance(messages, str | bytes) or not isinstance(messages, Sequence) or not messages:
            raise ValueError("messages must be a non-empty list")
        parts = []
        for message in messages:
            role, text = message_text(message)
            parts.append(f"<|{role}|>\n{text}<|end|>\n")
        parts.append("<|assistant|>\n")
        return "".join(parts)


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")


class HFTokenizer:
    """A checkpoint's own tokenizer through transformers (local files only)."""

    def __init__(self, path: str) -> None:
        from transformers import AutoTokenizer  # lazy: heavy, and only checkpoints need it

        try:
            self._tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
        except Exception as exc:  # transformers raises many types for broken files
            raise ValueError(f"cannot load the tokenizer in {path!r}: {exc}") from exc

    @property
    def eos_token_id(self) -> int | None:
        eos = self._tok.eos_token_id
        return int(eos) if eos is not None else None

    @property
    def vocab_size(self) -> int:
        return len(self._tok)

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=True))

    def decode(self, ids: Sequence[int]) -> str:
        return str(self._tok.decode(list(ids), skip_special_tokens=True))

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]]) -> str:
        plain = [dict(zip(("role", "content"), message_text(m), strict=True)) for m in messages]
        if getattr(self._tok, "chat_template", None):
            return str(
                self._tok.apply_chat_template(plain, tokenize=False, add_generation_prompt=True)
            )
        # No template shipped with the checkpoint: the byte tokenizer's documented format.
        return ByteTokenizer().apply_chat_template(plain)


def has_tokenizer_files(path: str) -> bool:
    return any(os.path.isfile(os.path.join(path, f)) for f in _TOKENIZER_FILES)


def load_tokenizer(path: str | None = None) -> Tokenizer:
    """The checkpoint's tokenizer when `path` holds tokenizer files, else the byte tokenizer."""
    if path is not None and os.path.isdir(path) and has_tokenizer_files(path):
        return HFTokenizer(path)
    return ByteTokenizer()


class IncrementalDetokenizer:
    """Text deltas for a growing sequence of output ids (streaming, stop strings)."""

    # A held-back U+FFFD tail longer than this many ids is a real invalid sequence, not a cut char.
    _MAX_PENDING_IDS = 6

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self._ids: list[int] = []
        self._byte_decoder = (
            codecs.getincrementaldecoder("utf-8")(errors="replace")
            if isinstance(tokenizer, ByteTokenizer)
            else None
        )
        self._prefix_offset = 0  # start of the context window
        self._read_offset = 0  # ids up to here are already emitted as text

    def push(self, ids: Iterable[int]) -> str:
        """Append ids; return the text they complete."""
        new = list(ids)
        if self._byte_decoder is not None:
            return self._byte_decoder.decode(bytes(i for i in new if 0 <= i < 256))
        self._ids.extend(new)
        return self._emit(final=False)

    def flush(self) -> str:
        """The held-back tail at the end of generation."""
        if self._byte_decoder is not None:
            return self._byte_decoder.decode(b"", final=True)
        return self._emit(final=True)

    def _emit(self, final: bool) -> str:
        tok = self._tokenizer
        prefix_text = tok.decode(self._ids[self._prefix_offset : self._read_offset])
        full_text = tok.decode(self._ids[self._prefix_offset :])
        pending = len(self._ids) - self._read_offset
        if len(full_text) <= len(prefix_text):
            return ""
        if full_text.endswith("\ufffd") and not final and pending < self._MAX_PENDING_IDS:
            return ""  # likely a character split across tokens; wait for the rest
        delta = full_text[len(prefix_text) :]
        # The ids just emitted become the context of the next decode: leading-space rules of
        # SentencePiece/BPE depend on the previous token.
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        return delta
