"""The instance agent as a real process on loopback: OpenAI API, disconnects, metrics, errors."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import openai
import pytest
from agent_process import AgentProcess, agent_process
from openai.types.chat import ChatCompletionMessageParam
from prometheus_client.parser import text_string_to_metric_families

from instance_agent.engine.core.request import SamplingParams
from instance_agent.engine.llm_engine import EngineConfig, LLMEngine
from kvherd.chat_render import parse_chat
from kvherd.tokenizer import chat_token_ids

NUM_BLOCKS = 512


@pytest.fixture(scope="module")
def agent() -> Iterator[AgentProcess]:
    with agent_process("--num-gpu-blocks", str(NUM_BLOCKS), "--seed", "0") as proc:
        yield proc


@pytest.fixture(scope="module")
def engine() -> LLMEngine:
    """The same model in-process: what the agent must reproduce token for token."""
    return LLMEngine(EngineConfig(model="tiny", seed=0, num_gpu_blocks=NUM_BLOCKS, device="cpu"))


def _state(agent: AgentProcess) -> dict[str, Any]:
    response = httpx.get(f"{agent.url}/kvherd/v1/state", timeout=10)
    response.raise_for_status()
    state: dict[str, Any] = response.json()
    return state


def _poll(condition: Callable[[], bool], timeout: float = 30.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


def _idle_and_no_leak(agent: AgentProcess) -> bool:
    state = _state(agent)
    return (
        state["num_running"] == 0
        and state["num_waiting"] == 0
        and state["free_blocks"] == state["total_blocks"]
    )


def _sse_events(lines: Iterator[str]) -> Iterator[dict[str, Any] | str]:
    for line in lines:
        if not line:
            continue
        assert line.startswith("data: "), line
        data = line[len("data: ") :]
        yield "[DONE]" if data == "[DONE]" else json.loads(data)


def test_openai_client_matches_engine_in_process(agent: AgentProcess, engine: LLMEngine) -> None:
    client = openai.OpenAI(base_url=f"{agent.url}/v1", api_key="unused", max_retries=0)
    prompt = "Hello kvherd"
    params = SamplingParams(max_tokens=12, temperature=0.8, top_k=50, seed=7, ignore_eos=True)
    expected = engine.generate([prompt], params)[0]
    kwargs: dict[str, Any] = {
        "model": "tiny",
        "prompt": prompt,
        "max_tokens": 12,
        "temperature": 0.8,
        "seed": 7,
        "extra_body": {"top_k": 50, "ignore_eos": True, "return_token_ids": True},
    }
    completion = client.completions.create(**kwargs)
    choice = completion.choices[0].model_dump()
    assert choice["token_ids"] == expected.output_token_ids
    assert choice["text"] == expected.text
    assert choice["finish_reason"] == "length"
    assert completion.usage is not None and completion.usage.completion_tokens == 12

    text, ids, finish = "", [], None
    for chunk in client.completions.create(stream=True, **kwargs):
        data = chunk.model_dump()
        text += data["choices"][0]["text"]
        ids += data["choices"][0]["token_ids"]
        assert data["kvherd"]["index"] == len(ids) - len(data["choices"][0]["token_ids"])
        finish = data["choices"][0]["finish_reason"] or finish
    assert (ids, text, finish) == (expected.output_token_ids, expected.text, "length")

    messages: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Hi there"}]
    chat_expected = engine.generate(
        [chat_token_ids(engine.tokenizer, parse_chat({"messages": messages}))],
        SamplingParams(max_tokens=10, temperature=0.7, seed=11, ignore_eos=True),
    )[0]
    chat = client.chat.completions.create(
        model="tiny",
        messages=messages,
        max_tokens=10,
        temperature=0.7,
        seed=11,
        extra_body={"ignore_eos": True},
    )
    assert chat.choices[0].message.content == chat_expected.text
    stream = client.chat.completions.create(
        model="tiny",
        messages=messages,
        max_tokens=10,
        temperature=0.7,
        seed=11,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == chat_expected.text
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 10
    assert chunks[-1].choices == []


def test_stop_string_cuts_the_text(agent: AgentProcess, engine: LLMEngine) -> None:
    params = SamplingParams(max_tokens=40, temperature=0.8, seed=5, ignore_eos=True)
    full = engine.generate(["stop here"], params)[0].text
    # A stop string from the middle of what the model will write (first occurrence, clean chars).
    pos = next(
        i
        for i in range(3, len(full) - 2)
        if "\ufffd" not in full[i : i + 2] and full.find(full[i : i + 2]) == i
    )
    body = {
        "prompt": "stop here",
        "max_tokens": 40,
        "temperature": 0.8,
        "seed": 5,
        "ignore_eos": True,
        "stop": [full[pos : pos + 2]],
    }
    choice = httpx.post(f"{agent.url}/v1/completions", json=body, timeout=30).json()["choices"][0]
    assert choice["finish_reason"] == "stop"
    assert choice["text"] == full[:pos]
    streamed = ""
    with httpx.stream(
        "POST", f"{agent.url}/v1/completions", json={**body, "stream": True}, timeout=30
    ) as response:
        for event in _sse_events(response.iter_lines()):
            if isinstance(event, dict):
                streamed += event["choices"][0]["text"]
    assert streamed == full[:pos]


def test_stream_has_a_chunk_per_token_even_before_a_character_completes(
    agent: AgentProcess,
) -> None:
    """As vLLM: every sampled token reaches the client at once (its chunk's text may be empty),
    so a client times the first token, not the first whole character."""
    body = {
        "prompt": "abc",
        "max_tokens": 24,
        "temperature": 1.0,
        "seed": 3,
        "ignore_eos": True,
        "stream": True,
    }
    with httpx.stream("POST", f"{agent.url}/v1/completions", json=body, timeout=30) as response:
        events = [e for e in _sse_events(response.iter_lines()) if isinstance(e, dict)]
    texts = [e["choices"][0]["text"] for e in events]
    assert len(texts) == 24
    # The tiny model samples raw bytes: some complete no character yet (the case under test).
    assert "" in texts


def test_sse_wire_format_and_request_id(agent: AgentProcess) -> None:
    body = {
        "prompt": "abc",
        "max_tokens": 3,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with httpx.stream(
        "POST",
        f"{agent.url}/v1/completions",
        json=body,
        headers={"X-Request-Id": "req-wire-1"},
        timeout=30,
    ) as response:
        assert response.status_code == 200
        assert response.headers["x-request-id"] == "req-wire-1"
        assert response.headers["content-type"].startswith("text/event-stream")
        raw = response.read().decode()
    frames = raw.split("\n\n")
    assert frames[-1] == "" and frames[-2] == "data: [DONE]"
    events = [json.loads(f[len("data: ") :]) for f in frames[:-2]]
    assert all(e["id"] == "cmpl-req-wire-1" and e["object"] == "text_completion" for e in events)
    assert all({"id", "object", "created", "model", "choices"} <= e.keys() for e in events)
    assert [e["choices"][0]["finish_reason"] for e in events[:-1]][-1] == "length"
    assert "kvherd" not in events[0]  # only with return_token_ids
    usage = events[-1]["usage"]
    assert events[-1]["choices"] == []
    assert usage["prompt_tokens"] == 3 and usage["completion_tokens"] == 3
    assert usage["total_tokens"] == 6 and "cached_tokens" in usage["prompt_tokens_details"]


def test_continuous_usage_stats(agent: AgentProcess) -> None:
    body = {
        "prompt": "usage",
        "max_tokens": 4,
        "ignore_eos": True,
        "stream": True,
        "return_token_ids": True,
        "stream_options": {"continuous_usage_stats": True},
    }
    with httpx.stream("POST", f"{agent.url}/v1/completions", json=body, timeout=30) as response:
        events = [e for e in _sse_events(response.iter_lines()) if isinstance(e, dict)]
    assert [e["usage"]["completion_tokens"] for e in events] == [1, 2, 3, 4]
    assert all(e["usage"]["prompt_tokens"] == 5 for e in events)


def test_prefix_cache_hits_are_reported(agent: AgentProcess) -> None:
    prompt = list(range(40, 80))  # 40 tokens: two full blocks of 16 can be reused
    body = {"prompt": prompt, "max_tokens": 2, "ignore_eos": True}
    first = httpx.post(f"{agent.url}/v1/completions", json=body, timeout=30).json()
    second = httpx.post(f"{agent.url}/v1/completions", json=body, timeout=30).json()
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == 32

    def cached(salt: str) -> int:
        salted = {**body, "cache_salt": salt}
        response = httpx.post(f"{agent.url}/v1/completions", json=salted, timeout=30).json()
        return int(response["usage"]["prompt_tokens_details"]["cached_tokens"])

    # A tenant's salt keeps its blocks apart from everyone else's, and shares them within.
    assert cached("tenant-a") == 0
    assert cached("tenant-a") == 32
    assert cached("tenant-b") == 0


async def _one_stream(client: httpx.AsyncClient, url: str, i: int) -> tuple[int, list[int], str]:
    body = {
        "prompt": f"stream number {i}",
        "max_tokens": 20,
        "seed": i,
        "ignore_eos": True,
        "stream": True,
        "return_token_ids": True,
    }
    ids: list[int] = []
    finish = ""
    done = False
    async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if not line:
                continue
            data = line[len("data: ") :]
            if data == "[DONE]":
                done = True
                continue
            chunk = json.loads(data)
            assert chunk["kvherd"]["index"] == len(ids)  # no token lost or repeated
            ids += chunk["choices"][0]["token_ids"]
            finish = chunk["choices"][0]["finish_reason"] or finish
    assert done
    return i, ids, finish


def test_32_concurrent_streams(agent: AgentProcess) -> None:
    async def main() -> list[tuple[int, list[int], str]]:
        limits = httpx.Limits(max_connections=64)
        async with httpx.AsyncClient(timeout=120, limits=limits) as client:
            return await asyncio.gather(*(_one_stream(client, agent.url, i) for i in range(32)))

    results = asyncio.run(main())
    assert sorted(i for i, _, _ in results) == list(range(32))
    for _, ids, finish in results:
        assert len(ids) == 20 and finish == "length"
    _poll(lambda: _idle_and_no_leak(agent), what="all blocks free after the streams")


def _aborted(agent: AgentProcess) -> float:
    text = httpx.get(f"{agent.url}/metrics", timeout=10).text
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "vllm:request_success_total"
        and sample.labels.get("finished_reason") == "abort"
    )


def test_disconnected_stream_frees_its_blocks(agent: AgentProcess) -> None:
    _poll(lambda: _idle_and_no_leak(agent), what="idle agent")
    aborted = _aborted(agent)
    body = {"prompt": "x" * 100, "max_tokens": 1500, "ignore_eos": True, "stream": True}
    with (
        httpx.Client(timeout=30) as client,
        client.stream("POST", f"{agent.url}/v1/completions", json=body) as response,
    ):
        lines = response.iter_lines()
        next(line for line in lines if line.startswith("data: "))
        state = _state(agent)
        assert state["num_running"] == 1 and state["running"][0]["blocks"] >= 7
        assert state["free_blocks"] < state["total_blocks"]
        # Leaving the block closed the connection mid-stream.
    _poll(lambda: _idle_and_no_leak(agent), what="blocks of the disconnected stream freed")
    assert _aborted(agent) == aborted + 1  # freed by the abort, not by running to the end


def test_disconnected_non_streamed_request_frees_its_blocks(agent: AgentProcess) -> None:
    body = {"prompt": "y" * 100, "max_tokens": 1500, "ignore_eos": True}
    aborted = _aborted(agent)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{agent.url}/v1/completions", json=body, timeout=httpx.Timeout(30, read=0.5))
    _poll(lambda: _idle_and_no_leak(agent), what="blocks of the abandoned request freed")
    assert _aborted(agent) == aborted + 1


def _metrics(agent: AgentProcess) -> dict[str, float]:
    text = httpx.get(f"{agent.url}/metrics", timeout=10).text
    return {
        sample.name: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if not sample.name.endswith("_created")
    }


def test_metrics_parse_and_move(agent: AgentProcess) -> None:
    before = _metrics(agent)
    assert before["vllm:cache_config_info"] == 1
    body = {"prompt": "z" * 50, "max_tokens": 400, "ignore_eos": True, "stream": True}
    with (
        httpx.Client(timeout=60) as client,
        client.stream("POST", f"{agent.url}/v1/completions", json=body) as response,
    ):
        lines = response.iter_lines()
        next(line for line in lines if line.startswith("data: "))
        _poll(
            lambda: (
                _metrics(agent)["vllm:num_requests_running"] == 1
                and _metrics(agent)["vllm:kv_cache_usage_perc"] > 0
            ),
            what="running gauge",
        )
        for _ in lines:
            pass
    after = _metrics(agent)
    assert after["vllm:e2e_request_latency_seconds_count"] == (
        before["vllm:e2e_request_latency_seconds_count"] + 1
    )
    assert (
        after["vllm:time_to_first_token_seconds_count"]
        > (before["vllm:time_to_first_token_seconds_count"])
    )
    assert after["vllm:inter_token_latency_seconds_count"] >= (
        before["vllm:inter_token_latency_seconds_count"] + 399
    )
    assert (
        after["vllm:prefix_cache_queries_total"] >= before["vllm:prefix_cache_queries_total"] + 50
    )
    assert after["vllm:generation_tokens_total"] == before["vllm:generation_tokens_total"] + 400
    _poll(lambda: _metrics(agent)["vllm:num_requests_running"] == 0, what="running back to 0")


USER_MSG = {"role": "user", "content": "y"}
BAD_INPUTS: list[tuple[str, str, Any, int, str | None]] = [
    # (name, path, body (bytes are sent raw), status, param)
    ("malformed json", "/v1/completions", b'{"prompt": "x", ', 400, None),
    ("not an object", "/v1/completions", b"[1, 2]", 400, None),
    ("empty body", "/v1/completions", b"", 400, None),
    ("missing prompt", "/v1/completions", {"max_tokens": 3}, 400, "prompt"),
    ("missing messages", "/v1/chat/completions", {"model": "tiny"}, 400, "messages"),
    ("max_tokens string", "/v1/completions", {"prompt": "x", "max_tokens": "3"}, 400, "max_tokens"),
    (
        "negative max_tokens",
        "/v1/completions",
        {"prompt": "x", "max_tokens": -5},
        400,
        "max_tokens",
    ),
    ("zero max_tokens", "/v1/completions", {"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ("huge max_tokens", "/v1/completions", {"prompt": "x", "max_tokens": 10**12}, 400, None),
    ("too-long prompt", "/v1/completions", {"prompt": "a" * 3000}, 400, None),
    ("unknown model", "/v1/completions", {"prompt": "x", "model": "gpt-9"}, 404, "model"),
    ("token id too big", "/v1/completions", {"prompt": [1, 99999]}, 400, "prompt"),
    ("negative token id", "/v1/completions", {"prompt": [-1]}, 400, "prompt"),
    ("empty prompt", "/v1/completions", {"prompt": ""}, 400, "prompt"),
    ("empty token list", "/v1/completions", {"prompt": []}, 400, "prompt"),
    ("n > 1", "/v1/completions", {"prompt": "x", "n": 3}, 400, "n"),
    ("best_of", "/v1/completions", {"prompt": "x", "best_of": 2}, 400, "best_of"),
    ("logprobs", "/v1/completions", {"prompt": "x", "logprobs": 2}, 400, "logprobs"),
    ("temperature < 0", "/v1/completions", {"prompt": "x", "temperature": -1}, 400, "temperature"),
    ("top_p = 0", "/v1/completions", {"prompt": "x", "top_p": 0}, 400, "top_p"),
    ("bad role", "/v1/chat/completions", {"messages": [{"role": 3}]}, 400, "messages.0.role"),
    ("chat n > 1", "/v1/chat/completions", {"messages": [USER_MSG], "n": 2}, 400, "n"),
    (
        "stream_options without stream",
        "/v1/completions",
        {"prompt": "x", "stream_options": {"include_usage": True}},
        400,
        "stream_options",
    ),
    ("huge body", "/v1/completions", b'{"prompt": "' + b"a" * (5 << 20) + b'"}', 413, None),
]


@pytest.mark.parametrize(
    ("name", "path", "body", "status", "param"), BAD_INPUTS, ids=[b[0] for b in BAD_INPUTS]
)
def test_bad_inputs_get_openai_errors(
    agent: AgentProcess, name: str, path: str, body: Any, status: int, param: str | None
) -> None:
    if isinstance(body, bytes):
        response = httpx.post(
            f"{agent.url}{path}",
            content=body,
            headers={"content-type": "application/json"},
            timeout=30,
        )
    else:
        response = httpx.post(f"{agent.url}{path}", json=body, timeout=30)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"]
    if param is not None:
        assert error["param"] == param
    if name in ("huge max_tokens", "too-long prompt"):
        assert "maximum context length is 2048 tokens" in error["message"]
        assert error["code"] == "context_length_exceeded"
    if name == "unknown model":  # vLLM's own answer
        assert error["code"] == 404 and error["type"] == "NotFoundError"
        assert error["message"].endswith("does not exist. Valid aliases: tiny.")
    assert httpx.get(f"{agent.url}/health", timeout=10).status_code == 200
    assert _idle_and_no_leak(agent)


def test_agent_still_serves_after_bad_inputs(agent: AgentProcess) -> None:
    response = httpx.post(f"{agent.url}/v1/completions", json={"prompt": "ok", "max_tokens": 2})
    assert response.status_code == 200 and response.json()["choices"][0]["finish_reason"]


def test_bad_request_id_and_unknown_route(agent: AgentProcess) -> None:
    response = httpx.post(
        f"{agent.url}/v1/completions",
        json={"prompt": "x", "max_tokens": 1},
        headers={"X-Request-Id": "has space"},
    )
    assert response.status_code == 400 and response.json()["error"]["param"] == "X-Request-Id"
    missing = httpx.get(f"{agent.url}/v1/nothing-here")
    assert missing.status_code == 404 and "error" in missing.json()


def test_openapi_lists_400_not_422(agent: AgentProcess) -> None:
    schema = httpx.get(f"{agent.url}/openapi.json").json()
    for path in ("/v1/completions", "/v1/chat/completions"):
        responses = schema["paths"][path]["post"]["responses"]
        assert "400" in responses and "422" not in responses


def test_models_endpoint(agent: AgentProcess) -> None:
    models = openai.OpenAI(base_url=f"{agent.url}/v1", api_key="unused").models.list()
    assert [m.id for m in models.data] == ["tiny"]


def test_request_id_in_use_is_refused_without_touching_the_first(agent: AgentProcess) -> None:
    body = {"prompt": "dup", "max_tokens": 1500, "ignore_eos": True, "stream": True}
    headers = {"X-Request-Id": "dup-1"}
    with (
        httpx.Client(timeout=30) as client,
        client.stream("POST", f"{agent.url}/v1/completions", json=body, headers=headers) as first,
    ):
        lines = first.iter_lines()
        next(line for line in lines if line.startswith("data: "))
        second = client.post(
            f"{agent.url}/v1/completions", json={"prompt": "x", "max_tokens": 1}, headers=headers
        )
        assert second.status_code == 400 and "already in use" in second.json()["error"]["message"]
        assert second.headers["x-request-id"] == "dup-1"
        running = _state(agent)["running"]
        assert [r["request_id"] for r in running] == ["dup-1"]  # the first one still runs
        assert next(line for line in lines if line.startswith("data: {"))
    _poll(lambda: _idle_and_no_leak(agent), what="first request aborted on disconnect")
