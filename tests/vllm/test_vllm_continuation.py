"""A stream survives the loss of its vLLM instance: kvherd continues it on the other one, exactly.

The session's vLLM pair behind ``kvherd serve`` (a stopped server recovers: SIGCONT), and for
the kill one server of this module's own, ``c``, beside ``a``, the stream steered to ``c`` by the
prompt's blocks cached there. Each test runs one greedy streamed request three times: straight
to vLLM (the reference), through kvherd undisturbed, and through kvherd with the instance serving
it stopped (SIGSTOP: hung) or killed (SIGKILL: every process of the server) after its 2nd event,
while vLLM still decodes it.
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
from vllm_fleet import (
    SERVED_MODEL,
    KvherdFactory,
    KvherdServe,
    Prompts,
    VllmServer,
    VllmSpec,
    assert_index_matches,
    instance_arg,
    kvherd_serve,
    poll_until,
    vllm_servers,
)

# Decoding must outlast the client's wait for its first events: vLLM's CPU workers can take the
# machine's cores while they decode, and with 800 tokens a clean CI run saw both the stop and the
# kill land after vLLM had written the whole stream (held in socket buffers, relayed complete);
# with 2400 twice too. So the fault is only applied while vLLM still reports the request running
# (`fault_while_running`), and the cut run is repeated (up to `CUT_ATTEMPTS`) until it was.
MAX_TOKENS = 3400  # several seconds of decoding on the tiny model; + a 600-token prompt < 4,096
CUT_AT = 2  # events the client has read when its instance is stopped or killed (early: a
# client that lags its stream must not find it complete by then)
# 3 attempts missed in 2 of 3 clean CI runs on 2026-12-01 (fourth session): vLLM's /metrics can
# answer late while its workers decode, so a running request goes unseen; 6 leaves room.
CUT_ATTEMPTS = 6


@pytest.fixture(scope="module")
def killable(
    vllm_python: str, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Callable[[], VllmServer]]:
    """Starts a server the kill test may kill (the session's pair serves the other tests): one
    per attempt, since a kill that came after vLLM's last token leaves nothing to retry on."""
    log_dir = tmp_path_factory.mktemp("vllm_continuation_logs")
    with contextlib.ExitStack() as stack:

        def start() -> VllmServer:
            # Configured like the session pair: its KV connector is part of the config that
            # vLLM's system_fingerprint hashes, which a continued stream must keep.
            spec = VllmSpec("c", connector=True)
            (server,) = stack.enter_context(vllm_servers(vllm_python, tiny_model, [spec], log_dir))
            return server

        yield start


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


def read_stream(
    url: str, path: str, body: dict[str, Any], at_cut: Callable[[str], None] | None = None
) -> Stream:
    events: list[str] = []
    with (
        httpx.Client(timeout=120.0, trust_env=False) as client,
        client.stream("POST", url + path, json=body) as response,
    ):
        assert response.status_code == 200, response.read()
        instance = response.headers.get("x-kvherd-instance")
        for line in response.iter_lines():
            if not line:
                continue
            events.append(line)
            if at_cut is not None and len(events) == CUT_AT:
                assert instance is not None
                at_cut(instance)
    assert events[-1] == "data: [DONE]", events[-3:]
    return Stream(instance, events)


def signal_group(pair: Sequence[VllmServer], name: str, sig: signal.Signals) -> VllmServer:
    server = next(s for s in pair if s.spec.name == name)
    os.killpg(server.process.pid, sig)  # the API server, its EngineCore and its worker
    return server


def running_requests(server: VllmServer) -> float:
    """What the server itself reports decoding now (``vllm:num_requests_running``)."""
    text = httpx.get(server.url + "/metrics", timeout=10.0, trust_env=False).text
    return sum(
        float(line.rpartition(" ")[2])
        for line in text.splitlines()
        if line.startswith("vllm:num_requests_running")
    )


def read_stream_cut(
    url: str,
    path: str,
    body: dict[str, Any],
    servers: Sequence[VllmServer],
    sig: signal.Signals,
    cut: list[VllmServer],
) -> Stream:
    """`read_stream` until the stream's server got `sig` at the cut while it was still decoding
    (appended to `cut`): a run in which vLLM had already finished is read to its end and repeated,
    at most `CUT_ATTEMPTS` times in all."""

    def fault_while_running(name: str) -> None:
        server = next((s for s in servers if s.spec.name == name), None)
        assert server is not None, f"the stream is on {name}, not on a server this test may cut"
        # vLLM's gauge trails its engine (more so on a loaded machine): give it a moment.
        if poll_until(lambda: running_requests(server) >= 1, timeout_s=2.0, interval_s=0.05):
            cut.append(signal_group(servers, name, sig))

    for _ in range(CUT_ATTEMPTS):
        stream = read_stream(url, path, body, fault_while_running)
        if cut:
            return stream
    # The tiny model decodes even 3,400 tokens in about a second, and vLLM's running gauge trails
    # its engine: on a loaded machine no cut may land while it decodes. Then this run has nothing
    # to judge (no fault happened), which is not a failure of the continuation under test.
    pytest.skip(f"vLLM had finished the stream before each of {CUT_ATTEMPTS} cuts")


def read_stream_stopping(
    url: str,
    path: str,
    body: dict[str, Any],
    pair: Sequence[VllmServer],
    landed: Callable[[Stream], bool],
) -> Stream:
    """`read_stream_cut` with SIGSTOP (hung, not dead), letting the server go on once the stream
    was read (the session's pair serves other tests). A stop that `landed` says came too late
    (vLLM's gauge can lag its last token: the stream was relayed whole) is tried again, at most
    `CUT_ATTEMPTS` times in all."""
    for _ in range(CUT_ATTEMPTS):
        stopped: list[VllmServer] = []
        try:
            stream = read_stream_cut(url, path, body, pair, signal.SIGSTOP, stopped)
        finally:
            for server in stopped:
                os.killpg(server.process.pid, signal.SIGCONT)
        if landed(stream):
            return stream
    raise AssertionError(f"every one of {CUT_ATTEMPTS} stops came after vLLM's last token")


def continued(proxy: KvherdServe, outcome: str = "continued") -> float:
    return proxy.metric("kvherd_continuations_total", outcome=outcome)


def gave_up(proxy: KvherdServe) -> float:
    return continued(proxy, "gave_up") + continued(proxy, "unsupported")


def assert_like_vllm(relayed: Stream, direct: Stream) -> None:
    assert relayed.text == direct.text
    assert relayed.usage == direct.usage
    assert relayed.shapes() == direct.shapes()


def test_greedy_chat_stream_survives_a_hung_instance(
    vllm_pair: tuple[VllmServer, VllmServer], kvherd_fleet: KvherdFactory
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
    pair = vllm_pair
    direct = read_stream(pair[0].url, path, body)
    assert direct.usage[1] == MAX_TOKENS
    with kvherd_fleet() as proxy:
        plain = read_stream(proxy.url, path, body)
        assert_like_vllm(plain, direct)
        raw = "\n".join(plain.events)
        assert '"token_ids":[' not in raw and '"prompt_token_ids":[' not in raw
        assert continued(proxy) == 0
        cut = read_stream_stopping(
            proxy.url, path, body, pair, lambda _: continued(proxy) + gave_up(proxy) > 0
        )
        assert not cut.errors(), (cut.errors(), proxy.log()[-3000:])
        assert cut.text == direct.text, proxy.log()[-3000:]
        assert cut.usage[:2] == (direct.usage[0], MAX_TOKENS)
        assert all(chunk["id"] == cut.chunks[0]["id"] for chunk in cut.chunks)
        assert cut.shapes() <= direct.shapes()  # chat chunks as vLLM writes them
        assert '"token_ids":[' not in "\n".join(cut.events)
        assert continued(proxy) == 1


def test_seeded_sampling_is_not_continued(
    vllm_pair: tuple[VllmServer, VllmServer], kvherd_fleet: KvherdFactory
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
    pair = vllm_pair
    with kvherd_fleet() as proxy:
        cut = read_stream_stopping(
            proxy.url, path, body, pair, lambda stream: bool(stream.errors())
        )
        assert [e["error"]["type"] for e in cut.errors()] == ["server_error"]
        assert continued(proxy) == 0 and continued(proxy, "unsupported") == 1


def test_greedy_completion_stream_survives_a_killed_instance(
    vllm_pair: tuple[VllmServer, VllmServer],
    killable: Callable[[], VllmServer],
    tiny_model: Path,
    prompts: Prompts,
) -> None:
    """The client asks for the token ids here: they are relayed, and those of the stream
    continued elsewhere are vLLM's own, none lost or repeated."""
    for attempt in range(2):
        if kill_and_continue(vllm_pair[0], killable(), tiny_model, prompts, attempt):
            return
    raise AssertionError("both kills came after vLLM's last token (the stream was relayed whole)")


def kill_and_continue(
    a: VllmServer, c: VllmServer, tiny_model: Path, prompts: Prompts, attempt: int
) -> bool:
    """One attempt of the kill test; False when the kill came too late to cut the stream."""
    path = "/v1/completions"
    body = {
        "model": SERVED_MODEL,
        "prompt": prompts.make(f"continuation-killed-{attempt}"),  # cached on c by the direct run
        "max_tokens": MAX_TOKENS,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "return_token_ids": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    direct = read_stream(c.url, path, body)
    assert len(direct.token_ids) == MAX_TOKENS
    killed: list[VllmServer] = []
    args = ["--instance", instance_arg(a), "--instance", instance_arg(c)]
    with kvherd_serve(*args, "--tokenizer", str(tiny_model), "--expose-instance") as proxy:
        assert_index_matches(proxy, a, c)  # c's cached prompt steers the stream there
        plain = read_stream(proxy.url, path, body)
        assert plain.instance == c.spec.name
        assert_like_vllm(plain, direct)
        assert plain.token_ids == direct.token_ids
        # Only c may be killed: a stream on a has no server here to cut (and fails the test).
        cut = read_stream_cut(proxy.url, path, body, [c], signal.SIGKILL, killed)
        if continued(proxy) + gave_up(proxy) == 0:
            return False
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
    return True
