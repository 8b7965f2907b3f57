"""A stream survives the loss of its vLLM instance: kvherd continues it on the other one, exactly.

The session's vLLM pair behind ``kvherd serve`` (a stopped server recovers: SIGCONT), and for
the kill one server of this module's own, ``c``, beside ``a``, the stream steered to ``c`` by the
prompt's blocks cached there. Each test runs one greedy streamed request three times: straight
to vLLM (the reference), through kvherd undisturbed, and through kvherd with the instance serving
it stopped (SIGSTOP: hung) or killed (SIGKILL: every process of the server) once its 2nd event
went through a `FaultRelay` in front of the server, which drops every later byte of the stream:
the cut lands at that event whether or not vLLM had already written the rest.
The client must get vLLM's own answer: the same text (and token ids, when it asks for them), no
token lost or repeated, the usage of the original prompt and every generated token, no error
frame, and the continuation counted. Undisturbed, what kvherd relays has vLLM's own layout: the
token ids kvherd asks for are relayed as vLLM's ``null`` unless the client asked for them.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import httpx
import pytest
from fault_relay import Fault, FaultRelay
from vllm_fleet import (
    SERVED_MODEL,
    KvherdServe,
    Prompts,
    VllmServer,
    VllmSpec,
    assert_index_matches,
    instance_arg,
    kvherd_serve,
    vllm_servers,
)

MAX_TOKENS = 600  # + a 600-token prompt < 4,096
CUT_AT = 2  # events relayed to kvherd before its instance is stopped or killed: the cut lands
# at a chosen event (a `FaultRelay` in front of the server drops every later byte of the
# stream), not at a time, so it lands even when vLLM decodes the whole answer first.


@pytest.fixture(scope="module")
def killable(
    vllm_python: str, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[VllmServer]:
    """A server the kill test may kill (the session's pair serves the other tests), configured
    like the session pair: its KV connector is part of the config that vLLM's
    system_fingerprint hashes, which a continued stream must keep."""
    log_dir = tmp_path_factory.mktemp("vllm_continuation_logs")
    spec = VllmSpec("c", connector=True)
    with vllm_servers(vllm_python, tiny_model, [spec], log_dir) as (server,):
        yield server


class Stream:
    """One streamed response as the client read it."""

    def __init__(self, instance: str | None, events: list[str]) -> None:
        self.instance = instance
        self.events = events
        self.chunks = [json.loads(e[6:]) for e in events if e != "data: [DONE]"]

    @property
    def text(self) -> str:
        return "".join(
            choice.get("text") or (choice.get("delta") or {}).get("content") or ""
            for chunk in self.chunks
            for choice in chunk.get("choices") or ()
        )

    @property
    def token_ids(self) -> list[int]:
        return [
            token
            for chunk in self.chunks
            for choice in chunk.get("choices") or ()
            for token in choice.get("token_ids") or ()
        ]

    @property
    def usage(self) -> tuple[int, int, int]:
        final = [c["usage"] for c in self.chunks if c.get("usage") and not c.get("choices")]
        assert len(final) == 1, self.events[-3:]
        usage = final[0]
        return usage["prompt_tokens"], usage["completion_tokens"], usage["total_tokens"]

    def errors(self) -> list[dict[str, Any]]:
        return [chunk for chunk in self.chunks if "error" in chunk]

    def shapes(self) -> set[str]:
        """Each event's layout, in vLLM's key order: its keys and values but the id, the time,
        the text and the usage counts."""
        out = set()
        for chunk in json.loads(json.dumps(self.chunks)):  # a copy
            shape = {k: v for k, v in chunk.items() if k not in ("id", "created", "usage")}
            shape["usage"] = "usage" in chunk
            for choice in shape.get("choices") or ():
                if "text" in choice:
                    choice["text"] = ""
                if "content" in (choice.get("delta") or {}):
                    choice["delta"]["content"] = ""
                if choice.get("token_ids") is not None:
                    choice["token_ids"] = []
            out.add(json.dumps(shape))
        return out


def read_stream(url: str, path: str, body: dict[str, Any]) -> Stream:
    events: list[str] = []
    with (
        httpx.Client(timeout=120.0, trust_env=False) as client,
        client.stream("POST", url + path, json=body) as response,
    ):
        assert response.status_code == 200, response.read()
        instance = response.headers.get("x-kvherd-instance")
        events += [line for line in response.iter_lines() if line]
    assert events[-1] == "data: [DONE]", events[-3:]
    return Stream(instance, events)


def the_request(body: dict[str, Any]) -> Callable[[Any], bool]:
    """Matches the client's own request, not kvherd's continuation of it (other tokens)."""
    keys = ("prompt", "messages", "max_tokens")
    return lambda sent: isinstance(sent, dict) and all(sent.get(k) == body.get(k) for k in keys)


@contextlib.contextmanager
def cut_at_event(
    relays: Sequence[tuple[FaultRelay, VllmServer]], body: dict[str, Any], sig: signal.Signals
) -> Iterator[list[VllmServer]]:
    """Arms each relay to send `sig` to its server's process group (the API server, its
    EngineCore and its worker) once `CUT_AT` events of `body`'s stream went through it; the first
    to fire disarms the others. Yields the servers signalled; a stopped one is let go on exit."""
    cut: list[VllmServer] = []

    def fault(server: VllmServer) -> Fault:
        def action() -> None:
            for relay, _ in relays:
                relay.disarm()
            os.killpg(server.process.pid, sig)
            cut.append(server)

        return Fault("", "event", action, the_request(body), events=CUT_AT)

    for relay, server in relays:
        relay.arm(fault(server))
    try:
        yield cut
    finally:
        for relay, _ in relays:
            relay.disarm()
        if sig == signal.SIGSTOP:
            for server in cut:
                os.killpg(server.process.pid, signal.SIGCONT)


@contextlib.contextmanager
def relayed_fleet(
    pair: tuple[VllmServer, VllmServer], tiny_model: Path
) -> Iterator[tuple[KvherdServe, list[tuple[FaultRelay, VllmServer]]]]:
    """``kvherd serve`` in front of the pair, each server reached through its own relay."""
    a, b = pair
    with FaultRelay(a.url) as relay_a, FaultRelay(b.url) as relay_b:
        args = ["--instance", instance_arg(a, url=relay_a.url)]
        args += ["--instance", instance_arg(b, url=relay_b.url), "--kv-events-bind", b.kv_endpoint]
        with kvherd_serve(*args, "--tokenizer", str(tiny_model), "--expose-instance") as proxy:
            assert_index_matches(proxy, a, b)
            yield proxy, [(relay_a, a), (relay_b, b)]


def continued(proxy: KvherdServe, outcome: str = "continued") -> float:
    return proxy.metric("kvherd_continuations_total", outcome=outcome)


def gave_up(proxy: KvherdServe) -> float:
    return continued(proxy, "gave_up") + continued(proxy, "unsupported")


def assert_like_vllm(relayed: Stream, direct: Stream) -> None:
    assert relayed.text == direct.text
    assert relayed.usage == direct.usage
    assert relayed.shapes() == direct.shapes()


def test_greedy_chat_stream_survives_a_hung_instance(
    vllm_pair: tuple[VllmServer, VllmServer], tiny_model: Path
) -> None:
    path = "/v1/chat/completions"
    body = {
        "model": SERVED_MODEL,
        "messages": [{"role": "user", "content": "the hung instance tells a long story"}],
        "max_tokens": MAX_TOKENS,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    direct = read_stream(vllm_pair[0].url, path, body)
    assert direct.usage[1] == MAX_TOKENS
    with relayed_fleet(vllm_pair, tiny_model) as (proxy, relays):
        plain = read_stream(proxy.url, path, body)
        assert_like_vllm(plain, direct)
        raw = "\n".join(plain.events)
        assert '"token_ids":[' not in raw and '"prompt_token_ids":[' not in raw
        assert continued(proxy) == 0
        with cut_at_event(relays, body, signal.SIGSTOP) as stopped:
            cut = read_stream(proxy.url, path, body)
        assert [s.spec.name for s in stopped] == [cut.instance], proxy.log()[-3000:]
        assert not cut.errors(), (cut.errors(), proxy.log()[-3000:])
        assert cut.text == direct.text, proxy.log()[-3000:]
        assert cut.usage[:2] == (direct.usage[0], MAX_TOKENS)
        assert all(chunk["id"] == cut.chunks[0]["id"] for chunk in cut.chunks)
        assert cut.shapes() <= direct.shapes()  # chat chunks as vLLM writes them
        assert '"token_ids":[' not in "\n".join(cut.events)
        assert continued(proxy) == 1


def test_seeded_sampling_is_not_continued(
    vllm_pair: tuple[VllmServer, VllmServer], tiny_model: Path
) -> None:
    """vLLM's seeded generator depends on the output position: a continuation would not be the
    answer the seed promises, so the client gets the error frame (and can retry for it)."""
    path = "/v1/completions"
    body = {
        "model": SERVED_MODEL,
        "prompt": "a seeded story that must not be stitched together",
        "max_tokens": MAX_TOKENS,
        "temperature": 0.8,
        "seed": 11,
        "ignore_eos": True,
        "stream": True,
    }
    with (
        relayed_fleet(vllm_pair, tiny_model) as (proxy, relays),
        cut_at_event(relays, body, signal.SIGSTOP) as stopped,
    ):
        cut = read_stream(proxy.url, path, body)
        assert len(stopped) == 1
        assert [e["error"]["type"] for e in cut.errors()] == ["server_error"]
        assert continued(proxy) == 0 and continued(proxy, "unsupported") == 1


def test_greedy_completion_stream_survives_a_killed_instance(
    vllm_pair: tuple[VllmServer, VllmServer],
    killable: VllmServer,
    tiny_model: Path,
    prompts: Prompts,
) -> None:
    """The client asks for the token ids here: they are relayed, and those of the stream
    continued elsewhere are vLLM's own, none lost or repeated."""
    a, c = vllm_pair[0], killable
    path = "/v1/completions"
    body = {
        "model": SERVED_MODEL,
        "prompt": prompts.make("continuation-killed"),  # cached on c by the direct run
        "max_tokens": MAX_TOKENS,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "return_token_ids": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    direct = read_stream(c.url, path, body)
    assert len(direct.token_ids) == MAX_TOKENS
    with FaultRelay(c.url) as relay:
        args = ["--instance", instance_arg(a), "--instance", instance_arg(c, url=relay.url)]
        with kvherd_serve(*args, "--tokenizer", str(tiny_model), "--expose-instance") as proxy:
            assert_index_matches(proxy, a, c)  # c's cached prompt steers the stream there
            plain = read_stream(proxy.url, path, body)
            assert plain.instance == c.spec.name
            assert_like_vllm(plain, direct)
            assert plain.token_ids == direct.token_ids
            with cut_at_event([(relay, c)], body, signal.SIGKILL) as killed:
                cut = read_stream(proxy.url, path, body)
            assert killed == [c] and cut.instance == c.spec.name
            assert not cut.errors(), (cut.errors(), proxy.log()[-3000:])
            assert cut.token_ids == direct.token_ids, proxy.log()[-3000:]
            assert cut.text == direct.text
            assert cut.usage == direct.usage
            # Continuous usage counts on: the original prompt, every token so far.
            running = [c["usage"]["completion_tokens"] for c in cut.chunks if c.get("choices")]
            assert running == sorted(running) and running[-1] == MAX_TOKENS
            assert {c["usage"]["prompt_tokens"] for c in cut.chunks} == {direct.usage[0]}
            assert all(chunk["id"] == cut.chunks[0]["id"] for chunk in cut.chunks)
            assert cut.shapes() <= direct.shapes()
            assert continued(proxy) == 1, (proxy.metrics(), proxy.log()[-3000:])
