"""Tokenizers for the engine and the proxy (torch-free: the proxy imports this module).

Contract:
- Every tokenizer offers ``encode(text, add_special_tokens=True) -> list[int]``, ``decode(ids) ->
  str``, ``render_chat(prompt) -> str`` (a `kvherd.chat_render.ChatPrompt`: the chat template's
  inputs as vLLM builds them), ``eos_token_id`` and ``vocab_size``. `chat_token_ids` is a chat
  request's prompt ids as vLLM computes them: the rendered text encoded with the request's
  ``add_special_tokens`` (false by default: the template emits BOS itself, so BOS appears once);
  a rendered text that is not valid Unicode (a lone UTF-16 surrogate from a JSON escape in any
  field the template reads: a content part, a name, a tool) raises `ChatRenderError`, a 400.
- `ByteTokenizer` is the default and needs no files: ids 0-255 are the UTF-8 bytes of the text, then
  the special tokens ``<|bos|> <|eos|> <|pad|> <|system|> <|user|> <|assistant|> <|end|>`` (256-262).
  A special token's text inside a prompt encodes to its id (as HF tokenizers do); it adds no special
  tokens of its own. Decoding skips special ids and ids past the tokenizer's vocabulary (a random
  model may emit them); invalid UTF-8 decodes to U+FFFD.
- Chat template of `ByteTokenizer`: each message renders as ``<|{role}|>\\n{content}<|end|>\\n`` (any
  role; content in vLLM's string format; developer messages become system ones, as vLLM does for a
  template that does not name that role); a generation prompt ``<|assistant|>\\n`` follows when asked
  for, and with ``continue_final_message`` the last message stays open (no ``<|end|>``).
- `HFTokenizer` wraps ``transformers.AutoTokenizer`` for directories that carry tokenizer files,
  loaded with ``local_files_only`` (never the network); transformers and jinja2 are imported lazily
  and, when missing, fail at load time with `TokenizerUnavailable` naming the ``tokenizer`` extra.
  Its chat template is parsed at load time; `template_facts` reads off what vLLM reads (content
  format: "openai" when a loop iterates over a message's content, else "string"; whether the
  developer role is named; the template's variables, which filter the extra template kwargs). A
  checkpoint without a chat template renders in the byte tokenizer's format.
- `load_tokenizer(spec, strict=)`: ``None``/``"byte"`` is the byte tokenizer, a directory with
  tokenizer files its HF tokenizer; anything else is the byte tokenizer, or `TokenizerUnavailable`
  when strict. `tokenizer_spec_for_model` maps an agent's ``--model`` to the spec that tokenizes
  like it.
- `IncrementalDetokenizer` turns a growing list of output ids into text deltas for streaming; a
  character cut in the middle of its UTF-8 bytes is held back until complete (or until `flush`), so the
  concatenated deltas equal ``decode(all ids)``.
"""

from __future__ import annotations

import codecs
import functools
import os
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

from kvherd.chat_render import ChatPrompt, ChatRenderError, ContentFormat

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

BYTE_TOKENIZER = "byte"  # the spec naming the byte tokenizer


class Tokenizer(Protocol):
    @property
    def eos_token_id(self) -> int | None: ...

    @property
    def vocab_size(self) -> int: ...

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def render_chat(self, prompt: ChatPrompt) -> str: ...


def lone_surrogate_at(text: str) -> int | None:
    """Where `text` holds a lone UTF-16 surrogate (a JSON escape such as ``"\\ud800"`` decodes to
    one), which no tokenizer, hash or UTF-8 writer can encode; None when it has none."""
    if text.isascii():
        return None
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        return exc.start
    return None


def chat_token_ids(tokenizer: Tokenizer, prompt: ChatPrompt) -> list[int]:
    """The prompt ids of a chat request, as vLLM computes them: render, then encode."""
    text = tokenizer.render_chat(prompt)
    at = lone_surrogate_at(text)
    if at is not None:
        raise ChatRenderError(
            f"messages: not valid Unicode (a lone surrogate, {text[at]!a})", "messages"
        )
    return tokenizer.encode(text, prompt.add_special_tokens)


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

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
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

    def render_chat(self, prompt: ChatPrompt) -> str:
        # The byte template names no developer role: developer messages become system ones.
        conversation = prompt.conversation("string", developer_role=False)
        parts = [f"<|{m['role']}|>\n{m['content']}<|end|>\n" for m in conversation]
        if prompt.continue_final_message:
            parts[-1] = parts[-1].removesuffix("<|end|>\n")
        elif prompt.add_generation_prompt:
            parts.append("<|assistant|>\n")
        return "".join(parts)


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")
# Template inputs transformers' apply_chat_template takes as its own arguments.
_HF_TEMPLATE_ARGS = frozenset({"add_generation_prompt", "continue_final_message", "documents"})
TOKENIZER_EXTRA_HINT = "pip install 'kvherd[tokenizer]'"


class TokenizerUnavailable(ValueError):
    """A tokenizer that cannot be used: missing packages, files or a broken chat template."""


@dataclass(frozen=True)
class TemplateFacts:
    """What vLLM reads off a chat template before rendering it."""

    content_format: ContentFormat  # "openai" when the template loops over message content
    developer_role: bool  # the template names the developer role
    variables: frozenset[str]  # its undeclared variables (the kwargs it can read)


@functools.lru_cache(maxsize=32)
def template_facts(template: str) -> TemplateFacts:
    """Parse a chat template (jinja2, with transformers' extensions) and read off its facts."""
    import jinja2.meta
    import jinja2.nodes
    from transformers.utils.chat_template_utils import _compile_jinja_template

    try:
        ast = _compile_jinja_template(template).environment.parse(template)
    except jinja2.TemplateError as exc:
        raise TokenizerUnavailable(f"the chat template does not parse: {exc}") from exc
    return TemplateFacts(
        content_format="openai" if _loops_over_content(ast) else "string",
        developer_role='"developer"' in template or "'developer'" in template,
        variables=frozenset(jinja2.meta.find_undeclared_variables(ast)),
    )


def _loops_over_content(ast: Any) -> bool:
    """vLLM's content-format rule: some loop iterates over a message's ``content``."""
    from jinja2 import nodes

    def access(node: Any, names: set[str], key: str | None = None) -> bool:
        while True:  # filters, tests and slices of an access are the access
            if (isinstance(node, nodes.Filter | nodes.Test) and node.node is not None) or (
                isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Slice)
            ):
                node = node.node
            else:
                break
        if key is None:
            return isinstance(node, nodes.Name) and node.ctx == "load" and node.name in names
        if isinstance(node, nodes.Getitem):
            keyed = isinstance(node.arg, nodes.Const) and node.arg.value == key
        elif isinstance(node, nodes.Getattr):
            keyed = node.attr == key
        else:
            return False
        return keyed and access(node.node, names)

    lists = {"messages"}  # names bound to the message list (or a filtered/sliced copy)
    grew = True
    while grew:
        grew = False
        for assign in ast.find_all(nodes.Assign):
            target = assign.target
            named = isinstance(target, nodes.Name) and target.name not in lists
            if named and access(assign.node, lists):
                lists.add(target.name)
                grew = True
    loops = list(ast.find_all(nodes.For))
    items = {
        loop.target.name
        for loop in loops
        if isinstance(loop.target, nodes.Name) and access(loop.iter, lists)
    }
    if any(access(loop.iter, items, "content") for loop in loops):
        return True
    in_macros: set[int] = set()
    for macro in ast.find_all(nodes.Macro):
        params = {arg.name for arg in macro.args}
        bound: set[str] = set()
        for call in ast.find_all(nodes.Call):
            if not (isinstance(call.node, nodes.Name) and call.node.name == macro.name):
                continue
            for i, arg in enumerate(call.args):
                if i < len(macro.args) and access(arg, items, "content"):
                    bound.add(macro.args[i].name)
            for kw in call.kwargs:
                if kw.key in params and access(kw.value, items, "content"):
                    bound.add(kw.key)
        for loop in macro.find_all(nodes.For):
            in_macros.add(id(loop))
            if isinstance(loop.iter, nodes.Name) and loop.iter.name in bound:
                return True
    return any(
        id(loop) not in in_macros
        and isinstance(loop.iter, nodes.Name)
        and loop.iter.name == "content"
        for loop in loops
    )


class HFTokenizer:
    """A checkpoint's own tokenizer through transformers (local files only)."""

    def __init__(self, path: str) -> None:
        try:  # lazy: heavy, and only checkpoints need them
            import jinja2  # noqa: F401  (chat templates render with it)
            from transformers import AutoTokenizer
        except ModuleNotFoundError as exc:
            raise TokenizerUnavailable(
                f"the tokenizer in {path!r} needs the package {exc.name!r}: {TOKENIZER_EXTRA_HINT}"
            ) from exc
        try:
            self._tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
        except Exception as exc:  # transformers raises many types for broken files
            raise TokenizerUnavailable(f"cannot load the tokenizer in {path!r}: {exc}") from exc
        self._template: str | None = None
        if getattr(self._tok, "chat_template", None):
            self._template = self._tok.get_chat_template()
            template_facts(self._template)  # a broken template fails here, not per request

    @property
    def eos_token_id(self) -> int | None:
        eos = self._tok.eos_token_id
        return int(eos) if eos is not None else None

    @property
    def vocab_size(self) -> int:
        return len(self._tok)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, ids: Sequence[int]) -> str:
        return str(self._tok.decode(list(ids), skip_special_tokens=True))

    def render_chat(self, prompt: ChatPrompt) -> str:
        """The template rendered as vLLM renders it; template errors raise `ChatRenderError`."""
        template = prompt.chat_template or self._template
        if template is None:
            # No template shipped with the checkpoint: the byte tokenizer's documented format.
            return ByteTokenizer().render_chat(prompt)
        try:
            facts = template_facts(template)
        except TokenizerUnavailable as exc:
            raise ChatRenderError(str(exc), param="chat_template") from exc
        conversation = prompt.conversation(facts.content_format, facts.developer_role)
        kwargs = {
            k: v
            for k, v in prompt.template_kwargs.items()
            if k in facts.variables or k in _HF_TEMPLATE_ARGS
        }
        tools: list[Any] | None = prompt.tools
        try:
            text = self._tok.apply_chat_template(
                conversation, tools=tools, chat_template=template, tokenize=False, **kwargs
            )
        except Exception as exc:  # a template may raise any error type for any input
            raise ChatRenderError(f"the chat template rejected the request: {exc}") from exc
        return str(text)


def has_tokenizer_files(path: str) -> bool:
    return any(os.path.isfile(os.path.join(path, f)) for f in _TOKENIZER_FILES)


def load_tokenizer(spec: str | None = None, *, strict: bool = False) -> Tokenizer:
    """The tokenizer `spec` names.

    ``None`` or ``"byte"``: the byte tokenizer. A directory holding tokenizer files (an HF
    checkpoint or a saved tokenizer): its HF tokenizer. Anything else is the byte tokenizer, or,
    when `strict` (a user's ``--tokenizer``), raises `TokenizerUnavailable`.
    """
    if spec is None or spec == BYTE_TOKENIZER:
        return ByteTokenizer()
    if os.path.isdir(spec) and has_tokenizer_files(spec):
        return HFTokenizer(spec)
    if strict:
        where = "a directory without tokenizer files" if os.path.isdir(spec) else "not a directory"
        raise TokenizerUnavailable(
            f"tokenizer {spec!r} is {where}: give a model or tokenizer directory holding "
            f"{', '.join(_TOKENIZER_FILES[:2])} (or {BYTE_TOKENIZER!r} for the byte tokenizer)"
        )
    return ByteTokenizer()


def tokenizer_spec_for_model(model: str) -> str:
    """The `load_tokenizer` spec that tokenizes like an agent serving `model` (preset or dir)."""
    return model if os.path.isdir(model) and has_tokenizer_files(model) else BYTE_TOKENIZER


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
