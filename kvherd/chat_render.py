"""A chat completions body turned into the chat template's inputs exactly as vLLM 0.32 builds them.

The proxy routes a chat request by the token ids the engine will compute for it, so it must render
the template with the same inputs vLLM renders it with; kvherd's own agent renders through this
module too, so its engine tokens equal the proxy's routing tokens. Pure: no transformers, no jinja2.

Contract:
- `parse_chat(body)` validates an OpenAI chat body and returns a `ChatPrompt`; anything vLLM would
  refuse raises `ChatRenderError` (a `ValueError`) naming the field. Any string role is accepted
  (vLLM takes custom roles, ``developer`` included). The body is never modified.
- Message content, as vLLM's parser gives it: ``null``/missing is no parts; a string is one text
  part; a list holds strings and parts of type ``text``/``input_text``/``output_text`` (``text``),
  ``refusal`` (``refusal``), ``thinking`` (``thinking``) and ``tool_reference`` (``name``); ``text``
  and ``refusal`` parts with no text are skipped. Media parts (images, audio, video, embeddings)
  raise `ChatRenderError`: a text-only render cannot know their placeholder tokens.
- `ChatPrompt.conversation(content_format, developer_role)` is the template's ``messages``. With
  content format ``"string"`` each content is its texts joined with ``"\\n"`` (no parts: ``""``;
  empty texts are left out first); with ``"openai"`` it is a list of ``{"type": "text", "text": ...}``
  parts. Tool messages with only
  text parts always get the joined string. Fields passed through: ``name`` and ``task`` (strings,
  any role), assistant ``tool_calls`` (arguments decoded from JSON into an object; not JSON or not an
  object gives ``{}``; an empty list is dropped) and ``reasoning`` (also as ``reasoning_content``;
  the request may name either), tool ``tool_call_id``, developer ``tools``. When the template does
  not name the developer role, developer messages become system messages and all system messages are
  merged (contents joined with a blank line) into one first message, as vLLM does. A system text
  starting with Claude Code's ``x-anthropic-billing-header`` line loses that line.
- `ChatPrompt.tools` are the request's tools as vLLM dumps them (``{"type": "function", "function":
  {"name", "description", "parameters"[, "strict"][, "defer_loading"]}[, "defer_loading"]}``).
- `ChatPrompt.template_kwargs` are the template variables besides ``messages`` and ``tools``:
  ``chat_template_kwargs`` overridden by the request's ``add_generation_prompt`` (default true),
  ``continue_final_message`` (default false), ``documents``, ``reasoning_effort`` (and
  ``enable_thinking = reasoning_effort != "none"`` unless given); ``None`` and ``"auto"`` values are
  dropped, as in vLLM's merge. A ``tools`` key there replaces the request's tools.
- `ChatPrompt.chat_template` is the request's own template (or None); `add_special_tokens`
  (default false for chat) says whether the tokenizer adds its special tokens (BOS) on top of the
  rendered text: the template usually emits BOS itself, so it appears exactly once.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

ContentFormat = Literal["string", "openai"]

# Part type -> the key holding its text.
_TEXT_KEYS = {
    "text": "text",
    "input_text": "text",
    "output_text": "text",
    "refusal": "refusal",
    "thinking": "thinking",
}
_SKIP_WHEN_EMPTY = ("text", "refusal")
_MEDIA_KEYS = (
    "image_url",
    "image_pil",
    "image_embeds",
    "audio_embeds",
    "video_embeds",
    "prompt_embeds",
    "audio_url",
    "input_audio",
    "video_url",
    "input_image",
)
_BILLING_HEADER = "x-anthropic-billing-header"
_REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")
# Keys a request's chat_template_kwargs may not set: they are the renderer's own arguments.
_RESERVED_KWARGS = ("chat_template", "tokenize", "conversation", "messages")
_UNSET = (None, "auto")


class ChatRenderError(ValueError):
    """A chat body vLLM would refuse; `param` names the offending field."""

    def __init__(self, message: str, param: str = "messages") -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class _Part:
    kind: Literal["text", "tool_reference"]
    text: str


@dataclass(frozen=True)
class _Message:
    role: str
    parts: tuple[_Part, ...]
    extra: tuple[tuple[str, Any], ...]  # passed-through fields, in vLLM's order


@dataclass(frozen=True)
class ChatPrompt:
    """What the chat template is rendered with (see the module docstring)."""

    messages: tuple[_Message, ...]
    tools: list[dict[str, Any]] | None
    template_kwargs: dict[str, Any]
    chat_template: str | None
    add_special_tokens: bool

    @property
    def add_generation_prompt(self) -> bool:
        return bool(self.template_kwargs.get("add_generation_prompt", False))

    @property
    def continue_final_message(self) -> bool:
        return bool(self.template_kwargs.get("continue_final_message", False))

    def conversation(
        self, content_format: ContentFormat = "string", developer_role: bool = True
    ) -> list[dict[str, Any]]:
        """The template's ``messages`` (fresh objects; callers may keep or change them)."""
        out = [_render_message(m, content_format) for m in self.messages]
        if not developer_role and any(m["role"] == "developer" for m in out):
            out = _merge_system_messages(_developer_to_system(out))
        return out


def parse_chat(body: Mapping[str, Any]) -> ChatPrompt:
    """Validate a chat completions body and collect the template inputs vLLM would use."""
    raw = body.get("messages")
    if not isinstance(raw, list) or not raw:
        raise ChatRenderError("'messages' must be a non-empty list")
    messages = tuple(_parse_message(m, i) for i, m in enumerate(raw))
    generation = _flag(body, "add_generation_prompt", True)
    continue_final = _flag(body, "continue_final_message", False)
    if generation and continue_final:
        raise ChatRenderError(
            "Cannot set both `continue_final_message` and `add_generation_prompt` to True.",
            param="continue_final_message",
        )
    user_kwargs = body.get("chat_template_kwargs")
    if user_kwargs is None:
        user_kwargs = {}
    if not isinstance(user_kwargs, Mapping):
        raise ChatRenderError("'chat_template_kwargs' must be an object", "chat_template_kwargs")
    for key in _RESERVED_KWARGS:
        if user_kwargs.get(key) is not None:
            raise ChatRenderError(
                f"chat_template_kwargs may not set {key!r}", param="chat_template_kwargs"
            )
    effort = body.get("reasoning_effort")
    if effort is not None and effort not in _REASONING_EFFORTS:
        raise ChatRenderError(
            f"reasoning_effort must be one of {', '.join(_REASONING_EFFORTS)}",
            param="reasoning_effort",
        )
    overrides: dict[str, Any] = {
        "add_generation_prompt": generation,
        "continue_final_message": continue_final,
        "documents": _documents(body.get("documents")),
        "reasoning_effort": effort,
    }
    if effort is not None and "enable_thinking" not in user_kwargs:
        overrides["enable_thinking"] = effort != "none"
    merged = {**copy.deepcopy(dict(user_kwargs)), **overrides}
    kwargs = {k: v for k, v in merged.items() if not _is_unset(v)}
    tools = _tools(body.get("tools"))
    if "tools" in kwargs:
        tools = kwargs.pop("tools")
    template = body.get("chat_template")
    if template is not None and not isinstance(template, str):
        raise ChatRenderError("'chat_template' must be a string", param="chat_template")
    return ChatPrompt(
        messages=messages,
        tools=tools,
        template_kwargs=kwargs,
        chat_template=template,
        add_special_tokens=_flag(body, "add_special_tokens", False),
    )


def _is_unset(value: Any) -> bool:
    return any(value is u or (isinstance(value, str) and value == u) for u in _UNSET)


def _flag(body: Mapping[str, Any], name: str, default: bool) -> bool:
    value = body.get(name, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ChatRenderError(f"{name!r} must be a boolean", param=name)
    return value


def _documents(value: Any) -> list[dict[str, Any]] | None:
    if value is None:
        return None
    if not isinstance(value, list) or not all(isinstance(d, Mapping) for d in value):
        raise ChatRenderError("'documents' must be a list of objects", param="documents")
    return [dict(d) for d in copy.deepcopy(value)]


def _tools(value: Any) -> list[dict[str, Any]] | None:
    if value is None:
        return None
    if not isinstance(value, list):
        raise ChatRenderError("'tools' must be a list", param="tools")
    return [_tool(t, i) for i, t in enumerate(value)]


def _tool(tool: Any, index: int) -> dict[str, Any]:
    where = f"tools.{index}"
    if not isinstance(tool, Mapping) or tool.get("type", "function") != "function":
        raise ChatRenderError(f"{where} must be a function tool", param=where)
    function = tool.get("function")
    if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
        raise ChatRenderError(f"{where}.function needs a string 'name'", param=where)
    description = function.get("description")
    parameters = function.get("parameters")
    if description is not None and not isinstance(description, str):
        raise ChatRenderError(f"{where}.function.description must be a string", param=where)
    if parameters is not None and not isinstance(parameters, Mapping):
        raise ChatRenderError(f"{where}.function.parameters must be an object", param=where)
    dumped: dict[str, Any] = {
        "name": function["name"],
        "description": description,
        "parameters": copy.deepcopy(dict(parameters)) if parameters is not None else None,
    }
    defer = tool.get("defer_loading")
    for key in ("strict", "defer_loading"):
        value = function.get(key)
        if key == "defer_loading" and value is None:
            value = defer
        if value is not None:
            if not isinstance(value, bool):
                raise ChatRenderError(f"{where}.function.{key} must be a boolean", param=where)
            dumped[key] = value
    out: dict[str, Any] = {"type": "function", "function": dumped}
    if defer is not None:
        out["defer_loading"] = defer
    return out


def _parse_message(message: Any, index: int) -> _Message:
    where = f"messages.{index}"
    if not isinstance(message, Mapping):
        raise ChatRenderError(f"{where} must be an object with a 'role'", param=where)
    role = message.get("role")
    if not isinstance(role, str):
        raise ChatRenderError(f"{where}.role must be a string", param=f"{where}.role")
    content = message.get("content")
    raw_parts: Sequence[Any]
    if content is None:
        raw_parts = []
    elif isinstance(content, str):
        raw_parts = [content]
    elif isinstance(content, list):
        raw_parts = content
    else:
        raise ChatRenderError(
            f"{where}.content must be a string, a list of parts or null", param=f"{where}.content"
        )
    parts = [p for p in (_parse_part(p, f"{where}.content") for p in raw_parts) if p is not None]
    if role == "system":
        parts = _strip_billing_header(parts)
    return _Message(role, tuple(parts), tuple(_extra_fields(message, role, where)))


def _parse_part(part: Any, where: str) -> _Part | None:
    if isinstance(part, str):
        return _Part("text", part)
    if not isinstance(part, Mapping):
        raise ChatRenderError(f"{where}: a content part must be a string or an object", where)
    kind = part.get("type")
    if kind is None:
        if "tool_reference" in part:
            kind = "tool_reference"
        elif any(key in part for key in _MEDIA_KEYS):
            kind = "image_url"
        else:
            raise ChatRenderError("Missing 'type' field in multimodal part.", param="type")
    if not isinstance(kind, str):
        raise ChatRenderError("Invalid 'type' field in multimodal part.", param="type")
    if kind in _TEXT_KEYS:
        text = part.get(_TEXT_KEYS[kind])
        if text is None and kind in _SKIP_WHEN_EMPTY:
            return None
        if not isinstance(text, str):
            raise ChatRenderError(f"{where}: a {kind!r} part needs a string", param=where)
        return _Part("text", text)
    if kind == "tool_reference":
        name = part.get("name")
        if not isinstance(name, str):
            raise ChatRenderError(f"{where}: a tool_reference part needs a 'name'", where)
        return _Part("tool_reference", name)
    if kind in _MEDIA_KEYS or kind in ("image", "audio", "video"):
        raise ChatRenderError(
            f"content parts of type {kind!r} are not supported (text-only rendering)", where
        )
    raise ChatRenderError(f"Unsupported chat content part type: {kind!r}", param="type")


def _strip_billing_header(parts: list[_Part]) -> list[_Part]:
    out = []
    for part in parts:
        if part.kind == "text" and part.text.startswith(_BILLING_HEADER):
            rest = part.text.partition("\n")[2]
            if rest:
                out.append(_Part("text", rest))
        else:
            out.append(part)
    return out


def _extra_fields(message: Mapping[str, Any], role: str, where: str) -> list[tuple[str, Any]]:
    extra: list[tuple[str, Any]] = []
    if role == "assistant":
        tool_calls = message.get("tool_calls")
        if tool_calls is not None:
            if not isinstance(tool_calls, list):
                raise ChatRenderError(f"{where}.tool_calls must be a list", f"{where}.tool_calls")
            if tool_calls:
                extra.append(("tool_calls", [_tool_call(c, where) for c in tool_calls]))
        reasoning = message.get("reasoning")
        if reasoning is None:
            reasoning = message.get("reasoning_content")
        if reasoning is not None:
            if not isinstance(reasoning, str):
                raise ChatRenderError(f"{where}.reasoning must be a string", f"{where}.reasoning")
            extra += [("reasoning", reasoning), ("reasoning_content", reasoning)]
    elif role == "tool" and "tool_call_id" in message:
        extra.append(("tool_call_id", message["tool_call_id"]))
    for key in ("name", "task"):
        if isinstance(message.get(key), str):
            extra.append((key, message[key]))
    if role == "developer":
        extra.append(("tools", copy.deepcopy(message.get("tools"))))
    return extra


def _tool_call(call: Any, where: str) -> dict[str, Any]:
    param = f"{where}.tool_calls"
    if not isinstance(call, Mapping):
        raise ChatRenderError("assistant tool_calls entries must be objects.", param)
    function = call.get("function")
    if call.get("type", "function") != "function" or not isinstance(function, Mapping):
        raise ChatRenderError(
            "chat completions only support assistant tool_calls of type 'function'.", param
        )
    out = copy.deepcopy(dict(call))
    out["function"] = {**out["function"], "arguments": _arguments(function.get("arguments"))}
    return out


def _arguments(value: Any) -> Any:
    """Tool-call arguments as templates expect them: an object (vLLM's coercions)."""
    if not value:
        return {}
    if isinstance(value, dict):
        return copy.deepcopy(value)
    parsed = value
    if isinstance(value, str):
        try:
            parsed = json.loads(value)
        except json.JSONDecodeError:
            return {}
    return parsed if isinstance(parsed, dict) else {}


def _render_message(message: _Message, content_format: ContentFormat) -> dict[str, Any]:
    content: Any
    only_text = all(p.kind == "text" for p in message.parts)
    if content_format == "openai" and message.role == "tool" and only_text:
        content = "\n".join(p.text for p in message.parts)  # templates expect a string here
    elif content_format == "openai":
        content = [
            {"type": "text", "text": p.text}
            if p.kind == "text"
            else {"type": "tool_reference", "name": p.text}
            for p in message.parts
        ]
    else:  # vLLM's string parser drops empty parts before joining
        content = "\n".join(p.text for p in message.parts if p.text)
    out: dict[str, Any] = {"role": message.role, "content": content}
    for key, value in message.extra:
        out[key] = copy.deepcopy(value)
    return out


def _developer_to_system(conversation: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for message in conversation:
        if message["role"] == "developer":
            message = {k: v for k, v in message.items() if k != "tools"}
            message["role"] = "system"
        out.append(message)
    return out


def _merge_system_messages(conversation: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """All system messages as one first message, when they are not already just that."""
    texts: list[str] = []
    others: list[dict[str, Any]] = []
    needed = False
    for i, message in enumerate(conversation):
        if message["role"] != "system":
            others.append(message)
            continue
        needed = needed or i > 0 or bool(texts)
        content = message.get("content", "")
        if isinstance(content, list):
            content = "\n".join(
                p["text"] if isinstance(p, dict) else p
                for p in content
                if isinstance(p, str) or (isinstance(p, dict) and "text" in p)
            )
        if content:
            texts.append(content)
    if not needed:
        return conversation
    return [{"role": "system", "content": "\n\n".join(texts)}, *others]
