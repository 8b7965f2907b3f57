"""OpenAI request validation and response shapes (no server)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from pydantic import ValidationError

from instance_agent import protocol
from instance_agent.engine.core.request import InvalidRequestError
from instance_agent.protocol import ChatCompletionRequest, CompletionRequest
from kvherd import wire
from kvherd.wire import OpenAIError


def _parse_error(model: type[CompletionRequest | ChatCompletionRequest], body: Any) -> OpenAIError:
    with pytest.raises(ValidationError) as info:
        model.model_validate(body)
    return protocol.error_from_validation(info.value.errors())


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": "x", "max_tokens": "5"}, "max_tokens"),
        ({"prompt": "x", "temperature": "hot"}, "temperature"),
        ({"prompt": "x", "stream": "yes"}, "stream"),
        ({"prompt": 5}, "prompt"),
        ({"prompt": [1, "a"]}, "prompt"),
        ({}, "prompt"),
        ({"prompt": "x", "stop": 3}, "stop"),
        ({"prompt": "x", "stream_options": {"include_usage": "y"}}, "stream_options.include_usage"),
    ],
)
def test_wrong_types_name_the_field(body: dict[str, Any], param: str) -> None:
    error = _parse_error(CompletionRequest, body)
    assert error.status == 400
    assert error.param is not None and error.param.startswith(param)
    assert error.body()["error"]["type"] == "invalid_request_error"


def test_chat_message_shape_is_checked() -> None:
    assert _parse_error(ChatCompletionRequest, {"messages": []}).param == "messages"
    # Any string role is accepted, as vLLM accepts it; a role must still be a string.
    ChatCompletionRequest.model_validate({"messages": [{"role": "wizard", "content": "x"}]})
    error = _parse_error(ChatCompletionRequest, {"messages": [{"role": 3, "content": "x"}]})
    assert error.param == "messages.0.role"
    assert _parse_error(ChatCompletionRequest, [1, 2]).message == (
        "request body must be a JSON object"
    )


def test_unknown_fields_are_kept_and_ignored() -> None:
    body = CompletionRequest.model_validate({"prompt": "x", "proxy_hint": {"a": 1}})
    assert body.model_extra == {"proxy_hint": {"a": 1}}


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": "x", "n": 2}, "n"),
        ({"prompt": "x", "n": 0}, "n"),
        ({"prompt": "x", "best_of": 3}, "best_of"),
        ({"prompt": "x", "logprobs": 1}, "logprobs"),
        ({"prompt": "x", "echo": True}, "echo"),
        ({"prompt": "x", "presence_penalty": 0.5}, "presence_penalty"),
        ({"prompt": "x", "logit_bias": {"5": 10}}, "logit_bias"),
    ],
)
def test_unsupported_features_are_refused(body: dict[str, Any], param: str) -> None:
    with pytest.raises(OpenAIError) as info:
        protocol.check_supported(CompletionRequest.model_validate(body))
    assert info.value.status == 400 and info.value.param == param


def test_supported_defaults_pass() -> None:
    protocol.check_supported(
        CompletionRequest.model_validate(
            {"prompt": "x", "n": 1, "best_of": 1, "presence_penalty": 0, "frequency_penalty": 0.0}
        )
    )
    chat = ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "x"}], "logprobs": True}
    )
    with pytest.raises(OpenAIError):
        protocol.check_supported(chat)


def test_sampling_params_mapping_and_validation() -> None:
    body = CompletionRequest.model_validate(
        {"prompt": "x", "max_tokens": 7, "temperature": 0, "top_k": 5, "seed": 3, "stop": "\n"}
    )
    params = protocol.to_sampling_params(body, default_max_tokens=16)
    assert (params.max_tokens, params.temperature, params.top_k, params.seed) == (7, 0, 5, 3)
    assert params.stop == ["\n"]
    chat = ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 9}
    )
    assert protocol.to_sampling_params(chat, default_max_tokens=100).max_tokens == 9
    with pytest.raises(InvalidRequestError) as info:
        protocol.to_sampling_params(
            CompletionRequest.model_validate({"prompt": "x", "max_tokens": -1}), 16
        )
    assert info.value.param == "max_tokens"


def test_resolve_prompt() -> None:
    assert protocol.resolve_prompt("hi", 300) == "hi"
    assert protocol.resolve_prompt([1, 2, 299], 300) == [1, 2, 299]
    assert protocol.resolve_prompt(["hi"], 300) == "hi"
    assert protocol.resolve_prompt([[4, 5]], 300) == [4, 5]
    for bad, code in (([300], "invalid_token_id"), ([-1], "invalid_token_id"), ("", None)):
        with pytest.raises(OpenAIError) as info:
            protocol.resolve_prompt(bad, 300)
        assert info.value.param == "prompt" and info.value.code == code
    with pytest.raises(OpenAIError, match="batched prompts"):
        protocol.resolve_prompt(["a", "b"], 300)


def test_sse_frames_and_chunk_shapes() -> None:
    chunk = protocol.completion_chunk("cmpl-1", 5, "tiny", "ab", None, [97, 98], 3)
    frame = wire.sse(chunk)
    assert frame.startswith(b"data: ") and frame.endswith(b"\n\n")
    decoded = json.loads(frame[len(b"data: ") :])
    assert decoded["object"] == "text_completion"
    assert decoded["choices"] == [
        {"index": 0, "text": "ab", "logprobs": None, "finish_reason": None, "token_ids": [97, 98]}
    ]
    assert decoded["kvherd"] == {"token_ids": [97, 98], "index": 3}
    plain = protocol.chat_chunk("c", 5, "tiny", {"content": "x"}, "stop")
    assert "kvherd" not in plain and "token_ids" not in plain["choices"][0]
    assert protocol.usage(10, 4, 8) == {
        "prompt_tokens": 10,
        "completion_tokens": 4,
        "total_tokens": 14,
        "prompt_tokens_details": {"cached_tokens": 8},
    }
    assert wire.SSE_DONE == b"data: [DONE]\n\n"
