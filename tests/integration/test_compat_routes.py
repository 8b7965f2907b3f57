"""The endpoints peer routers and vLLM clients probe, on a real agent serving a real HF tokenizer.

The checkpoint is `vllm_fleet.build_tiny_llama`'s: a byte-level BPE tokenizer with a BOS
post-processor and a chat template that emits BOS itself, so "BOS exactly once" can fail here.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from agent_process import AgentProcess, agent_process
from vllm_fleet import build_tiny_llama

SERVED = "tiny-hf"
PROMPT = "The quick brown fox jumps over the lazy dog, and then it rests."
MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Name three rivers."},
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_llama(tmp_path_factory.mktemp("compat") / "tiny")


@pytest.fixture(scope="module")
def agent(model_dir: Path) -> Iterator[AgentProcess]:
    with agent_process("--model", str(model_dir), "--served-model-name", SERVED) as proc:
        yield proc


@pytest.fixture(scope="module")
def hf_tokenizer(model_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)


def _get(agent: AgentProcess, path: str) -> Any:
    response = httpx.get(f"{agent.url}{path}", timeout=30)
    assert response.status_code == 200, response.text
    return response.json()


def _post(agent: AgentProcess, path: str, body: Any) -> Any:
    response = httpx.post(f"{agent.url}{path}", json=body, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


def _engine_prompt_ids(agent: AgentProcess, route: str, body: dict[str, Any]) -> list[int]:
    """The prompt ids the generation route submitted (vLLM's ``return_token_ids``)."""
    body = {"model": SERVED, "max_tokens": 1, "return_token_ids": True, **body}
    ids: list[int] = _post(agent, route, body)["choices"][0]["prompt_token_ids"]
    return ids


def test_server_info_names_the_served_model(agent: AgentProcess, model_dir: Path) -> None:
    info = _get(agent, "/server_info")
    assert _get(agent, "/get_server_info") == info
    state = _get(agent, "/kvherd/v1/state")
    assert info["served_model_name"] == SERVED
    assert info["model_path"] == info["tokenizer_path"] == str(model_dir)
    assert info["block_size"] == info["page_size"] == state["block_size"]
    assert info["max_total_num_tokens"] == state["total_blocks"] * state["block_size"]
    assert info["max_model_len"] == info["context_length"] == 4096


def test_model_info_is_sglangs_shape(agent: AgentProcess, model_dir: Path) -> None:
    info = _get(agent, "/model_info")
    assert _get(agent, "/get_model_info") == info
    assert info["model_path"] == str(model_dir)
    assert info["is_generation"] is True
    assert info["model_type"] == "llama"
    assert info["architectures"] == ["LlamaForCausalLM"]


def test_tokenize_completion_is_the_engines_prompt(agent: AgentProcess, hf_tokenizer: Any) -> None:
    answer = _post(agent, "/tokenize", {"model": SERVED, "prompt": PROMPT})
    tokens = answer["tokens"]
    assert answer == {"count": len(tokens), "max_model_len": 4096, "tokens": tokens,
                      "token_strs": None}  # fmt: skip
    assert tokens == _engine_prompt_ids(agent, "/v1/completions", {"prompt": PROMPT})
    assert tokens == hf_tokenizer(PROMPT)["input_ids"]
    assert tokens.count(hf_tokenizer.bos_token_id) == 1 and tokens[0] == hf_tokenizer.bos_token_id
    bare = _post(agent, "/tokenize", {"prompt": PROMPT, "add_special_tokens": False})["tokens"]
    assert bare == tokens[1:]
    assert _post(agent, "/detokenize", {"model": SERVED, "tokens": bare}) == {"prompt": PROMPT}


def test_tokenize_chat_is_the_engines_prompt(agent: AgentProcess, hf_tokenizer: Any) -> None:
    tokens = _post(agent, "/tokenize", {"model": SERVED, "messages": MESSAGES})["tokens"]
    assert tokens == _engine_prompt_ids(agent, "/v1/chat/completions", {"messages": MESSAGES})
    # transformers' own rendering: the template emits BOS, nothing adds a second one.
    text = hf_tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    assert tokens == hf_tokenizer(text, add_special_tokens=False)["input_ids"]
    assert tokens.count(hf_tokenizer.bos_token_id) == 1
    continued = [*MESSAGES, {"role": "assistant", "content": "The Nile,"}]
    open_ended = _post(
        agent,
        "/tokenize",
        {"messages": continued, "add_generation_prompt": False, "continue_final_message": True},
    )["tokens"]
    assert hf_tokenizer.decode(open_ended).endswith("The Nile,")


def test_render_answers_vllms_generate_requests(agent: AgentProcess) -> None:
    body = {"model": SERVED, "prompt": PROMPT, "max_tokens": 5, "temperature": 0.5, "seed": 3}
    rendered = _post(agent, "/v1/completions/render", body)
    assert isinstance(rendered, list) and len(rendered) == 1
    (request,) = rendered
    assert request["token_ids"] == _post(agent, "/tokenize", {"prompt": PROMPT})["tokens"]
    assert request["request_id"].startswith("cmpl-")
    assert request["model"] == SERVED and request["stream"] is False
    params = request["sampling_params"]
    assert (params["max_tokens"], params["temperature"], params["seed"]) == (5, 0.5, 3)

    chat = _post(agent, "/v1/chat/completions/render", {"model": SERVED, "messages": MESSAGES,
                                                        "stream": True})  # fmt: skip
    assert isinstance(chat, dict)
    assert chat["token_ids"] == _post(agent, "/tokenize", {"messages": MESSAGES})["tokens"]
    assert chat["request_id"].startswith("chatcmpl-") and chat["stream"] is True
    # A chat request without max_tokens may use the rest of the context, as generation does.
    assert chat["sampling_params"]["max_tokens"] == 4096 - len(chat["token_ids"])


@pytest.mark.parametrize(
    ("path", "body", "status", "param"),
    [
        ("/tokenize", {"prompt": 12}, 400, "prompt"),
        ("/tokenize", {"prompt": ""}, 400, "prompt"),
        ("/tokenize", {"prompt": "x", "model": "other"}, 404, "model"),
        ("/tokenize", {"prompt": "x", "return_token_strs": True}, 400, "return_token_strs"),
        ("/tokenize", {"messages": []}, 400, "messages"),
        ("/tokenize", {"messages": [{"content": "no role"}]}, 400, "messages.0.role"),
        ("/tokenize", ["prompt"], 400, None),
        ("/detokenize", {"tokens": [-1]}, 400, "tokens"),
        ("/detokenize", {"tokens": "abc"}, 400, "tokens"),
        ("/v1/completions/render", {"prompt": "x", "n": 2}, 400, "n"),
        ("/v1/completions/render", {"prompt": [10**9]}, 400, "prompt"),
        ("/v1/completions/render", {"prompt": "x", "model": "other"}, 404, "model"),
        ("/v1/chat/completions/render", {"messages": "hi"}, 400, "messages"),
        ("/v1/chat/completions/render", {"messages": MESSAGES, "max_tokens": 0}, 400, "max_tokens"),
    ],
)
def test_invalid_bodies_get_the_openai_error_object(
    agent: AgentProcess, path: str, body: Any, status: int, param: str | None
) -> None:
    response = httpx.post(f"{agent.url}{path}", json=body, timeout=30)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == param
    assert error["message"]


def test_malformed_json_is_a_400(agent: AgentProcess) -> None:
    for path in ("/tokenize", "/detokenize", "/v1/completions/render"):
        response = httpx.post(
            f"{agent.url}{path}", content=b"{not json", headers={"content-type": "application/json"}
        )
        assert response.status_code == 400, (path, response.text)
        assert "JSON" in response.json()["error"]["message"]
