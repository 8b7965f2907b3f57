"""kvherd's vLLM KV connector between two real vLLM servers: prefix pulls, and every way one fails.

The session pair runs the connector (`VllmSpec.connector`), each serving its blocks on a port of
its own. A prompt computed on ``a`` and then sent to ``b`` with ``kvherd_pull`` from ``a`` is
loaded, not recomputed: ``b``'s ``cached_tokens`` count the pulled blocks and the greedy output is
the one ``a`` gave and the one ``b`` gives when it computes the prompt itself (a ``cache_salt`` of
its own defeats its cache). A pull that cannot be served (nobody listening, a source that dies or
stalls mid-block, a source without the blocks) ends in a recompute: status 200, no cached tokens,
the same output, and afterwards ``b`` holds no block for a request (KV usage back to 0) and has
nothing waiting. The dying and stalling sources are fake servers on loopback, so that the session's
servers survive them; at the socket ``b`` sees what a killed or frozen ``a`` would show it.
Host tier: a prompt's blocks, once computed, are announced on ``b``'s own KV event stream as
``medium`` "CPU" too; after ``POST /reset_prefix_cache`` empties ``b``'s pool, the prompt loads
from the host tier (``cached_tokens``) with the same output.
Stop-and-copy migration, orchestrated here as the proxy would: a greedy stream on ``a`` is cut
(the client closes it: vLLM aborts the request, the connector's store keeps its full blocks, the
decoded ones included) and resumed on ``b`` from the prompt plus the tokens streamed, pulling
them: ``b`` prefills only the last partial block and continues with the unmigrated run's tokens.
"""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from agent_process import free_port
from vllm_fleet import SERVED_MODEL, Prompts, VllmServer, poll_until

MAX_TOKENS = 8


def _complete(server: VllmServer, prompt: str, **extra: Any) -> dict[str, Any]:
    body = {
        "model": SERVED_MODEL,
        "prompt": prompt,
        "max_tokens": MAX_TOKENS,
        "temperature": 0.0,
        **extra,
    }
    response = httpx.post(server.url + "/v1/completions", json=body, timeout=120.0, trust_env=False)
    assert response.status_code == 200, response.text
    answer: dict[str, Any] = response.json()
    return answer


def _cached(answer: dict[str, Any]) -> int:
    return int(answer["usage"]["prompt_tokens_details"]["cached_tokens"] or 0)


def _text(answer: dict[str, Any]) -> str:
    return str(answer["choices"][0]["text"])


def _pull(source: str, **options: Any) -> dict[str, Any]:
    return {"kv_transfer_params": {"kvherd_pull": {"from": source, **options}}}


def _gauge(server: VllmServer, name: str) -> float:
    text = httpx.get(server.url + "/metrics", timeout=10.0, trust_env=False).text
    values = [
        float(line.rpartition(" ")[2])
        for line in text.splitlines()
        if line.startswith(name + "{") or line.startswith(name + " ")
    ]
    assert values, f"no {name} on {server.url}/metrics"
    return sum(values)


def _assert_nothing_pinned(server: VllmServer) -> None:
    """No request holds a block (cached blocks are free in vLLM's pool) and none waits."""

    def idle() -> bool:
        return (
            _gauge(server, "vllm:kv_cache_usage_perc") == 0.0
            and _gauge(server, "vllm:num_requests_waiting") == 0.0
            and _gauge(server, "vllm:num_requests_running") == 0.0
        )

    assert poll_until(idle, timeout_s=20.0), server.log()


def test_prefix_computed_on_a_is_pulled_by_b(
    vllm_pair: tuple[VllmServer, VllmServer], prompts: Prompts
) -> None:
    a, b = vllm_pair
    prompt = prompts.make("connector-pull", blocks=4)
    full_blocks = prompts.full_blocks(prompt)
    computed_on_a = _complete(a, prompt)
    recomputed_on_b = _complete(b, prompt, cache_salt="connector-pull-recompute")
    assert _cached(computed_on_a) == 0 and _cached(recomputed_on_b) == 0

    pulled = _complete(b, prompt, **_pull(a.block_address))

    assert _cached(pulled) == full_blocks * 128, pulled["usage"]
    assert pulled["kv_transfer_params"] == {
        "kvherd_pull": {"outcome": "loaded", "tokens": full_blocks * 128}
    }
    assert _text(pulled) == _text(computed_on_a) == _text(recomputed_on_b)
    # b keeps what it loaded: the same prompt again is a local hit, with no pull asked.
    assert _cached(_complete(b, prompt)) == full_blocks * 128
    _assert_nothing_pinned(b)


def test_pull_takes_only_the_tokens_asked_for(
    vllm_pair: tuple[VllmServer, VllmServer], prompts: Prompts
) -> None:
    a, b = vllm_pair
    prompt = prompts.make("connector-partial", blocks=3)
    expected = _text(_complete(a, prompt))
    pulled = _complete(b, prompt, **_pull(a.block_address, tokens=2 * 128 + 5))
    assert _cached(pulled) == 2 * 128
    assert _text(pulled) == expected


class _FakeSource:
    """A block server that says it holds the blocks, then dies or stalls inside the first one."""

    def __init__(self, behaviour: str) -> None:
        self.behaviour = behaviour
        self.release = threading.Event()
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"tcp://127.0.0.1:{self.listener.getsockname()[1]}"
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        with self.listener:
            conn, _ = self.listener.accept()
            with conn:
                conn.recv(1 << 20)
                header = json.dumps({"count": 1}).encode()
                conn.sendall(len(header).to_bytes(4, "big") + header + b"\0" * 1000)
                if self.behaviour == "stall":
                    self.release.wait(30.0)


@pytest.fixture(params=["unreachable", "source_dies", "source_stalls", "source_lacks_blocks"])
def failing_source(
    request: pytest.FixtureRequest, vllm_pair: tuple[VllmServer, VllmServer]
) -> Iterator[str]:
    kind = request.param
    if kind == "unreachable":
        yield f"tcp://127.0.0.1:{free_port()}"  # nobody listens there
    elif kind == "source_lacks_blocks":
        yield vllm_pair[0].block_address  # a never saw the prompt
    else:
        fake = _FakeSource("stall" if kind == "source_stalls" else "die")
        yield fake.address
        fake.release.set()


def test_a_failed_pull_recomputes_and_pins_nothing(
    vllm_pair: tuple[VllmServer, VllmServer],
    prompts: Prompts,
    failing_source: str,
    request: pytest.FixtureRequest,
) -> None:
    _a, b = vllm_pair
    prompt = prompts.make(f"connector-fault-{request.node.callspec.id}", blocks=2)
    answer = _complete(b, prompt, **_pull(failing_source))
    assert _cached(answer) == 0, answer["usage"]
    assert answer["kv_transfer_params"] == {"kvherd_pull": {"outcome": "failed", "tokens": 0}}
    reference = _complete(b, prompt, cache_salt=f"ref-{request.node.callspec.id}")
    assert _text(answer) == _text(reference)
    _assert_nothing_pinned(b)


MIGRATED_MAX_TOKENS = 320  # decoding outlasts the cut, and crosses a block boundary before it
CUT_AFTER_TOKENS = 200


def _generate_ids(server: VllmServer, prompt_ids: list[int], max_tokens: int, **extra: Any) -> Any:
    body = {
        "model": SERVED_MODEL,
        "prompt": prompt_ids,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "return_token_ids": True,
        **extra,
    }
    response = httpx.post(server.url + "/v1/completions", json=body, timeout=120.0, trust_env=False)
    assert response.status_code == 200, response.text
    return response.json()


def _stream_until(server: VllmServer, prompt_ids: list[int], tokens: int) -> list[int]:
    """Stream a greedy completion and close it once `tokens` token ids have arrived."""
    body = {
        "model": SERVED_MODEL,
        "prompt": prompt_ids,
        "max_tokens": MIGRATED_MAX_TOKENS,
        "temperature": 0.0,
        "ignore_eos": True,
        "return_token_ids": True,
        "stream": True,
    }
    got: list[int] = []
    with httpx.stream(
        "POST", server.url + "/v1/completions", json=body, timeout=120.0, trust_env=False
    ) as response:
        for line in response.iter_lines():
            if not line.startswith("data: {"):
                continue
            got += json.loads(line[len("data: ") :])["choices"][0]["token_ids"] or []
            if len(got) >= tokens:
                break  # closing the connection aborts the request at the source
    return got


def test_a_running_request_migrates_by_stop_and_copy(
    vllm_pair: tuple[VllmServer, VllmServer], prompts: Prompts
) -> None:
    a, b = vllm_pair
    status, tokenized = a.tokenize({"model": SERVED_MODEL, "prompt": prompts.make("migrate")})
    assert status == 200
    prompt_ids: list[int] = tokenized["tokens"]
    unmigrated = _generate_ids(b, prompt_ids, MIGRATED_MAX_TOKENS, cache_salt="unmigrated")
    expected: list[int] = unmigrated["choices"][0]["token_ids"]

    streamed = _stream_until(a, prompt_ids, CUT_AFTER_TOKENS)
    context = prompt_ids + streamed
    resumed = _generate_ids(
        b,
        context,
        MIGRATED_MAX_TOKENS - len(streamed),
        **_pull(a.block_address),
    )

    full_blocks = (len(context) - 1) // 128
    assert full_blocks > len(prompt_ids) // 128  # decoded blocks moved, not only the prompt's
    assert _cached(resumed) == full_blocks * 128, resumed["usage"]
    assert resumed["kv_transfer_params"]["kvherd_pull"]["outcome"] == "loaded"
    assert streamed + resumed["choices"][0]["token_ids"] == expected
    _assert_nothing_pinned(a)
    _assert_nothing_pinned(b)


def _stored_hashes(server: VllmServer, start: int, medium: str) -> set[int]:
    return {
        block_hash
        for _seq, (_ts, events, *_rank) in server.replay_batches(start)
        for event in events
        if event["type"] == "BlockStored" and event.get("medium") == medium
        for block_hash in event["block_hashes"]
    }


def test_blocks_the_pool_lost_load_from_the_host_tier(
    vllm_pair: tuple[VllmServer, VllmServer], prompts: Prompts
) -> None:
    _a, b = vllm_pair
    prompt = prompts.make("connector-host-tier", blocks=3)
    full_blocks = prompts.full_blocks(prompt)
    batches = b.replay_batches()
    start = batches[-1][0] + 1 if batches else 0
    computed = _complete(b, prompt)

    def announced() -> tuple[set[int], set[int]] | None:
        gpu, cpu = _stored_hashes(b, start, "GPU"), _stored_hashes(b, start, "CPU")
        return (gpu, cpu) if len(cpu) == full_blocks else None

    tiers = poll_until(announced, timeout_s=10.0)
    assert tiers, _stored_hashes(b, start, "CPU")
    gpu, cpu = tiers
    assert cpu <= gpu  # the prompt's full blocks, under vLLM's own hashes

    reset = httpx.post(b.url + "/reset_prefix_cache", timeout=30.0, trust_env=False)
    assert reset.status_code == 200, reset.text
    reloaded = _complete(b, prompt)
    assert _cached(reloaded) == full_blocks * 128, reloaded["usage"]
    assert reloaded["kv_transfer_params"] == {
        "kvherd_host": {"outcome": "loaded", "tokens": full_blocks * 128}
    }
    assert _text(reloaded) == _text(computed)
    _assert_nothing_pinned(b)
