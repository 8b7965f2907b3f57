"""The real peer routers in front of kvherd agents, routing them as they route vLLM.

- vllm-router 0.1.17 ``--policy kv_aware`` subscribes to each agent's KV events (static sources:
  the agents bind PUB and replay ROUTER, the router connects) and tokenizes every request through
  the agents' ``/v1/(chat/)completions/render``. A prompt warmed directly on one agent, which the
  router never saw, must be routed to that agent: only kvherd's events can have told it.
- sglang-router 0.3.2 ``cache_aware`` registers each agent under its served model name (from
  ``/server_info``) and serves completions and chat, streamed and not, through the ``openai`` client.

The routers live in their own virtual environments: ``$KVHERD_VLLM_ROUTER`` and
``$KVHERD_SGLANG_ROUTER`` are those environments' python. Without them the tests skip, unless
``KVHERD_REQUIRE_PEERS=1`` (CI), where they fail.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import openai
import pytest
from agent_process import AgentProcess, agent_process, free_port
from prometheus_client.parser import text_string_to_metric_families

VLLM_ROUTER_ENV = "KVHERD_VLLM_ROUTER"  # python of a venv with vllm-router==0.1.17
SGLANG_ROUTER_ENV = "KVHERD_SGLANG_ROUTER"  # python of a venv with sglang-router==0.3.2
REQUIRE_PEERS_ENV = "KVHERD_REQUIRE_PEERS"  # "1" in CI: a missing router fails instead of skipping
MODEL = "tiny-llama"
BLOCK_SIZE = 16
STARTUP_TIMEOUT_S = 120.0
# vllm-router's complaints about an event batch it could not use (all at WARNING or DEBUG).
EVENT_REJECTIONS = (
    "KV event must be a tagged map",
    "unsupported KV event",
    "missing KV event field",
    "kv_index decode batch",
    "KV wire hash must be",
)

# Long enough for many full blocks of the byte tokenizer (one token per character).
HISTORY = (
    "The history of the river kingdom is long: kings and queens, floods and famines, and the "
    "quiet work of the farmers who fed them all through many winters and many summers."
)
VOYAGE = (
    "A different story about sailing ships that crossed the ocean in search of spices, silk and "
    "new lands beyond the horizon of the world the old maps knew."
)
MOUNTAINS = (
    "Far to the north the mountain passes close with the first snow, and the shepherds bring "
    "their flocks down to the valleys before the wolves follow the deer."
)
CHAT = [
    {"role": "system", "content": "You are a patient historian who answers in full sentences."},
    {"role": "user", "content": "Why did the river kingdom build its capital on the delta?"},
]
# The sglang-router test's own prompts: nothing of theirs is cached by the other test.
SGLANG_PROMPT = "For sglang-router: " + HISTORY
SGLANG_CHAT = [{"role": "system", "content": "For sglang-router."}, *CHAT[1:]]


def _router_python(env: str) -> str:
    path = os.environ.get(env, "")
    if path and os.access(path, os.X_OK):
        return path
    reason = f"${env} is not the python of a venv with the router installed (got {path!r})"
    if os.environ.get(REQUIRE_PEERS_ENV) == "1":
        pytest.fail(f"{reason}, and ${REQUIRE_PEERS_ENV}=1")
    pytest.skip(reason)


@dataclass
class Router:
    url: str
    metrics_url: str
    process: subprocess.Popen[bytes]
    log_path: str

    def log(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def metric(self, name: str, **labels: str) -> float:
        text = httpx.get(self.metrics_url, timeout=10).text
        return sum(
            sample.value
            for family in text_string_to_metric_families(text)
            for sample in family.samples
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items())
        )


@contextlib.contextmanager
def _router(python: str, module: str, agents: list[AgentProcess], *args: str) -> Iterator[Router]:
    port, metrics_port = free_port(), free_port()
    cmd = [
        python, "-m", module, "--host", "127.0.0.1", "--port", str(port),
        "--worker-urls", *(a.url for a in agents),
        "--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics_port),
        "--log-level", "debug", *args,
    ]  # fmt: skip
    fd, log_path = tempfile.mkstemp(prefix=f"{module}-", suffix=".log")
    with os.fdopen(fd, "wb") as log_file:
        process = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT)
    router = Router(
        f"http://127.0.0.1:{port}", f"http://127.0.0.1:{metrics_port}/metrics", process, log_path
    )
    try:
        _wait_healthy(router)
        yield router
    finally:
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        os.unlink(log_path)


def _wait_healthy(router: Router) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if router.process.poll() is not None:
            raise RuntimeError(f"router exited with {router.process.returncode}:\n{router.log()}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{router.url}/health", timeout=2).status_code == 200:
                return
        time.sleep(0.1)  # polling interval while the router starts and probes its workers
    raise TimeoutError(f"router not healthy after {STARTUP_TIMEOUT_S}s:\n{router.log()}")


# Session-scoped, so that a missing router skips before the agents start.
@pytest.fixture(scope="session")
def vllm_router_python() -> str:
    return _router_python(VLLM_ROUTER_ENV)


@pytest.fixture(scope="session")
def sglang_router_python() -> str:
    return _router_python(SGLANG_ROUTER_ENV)


@pytest.fixture(scope="module")
def agents() -> Iterator[list[AgentProcess]]:
    args = ("--served-model-name", MODEL, "--block-size", str(BLOCK_SIZE), "--seed", "0")
    with (
        agent_process(*args, kv_events=True) as a,
        agent_process(*args, kv_events=True) as b,
    ):
        yield [a, b]


def _served(agents: list[AgentProcess]) -> list[float]:
    """Requests each agent has finished (``vllm:request_success_total``)."""
    counts = []
    for agent in agents:
        text = httpx.get(f"{agent.url}/metrics", timeout=10).text
        counts.append(
            sum(
                sample.value
                for family in text_string_to_metric_families(text)
                for sample in family.samples
                if sample.name == "vllm:request_success_total"
            )
        )
    return counts


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)


def _complete(url: str, prompt: str) -> int:
    """Send `prompt` to `url`; its cached prompt tokens."""
    response = _client(url).completions.create(model=MODEL, prompt=prompt, max_tokens=2)
    assert response.usage is not None and response.usage.prompt_tokens_details is not None
    return response.usage.prompt_tokens_details.cached_tokens or 0


def _chat_streamed(url: str) -> int:
    """Stream `CHAT` through `url`; its cached prompt tokens (from the usage chunk)."""
    stream = _client(url).chat.completions.create(
        model=MODEL,
        messages=CHAT,  # type: ignore[arg-type]
        max_tokens=2,
        stream=True,
        stream_options={"include_usage": True},
    )
    usage = [chunk.usage for chunk in stream if chunk.usage is not None]
    assert len(usage) == 1 and usage[0].prompt_tokens_details is not None
    return usage[0].prompt_tokens_details.cached_tokens or 0


def _send_and_locate(agents: list[AgentProcess], url: str, send: Any) -> tuple[int, int]:
    """Run `send(url)`; the index of the one agent that served it and its cached tokens."""
    before = _served(agents)
    cached = send(url)
    after = _served(agents)
    served = [i for i, (b, a) in enumerate(zip(before, after, strict=True)) if a > b]
    assert len(served) == 1, (before, after)
    return served[0], cached


def test_vllm_router_kv_aware_routes_by_kvherd_events(
    vllm_router_python: str, agents: list[AgentProcess]
) -> None:
    python = vllm_router_python
    kv_args: list[str] = ["--policy", "kv_aware"]
    for agent in agents:
        kv_args += ["--kv-event-source", f"{agent.url}={agent.kv_events_endpoint}"]
        kv_args += ["--kv-event-replay-source", f"{agent.url}={agent.replay_endpoint}"]
    kv_args += ["--kv-event-block-size", str(BLOCK_SIZE), "--kv-event-model", MODEL]
    full_blocks = (len(HISTORY) // BLOCK_SIZE - 1) * BLOCK_SIZE  # a repeat recomputes the last

    with _router(python, "vllm_router.launch_router", agents, *kv_args) as router:
        # A long prompt through the router, then again: the repeats go where it is cached.
        home, cached = _send_and_locate(agents, router.url, lambda u: _complete(u, HISTORY))
        assert cached == 0
        for _ in range(3):
            served, cached = _send_and_locate(agents, router.url, lambda u: _complete(u, HISTORY))
            assert (served, cached >= full_blocks) == (home, True), router.log()[-4000:]

        # A prompt the router never saw, cached directly on the other agent: only that agent's
        # KV events can send it there.
        other = 1 - home
        assert _complete(agents[other].url, VOYAGE) == 0
        served, cached = _send_and_locate(agents, router.url, lambda u: _complete(u, VOYAGE))
        assert (served, cached > 0) == (other, True), router.log()[-4000:]

        # The same for a chat conversation, streamed: render's ids are the events' ids.
        assert _chat_streamed(agents[other].url) == 0
        served, cached = _send_and_locate(agents, router.url, _chat_streamed)
        assert (served, cached > 0) == (other, True), router.log()[-4000:]

        # And a new prompt through the router: wherever it lands, its repeat follows it.
        first, cached = _send_and_locate(agents, router.url, lambda u: _complete(u, MOUNTAINS))
        assert cached == 0
        served, cached = _send_and_locate(agents, router.url, lambda u: _complete(u, MOUNTAINS))
        assert (served, cached > 0) == (first, True)

        log = router.log()
        assert router.metric("vllm_router_kv_placement_lookups_total", result="hit") >= 6, log
        assert router.metric("vllm_router_kv_routing_inputs_total", result="render") > 0, log
    for complaint in EVENT_REJECTIONS:
        assert complaint not in log, log
    assert "Prefix input preparation unavailable" not in log, log


def test_sglang_router_registers_and_serves_kvherd_agents(
    sglang_router_python: str, agents: list[AgentProcess]
) -> None:
    python = sglang_router_python
    with _router(
        python, "sglang_router.launch_router", agents, "--policy", "cache_aware"
    ) as router:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        workers: list[dict[str, Any]] = []
        while time.monotonic() < deadline:  # workers register in the background
            workers = httpx.get(f"{router.url}/workers", timeout=10).json()["workers"]
            if len(workers) == len(agents) and all(w["is_healthy"] for w in workers):
                break
            time.sleep(0.1)
        assert sorted(w["url"] for w in workers) == sorted(a.url for a in agents), router.log()
        for worker in workers:
            assert worker["model_id"] == MODEL, worker
            assert worker["metadata"]["model_type"] == "llama", worker
        models = httpx.get(f"{router.url}/v1/models", timeout=10).json()
        assert [m["id"] for m in models["data"]] == [MODEL]

        client = _client(router.url)
        extra = {"ignore_eos": True}
        completion = client.completions.create(
            model=MODEL, prompt=SGLANG_PROMPT, max_tokens=4, extra_body=extra
        )
        assert completion.usage is not None and completion.usage.completion_tokens == 4
        chunks = client.completions.create(
            model=MODEL, prompt=SGLANG_PROMPT, max_tokens=4, stream=True, extra_body=extra
        )
        assert sum(1 for chunk in chunks if chunk.choices) == 4
        chat = client.chat.completions.create(
            model=MODEL,
            messages=SGLANG_CHAT,  # type: ignore[arg-type]
            max_tokens=4,
            extra_body=extra,
        )
        assert chat.usage is not None and chat.usage.completion_tokens == 4
        assert chat.choices[0].message.role == "assistant"
        stream = client.chat.completions.create(
            model=MODEL,
            messages=SGLANG_CHAT,  # type: ignore[arg-type]
            max_tokens=4,
            stream=True,
            stream_options={"include_usage": True},
            extra_body=extra,
        )
        usage = [chunk.usage for chunk in stream if chunk.usage is not None]
        assert len(usage) == 1 and usage[0].completion_tokens == 4
        # cache_aware sends a repeated prompt back to the agent that cached it.
        full_blocks = (len(SGLANG_PROMPT) // BLOCK_SIZE - 1) * BLOCK_SIZE
        assert _complete(router.url, SGLANG_PROMPT) >= full_blocks
