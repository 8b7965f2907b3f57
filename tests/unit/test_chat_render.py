"""Routing tokens equal vLLM's own: chat rendering (`kvherd.chat_render`) and completions prompts.

The reference is transformers' ``apply_chat_template`` on a tokenizer trained offline here, given the
conversation vLLM 0.32 builds (written out by hand below, from vLLM's renderer); the same corpus is
checked against a live vLLM's ``/tokenize`` by the real-vLLM tests.
"""

from __future__ import annotations

import copy
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from chat_corpus import (
    CHATS,
    CHATS_RICH,
    COMPLETIONS,
    REFUSED,
    RICH_TEMPLATE,
    STRING_TEMPLATE,
    build_tokenizer,
)
from pydantic import ValidationError

from instance_agent import protocol
from kvherd.chat_render import ChatRenderError, parse_chat
from kvherd.tokenizer import (
    ByteTokenizer,
    HFTokenizer,
    TokenizerUnavailable,
    chat_token_ids,
    load_tokenizer,
    template_facts,
    tokenizer_spec_for_model,
)
from kvherd.wire import OpenAIError
from scheduler.fleet import InstanceSpec
from scheduler.proxy.routing_tokens import prompt_token_ids
from scheduler.serve_cli import foreign_without_tokenizer

BODIES = dict(CHATS + CHATS_RICH)


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tokenizer(tmp_path_factory.mktemp("corpus_tokenizer"))


@pytest.fixture(scope="module")
def tok(tokenizer_dir: Path) -> HFTokenizer:
    loaded = load_tokenizer(str(tokenizer_dir), strict=True)
    assert isinstance(loaded, HFTokenizer)
    return loaded


@pytest.fixture(scope="module")
def hf(tokenizer_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tokenizer_dir), local_files_only=True)


def reference(hf: Any, conversation: list[dict[str, Any]], **kwargs: Any) -> list[int]:
    """transformers' own render + tokenize (no special tokens added on top of the template)."""
    kwargs.setdefault("add_generation_prompt", True)
    return list(hf.apply_chat_template(conversation, tokenize=True, return_dict=False, **kwargs))


USER = {"role": "user", "content": "Hello world! How are you today?"}

# What vLLM hands the template for corpus conversations (string template unless noted).
EXPECTED: dict[str, tuple[list[dict[str, Any]], dict[str, Any]]] = {
    "one-user": ([USER], {}),
    "system-user": ([{"role": "system", "content": "be nice"}, USER], {}),
    "no-generation-prompt": ([USER], {"add_generation_prompt": False}),
    "continue-final": (
        [USER, {"role": "assistant", "content": "I am fine, th"}],
        {"add_generation_prompt": False, "continue_final_message": True},
    ),
    "parts-joined": (
        [{"role": "user", "content": "first part\na bare string part\nlast part"}],
        {},
    ),
    "content-null-missing": (
        [
            USER,
            {"role": "assistant", "content": ""},
            {"role": "user", "content": "again"},
            {"role": "assistant", "content": ""},
        ],
        {},
    ),
    "developer-merged": (
        [
            {"role": "system", "content": "rule one\n\nrule two"},
            {"role": "user", "content": "hi"},
            {"role": "user", "content": "bye"},
        ],
        {},
    ),
    "developer-only": ([{"role": "system", "content": "x"}, USER], {}),
    "custom-role": ([{"role": "banana", "content": "ripe"}, USER], {}),
    "billing-header": ([{"role": "system", "content": "Be brief."}, USER], {}),
    "rich-agent-turns": (
        [
            {
                "role": "system",
                "content": [{"type": "text", "text": "You are a helpful assistant."}],
            },
            {
                "role": "user",
                "content": [{"type": "text", "text": "What is the weather in Paris?"}],
                "name": "alice",
            },
            {
                "role": "assistant",
                "content": [],
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {
                            "name": "get_weather",
                            "arguments": {"city": "Paris", "unit": "c"},
                        },
                    },
                    {
                        "id": "call_2",
                        "type": "function",
                        "function": {"name": "noop", "arguments": {}},
                    },
                ],
            },
            {"role": "tool", "content": "sunny, 21 c", "tool_call_id": "call_1"},
            {"role": "tool", "content": "ok\ndone", "tool_call_id": "call_2"},
            {
                "role": "assistant",
                "content": [{"type": "text", "text": "It is sunny in Paris."}],
                "reasoning": "The tool said so.",
                "reasoning_content": "The tool said so.",
            },
            {"role": "user", "content": [{"type": "text", "text": "Thanks!"}]},
        ],
        {
            "chat_template": RICH_TEMPLATE,
            "tools": [
                {
                    "type": "function",
                    "function": {
                        "name": "get_weather",
                        "description": "The weather in a city",
                        "parameters": {
                            "type": "object",
                            "properties": {"city": {"type": "string"}},
                        },
                    },
                },
                {
                    "type": "function",
                    "function": {"name": "noop", "description": None, "parameters": None},
                },
            ],
        },
    ),
    "rich-parts": (
        [
            {
                "role": "user",
                "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
            },
            {
                "role": "developer",
                "content": [{"type": "text", "text": "dev rule"}],
                "name": "ops",
                "tools": None,
            },
        ],
        {"chat_template": RICH_TEMPLATE},
    ),
    "rich-kwargs": (
        [{"role": "user", "content": [{"type": "text", "text": USER["content"]}]}],
        {"chat_template": RICH_TEMPLATE, "greeting": "hey"},
    ),
}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_chat_tokens_equal_the_reference_render(name: str, tok: HFTokenizer, hf: Any) -> None:
    conversation, kwargs = EXPECTED[name]
    ids = prompt_token_ids(BODIES[name], True, tok)
    assert ids == reference(hf, conversation, **kwargs)
    assert ids.count(hf.bos_token_id) == 1 and ids[0] == hf.bos_token_id  # BOS exactly once


def test_add_special_tokens_adds_a_second_bos_as_vllm_does(tok: HFTokenizer, hf: Any) -> None:
    ids = prompt_token_ids(BODIES["add-special-tokens"], True, tok)
    assert ids == [hf.bos_token_id, *reference(hf, [USER])]


@pytest.mark.parametrize("name", [n for n, _ in CHATS + CHATS_RICH])
def test_agent_engine_tokens_equal_proxy_routing_tokens(name: str, tok: HFTokenizer) -> None:
    body = BODIES[name]
    untouched = copy.deepcopy(body)
    routed = prompt_token_ids(body, True, tok)
    request = protocol.ChatCompletionRequest.model_validate(body)
    assert chat_token_ids(tok, protocol.chat_prompt(request)) == routed
    assert body == untouched  # the proxy forwards the body: rendering never changes it


@pytest.mark.parametrize(("name", "body"), COMPLETIONS)
def test_completion_tokens(name: str, body: dict[str, Any], tok: HFTokenizer, hf: Any) -> None:
    prompt = body["prompt"]
    first = prompt if isinstance(prompt, str) else prompt[0]
    if isinstance(first, str):
        expected = hf(first, add_special_tokens=body.get("add_special_tokens", True))["input_ids"]
    else:
        expected = first if isinstance(first, list) else prompt
    assert prompt_token_ids(body, False, tok) == expected


@pytest.mark.parametrize(("name", "body"), REFUSED)
def test_bodies_vllm_refuses_are_400(name: str, body: dict[str, Any], tok: HFTokenizer) -> None:
    with pytest.raises(OpenAIError) as err:
        prompt_token_ids(body, True, tok)
    assert err.value.status == 400


@pytest.mark.parametrize(
    "body",
    [
        {"messages": []},
        {"messages": [{"content": "no role"}]},
        {"messages": [{"role": "user", "content": 3}]},
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}]},
        {"messages": ["not a message"]},
        {"messages": [USER], "add_generation_prompt": "yes"},
        {"messages": [USER], "chat_template_kwargs": {"tokenize": True}},
        {"messages": [USER], "tools": [{"type": "function", "function": {}}]},
        {"messages": [USER], "reasoning_effort": "extreme"},
    ],
)
def test_malformed_chat_bodies_raise(body: dict[str, Any]) -> None:
    with pytest.raises(ChatRenderError):
        parse_chat(body)


def test_template_kwargs_follow_vllms_merge() -> None:
    prompt = parse_chat(
        {
            "messages": [USER],
            "chat_template_kwargs": {
                "add_generation_prompt": False,
                "x": None,
                "y": "auto",
                "z": 1,
            },
            "documents": [{"title": "t", "text": "d"}],
            "reasoning_effort": "low",
        }
    )
    # The request's own fields win over chat_template_kwargs; None and "auto" are unset.
    assert prompt.template_kwargs == {
        "add_generation_prompt": True,
        "continue_final_message": False,
        "z": 1,
        "documents": [{"title": "t", "text": "d"}],
        "reasoning_effort": "low",
        "enable_thinking": True,
    }
    assert (
        parse_chat({"messages": [USER], "reasoning_effort": "none"}).template_kwargs[
            "enable_thinking"
        ]
        is False
    )


def test_documents_and_reasoning_content_reach_the_template(tok: HFTokenizer, hf: Any) -> None:
    body = {
        "messages": [USER, {"role": "assistant", "content": "ok", "reasoning_content": "hmm"}],
        "documents": [{"title": "Doc", "text": "body"}],
        "chat_template": RICH_TEMPLATE,
    }
    conversation = [
        {"role": "user", "content": [{"type": "text", "text": USER["content"]}]},
        {
            "role": "assistant",
            "content": [{"type": "text", "text": "ok"}],
            "reasoning": "hmm",
            "reasoning_content": "hmm",
        },
    ]
    assert prompt_token_ids(body, True, tok) == reference(
        hf, conversation, chat_template=RICH_TEMPLATE, documents=body["documents"]
    )


def test_template_facts() -> None:
    string = template_facts(STRING_TEMPLATE)
    assert (string.content_format, string.developer_role) == ("string", False)
    rich = template_facts(RICH_TEMPLATE)
    assert (rich.content_format, rich.developer_role) == ("openai", True)
    assert {"greeting", "documents", "tools", "messages"} <= rich.variables
    aliased = "{% set msgs = messages[1:] %}{% for m in msgs %}{% for c in m.content %}{% endfor %}"
    assert template_facts(aliased + "{% endfor %}").content_format == "openai"
    macro = (
        "{% macro show(parts) %}{% for p in parts %}{{ p.text }}{% endfor %}{% endmacro %}"
        "{% for m in messages %}{{ show(m['content']) }}{% endfor %}"
    )
    assert template_facts(macro).content_format == "openai"
    with pytest.raises(TokenizerUnavailable):
        template_facts("{% for m in messages %}")


def test_byte_tokenizer_renders_the_same_prompt_options() -> None:
    tok = ByteTokenizer()
    render = lambda body: tok.render_chat(parse_chat(body))  # noqa: E731
    parts = {"role": "user", "content": [{"type": "text", "text": "Hi"}, "there"]}
    assert render({"messages": [{"role": "developer", "content": "Be brief."}, parts]}) == (
        "<|system|>\nBe brief.<|end|>\n<|user|>\nHi\nthere<|end|>\n<|assistant|>\n"
    )
    assert render({"messages": [parts], "add_generation_prompt": False}) == (
        "<|user|>\nHi\nthere<|end|>\n"
    )
    continued = {"role": "assistant", "content": "Hel"}
    assert render(
        {
            "messages": [parts, continued],
            "add_generation_prompt": False,
            "continue_final_message": True,
        }
    ).endswith("<|assistant|>\nHel")


def test_strict_loading_fails_at_start_up(tmp_path: Path, tokenizer_dir: Path) -> None:
    assert isinstance(load_tokenizer("byte", strict=True), ByteTokenizer)
    for spec in (str(tmp_path), str(tmp_path / "missing")):
        with pytest.raises(TokenizerUnavailable, match="byte"):
            load_tokenizer(spec, strict=True)
        assert isinstance(load_tokenizer(spec), ByteTokenizer)  # an agent's random checkpoint
    assert tokenizer_spec_for_model("tiny") == "byte"
    assert tokenizer_spec_for_model(str(tokenizer_dir)) == str(tokenizer_dir)


@pytest.mark.parametrize("missing", ["transformers", "jinja2"])
def test_missing_packages_name_the_extra(missing: str, tokenizer_dir: Path) -> None:
    code = (
        f"import sys; sys.modules[{missing!r}] = None\n"
        "from kvherd.tokenizer import TokenizerUnavailable, load_tokenizer\n"
        "try:\n"
        f"    load_tokenizer({str(tokenizer_dir)!r}, strict=True)\n"
        "except TokenizerUnavailable as exc:\n"
        "    print(exc)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    ).stdout
    assert missing in out and "kvherd[tokenizer]" in out


def test_foreign_engines_need_a_tokenizer() -> None:
    vllm = InstanceSpec("a", "http://h:1", model="/models/llama", kvherd_agent=False)
    assert "--tokenizer" in (foreign_without_tokenizer(vllm) or "")
    agent = InstanceSpec("b", "http://h:2", model="tiny", kvherd_agent=True)
    assert foreign_without_tokenizer(agent) is None
    silent = InstanceSpec("c", "http://h:3", kvherd_agent=False)  # did not describe itself
    assert foreign_without_tokenizer(silent) is None


@pytest.mark.parametrize(
    "body",
    [
        {"messages": [{"role": "system", "content": [{"type": "text", "text": "\ud800"}]}]},
        {"messages": [{"role": "user", "content": ["a\udfffb"]}]},
    ],
)
def test_a_lone_surrogate_anywhere_in_the_render_is_a_400(
    body: dict[str, Any], tok: HFTokenizer
) -> None:
    """Request validation checks only the strings it types; the rendered text covers every field
    the template reads (the fuzzer found a content part giving 500)."""
    for tokenizer in (tok, ByteTokenizer()):
        with pytest.raises(OpenAIError) as err:  # the proxy's routing tokens
            prompt_token_ids(body, True, tokenizer)
        assert err.value.status == 400 and "lone surrogate" in str(err.value)
        try:  # the agent's engine tokens: its request model (a 400 too) or the render
            request = protocol.ChatCompletionRequest.model_validate(body)
        except ValidationError as exc:
            assert protocol.error_from_validation(exc.errors()).status == 400
            continue
        with pytest.raises(OpenAIError) as err:
            protocol.prompt_token_ids(request, tokenizer, tokenizer.vocab_size)
        assert err.value.status == 400
