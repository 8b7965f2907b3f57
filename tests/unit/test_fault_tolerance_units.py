"""Fault-tolerance cores: the stream ledger, deadlines, loop lag, the ejection bound, failing over."""

from __future__ import annotations

import asyncio
import re

import pytest

from kvherd import wire
from scheduler.core.deadlines import Deadlines, DeadlineSettings
from scheduler.core.outliers import Health, OutlierDetector
from scheduler.forwarding import UpstreamConnectError, UpstreamError, UpstreamPool
from scheduler.loop_lag import LoopLag
from scheduler.proxy.continuation import StreamLedger, with_token_ids

RESUME = {
    "from": 0,
    "id": "cmpl-x",
    "created": 7,
    "model": "tiny",
    "chat": False,
    "prompt_tokens": 5,
    "return_token_ids": False,
    "continuous_usage_stats": False,
    "include_usage": True,
}


def frame(index: int, ids: list[int], text: str, finish: str | None = None) -> bytes:
    chunk = {"id": "cmpl-x", "choices": [{"index": 0, "text": text, "finish_reason": finish}]}
    return wire.ledger_line({"index": index, "token_ids": ids}) + wire.sse(chunk)


def test_ledger_strips_its_lines_holds_partial_events_and_builds_the_continuation() -> None:
    ledger = StreamLedger()
    first = wire.ledger_line({"resume": RESUME, "sampling_seed": 99}) + frame(0, [1, 2], "ab")
    out = ledger.feed(first[:-1])  # the event's last newline has not arrived
    assert out == b""
    out = ledger.feed(first[-1:] + frame(2, [3], "c")[:10])
    assert out == wire.sse({"id": "cmpl-x", "choices": [{"index": 0, "text": "ab",
                                                          "finish_reason": None}]})  # fmt: skip
    assert b"kvherd" not in out
    ledger.feed(frame(2, [3], "c")[10:])
    assert not ledger.finished and not ledger.complete()
    continued = ledger.continuation({"prompt": "hello", "stream": True})
    assert continued is not None and continued.on_agent and continued.path is None
    assert continued.done == 3
    body = continued.body
    assert body["prompt"] == "hello"
    cont = body["kvherd_continuation"]
    assert cont["output_token_ids"] == [1, 2, 3]
    assert cont["emitted_text"] == "abc"
    assert cont["sampling_seed"] == 99
    assert cont["resume"] == {**RESUME, "from": 3}


def test_ledger_refuses_what_it_cannot_continue_exactly() -> None:
    plain = StreamLedger()  # no ledger lines: not a kvherd agent
    plain.feed(wire.sse({"choices": [{"text": "a", "finish_reason": None}]}))
    assert plain.continuation({"prompt": "p"}) is None
    gap = StreamLedger()
    gap.feed(wire.ledger_line({"resume": RESUME, "sampling_seed": 1}) + frame(0, [1], "a"))
    gap.feed(frame(5, [2], "b"))  # tokens 1-4 never relayed
    assert gap.continuation({"prompt": "p"}) is None


def test_ledger_turns_an_error_frame_into_an_upstream_failure() -> None:
    ledger = StreamLedger()
    good = wire.ledger_line({"resume": RESUME, "sampling_seed": 1}) + frame(0, [1], "a")
    error = wire.sse(wire.OpenAIError(500, "engine failed", type="server_error").body())
    with pytest.raises(UpstreamError):
        ledger.feed(good + error + wire.SSE_DONE)
    continued = ledger.continuation({"prompt": "p"})
    assert continued is not None
    assert continued.body["kvherd_continuation"]["output_token_ids"] == [1]


def test_ledger_ends_a_stream_that_only_lost_its_end() -> None:
    ledger = StreamLedger()
    ledger.feed(wire.ledger_line({"resume": RESUME, "sampling_seed": 1}) + frame(0, [1, 2], "ab"))
    ledger.feed(frame(2, [3], "c", finish="length"))
    assert ledger.finished and not ledger.complete()
    closing = ledger.closing_frames()
    assert closing.endswith(wire.SSE_DONE)
    assert b'"usage":{"prompt_tokens":5,"completion_tokens":3,"total_tokens":8' in closing
    ledger.feed(wire.SSE_DONE)
    assert ledger.complete()


# vLLM 0.32's streamed chunks with ``return_token_ids`` (bytes as a live server sent them).
V_ID = "cmpl-99df0e3d496c8343"


def v_chunk(text: str, ids: list[int], prompt: list[int] | None = None,
            finish: str | None = None) -> bytes:  # fmt: skip
    return (
        b'data: {"id":"%s","object":"text_completion","created":1796123142,"model":"tiny",'
        b'"choices":[{"index":0,"text":"%s","logprobs":null,"finish_reason":%s,'
        b'"stop_reason":null,"prompt_token_ids":%s,"token_ids":%s}]}\n\n'
        % (
            V_ID.encode(),
            text.encode(),
            b"null" if finish is None else b'"%s"' % finish.encode(),
            b"null" if prompt is None else str(prompt).replace(" ", "").encode(),
            str(ids).replace(" ", "").encode(),
        )
    )


def decode(ids: list[int]) -> str:
    """A detokenizer where ids from 160 to 299 are bytes of a character that 552 completes."""
    text = ""
    for token in ids:
        text = text.removesuffix("\ufffd") + ("\ufffd" if 160 <= token < 300 else "x")
    return text


def without_ids(frame: bytes) -> bytes:
    """What vLLM sends when the client did not ask for token ids."""
    return re.sub(rb'("(?:prompt_)?token_ids":)\[[^\]]*\]', rb"\1null", frame)


def test_vllm_ledger_relays_the_bytes_vllm_sends_without_token_ids() -> None:
    body = {"prompt": "hello", "stream": True, "temperature": 0, "max_tokens": 8}
    asked = with_token_ids(body)
    assert asked == {**body, "return_token_ids": True}
    assert with_token_ids(asked) is None  # the client asked: sent as it is, relayed as it is
    ledger = StreamLedger.from_vllm(body, False, decode)
    first = v_chunk("D", [39], prompt=[1, 261, 79])
    out = ledger.feed(first + v_chunk("u", [88]))
    expected = without_ids(first + v_chunk("u", [88]))
    assert out == expected
    assert b'"prompt_token_ids":null,"token_ids":null' in out
    keep = StreamLedger.from_vllm(asked, False, decode)
    assert keep.feed(first) == first


def test_vllm_continuation_is_a_token_prompt_with_the_rest_of_the_budget() -> None:
    body = {"model": "tiny", "prompt": "hello", "stream": True, "temperature": 0,
            "max_tokens": 8, "min_tokens": 3, "ignore_eos": True, "cache_salt": "s",
            "stream_options": {"include_usage": True}}  # fmt: skip
    ledger = StreamLedger.from_vllm(body, False, decode)
    ledger.feed(v_chunk("D", [39], prompt=[1, 261, 79]) + v_chunk("uFG", [88, 425]))
    continued = ledger.continuation(body)
    assert continued is not None and not continued.on_agent
    assert continued.path == b"/v1/completions" and continued.done == 3
    assert continued.body == {
        "model": "tiny", "temperature": 0, "ignore_eos": True, "cache_salt": "s",
        "prompt": [1, 261, 79, 39, 88, 425], "stream": True, "return_token_ids": True,
        "max_tokens": 5, "min_tokens": 0,
        "stream_options": {"include_usage": True, "continuous_usage_stats": False},
    }  # fmt: skip
    # The continuation's chunks are the original stream's: its id, prompt and usage counts.
    rest = v_chunk("am", [592], prompt=[1, 261, 79, 39, 88, 425]).replace(V_ID.encode(), b"cmpl-2")
    usage = (b'data: {"id":"cmpl-2","object":"text_completion","created":5,"model":"tiny",'
             b'"choices":[],"usage":{"prompt_tokens":6,"total_tokens":7,"completion_tokens":1,'
             b'"prompt_tokens_details":{"cached_tokens":6}}}\n\n')  # fmt: skip
    out = ledger.feed(rest + usage + wire.SSE_DONE)
    assert (
        out
        == without_ids(v_chunk("am", [592]))
        + (
            b'data: {"id":"%s","object":"text_completion","created":1796123142,"model":"tiny",'
            b'"choices":[],"usage":{"prompt_tokens":3,"total_tokens":7,"completion_tokens":4,'
            b'"prompt_tokens_details":{"cached_tokens":3}}}\n\n' % V_ID.encode()
        )
        + wire.SSE_DONE
    )
    assert ledger.complete()
    again = ledger.continuation(body)  # a second loss: every token relayed so far
    assert again is not None and again.body["prompt"] == [1, 261, 79, 39, 88, 425, 592]


def test_vllm_chat_continuation_is_reframed_as_chat_chunks() -> None:
    body = {"messages": [{"role": "user", "content": "hi"}], "stream": True,
            "temperature": 0, "max_completion_tokens": 4}  # fmt: skip
    role = (b'data: {"id":"chatcmpl-a","object":"chat.completion.chunk","created":9,"model":"tiny",'
            b'"choices":[{"index":0,"delta":{"role":"assistant","content":""},"logprobs":null,'
            b'"finish_reason":null}],"prompt_token_ids":[1,31,95],"prompt_text":null}\n\n')  # fmt: skip
    token = (b'data: {"id":"chatcmpl-a","object":"chat.completion.chunk","created":9,"model":"tiny",'
             b'"choices":[{"index":0,"delta":{"content":"x"},"logprobs":null,"finish_reason":null,'
             b'"token_ids":[40]}]}\n\n')  # fmt: skip
    ledger = StreamLedger.from_vllm(body, True, decode)
    assert ledger.feed(role + token) == without_ids(role + token)
    continued = ledger.continuation(body)
    assert continued is not None
    assert continued.body["prompt"] == [1, 31, 95, 40] and continued.body["max_tokens"] == 3
    out = ledger.feed(v_chunk("yz", [232, 552], prompt=[1, 31, 95, 40], finish="length"))
    assert out == (
        b'data: {"id":"chatcmpl-a","object":"chat.completion.chunk","created":9,"model":"tiny",'
        b'"choices":[{"index":0,"delta":{"content":"yz"},"logprobs":null,"finish_reason":"length",'
        b'"stop_reason":null,"token_ids":null}]}\n\n'
    )
    assert ledger.finished


def test_vllm_greedy_continuation_starts_after_the_last_token_with_text() -> None:
    """vLLM primes its detokenizer with a token prompt; ending inside a character it would
    send the prompt's whole text. So the tokens whose text was held back are generated again
    and only the text they complete is relayed."""
    body = {"prompt": "p", "stream": True, "temperature": 0, "max_tokens": 10,
            "return_token_ids": True, "stream_options": {"include_usage": True}}  # fmt: skip
    ledger = StreamLedger.from_vllm(body, False, decode)
    sent = v_chunk("D", [39], prompt=[1]) + v_chunk("", [163]) + v_chunk("", [232])
    assert ledger.feed(sent) == sent  # the client asked for the ids: relayed as they are
    continued = ledger.continuation(body)
    assert continued is not None and continued.done == 3
    assert continued.body["prompt"] == [1, 39] and continued.body["max_tokens"] == 9
    again = v_chunk("", [163], prompt=[1, 39]) + v_chunk("", [232])
    assert ledger.feed(again) == b""  # the client had these
    rest = v_chunk("\u00e9z", [552, 40])
    usage = (b'data: {"id":"c","object":"text_completion","created":5,"model":"tiny",'
             b'"choices":[],"usage":{"prompt_tokens":2,"total_tokens":6,"completion_tokens":4}}'
             b"\n\n")  # fmt: skip
    out = ledger.feed(rest + usage)
    assert out.startswith(v_chunk("\u00e9z", [552, 40]))
    assert b'"prompt_tokens":1,"total_tokens":6,"completion_tokens":5' in out
    twice = ledger.continuation(body)  # a second loss: each token once
    assert twice is not None and twice.body["prompt"] == [1, 39, 163, 232, 552, 40]
    other = StreamLedger.from_vllm(body, False, decode)
    other.feed(sent)
    assert other.continuation(body) is not None
    with pytest.raises(UpstreamError):  # not what greedy decoding gave: not continued exactly
        other.feed(v_chunk("", [164], prompt=[1, 39]))


def test_vllm_streams_that_a_continuation_cannot_reproduce_are_not_continued() -> None:
    base = {"prompt": "p", "stream": True, "max_tokens": 8}
    for body in (
        {**base, "temperature": 0.8, "seed": 7},  # seeded sampling: vLLM's generator restarts
        {**base, "temperature": 0, "presence_penalty": 0.5},  # counts output tokens only
        {**base, "temperature": 0, "logprobs": 2},
        {**base, "temperature": 0, "n": 2},
    ):
        ledger = StreamLedger.from_vllm(body, False, decode)
        ledger.feed(v_chunk("D", [39], prompt=[1]))
        assert ledger.continuation(body) is None, body
    unseeded = {**base, "temperature": 0.8}  # a sample of the same distribution: continued
    ledger = StreamLedger.from_vllm(unseeded, False, decode)
    ledger.feed(v_chunk("D", [39], prompt=[1]))
    assert ledger.continuation(unseeded) is not None
    spent = StreamLedger.from_vllm({**base, "temperature": 0, "max_tokens": 1}, False, decode)
    spent.feed(v_chunk("D", [39], prompt=[1]))
    assert spent.continuation({**base, "temperature": 0, "max_tokens": 1}) is None
    held = {**base, "temperature": 0.8}  # sampled, cut inside a character
    for asked, expected in ((False, [1, 39]), (True, None)):
        cut = StreamLedger.from_vllm({**held, "return_token_ids": asked}, False, decode)
        cut.feed(v_chunk("D", [39], prompt=[1]) + v_chunk("", [163]))
        sampled = cut.continuation(held)
        # Its held-back token is replaced; a client that has its id would see it vanish.
        assert (sampled and sampled.body["prompt"]) == expected
    blind = StreamLedger.from_vllm(base, False, decode)  # ids missing: nothing to continue from
    blind.feed(without_ids(v_chunk("D", [39], prompt=[1])))
    assert blind.continuation({**base, "temperature": 0}) is None


def test_deadlines_follow_the_step_time_within_floor_and_cap() -> None:
    settings = DeadlineSettings(
        first_byte_floor_s=5, first_byte_cap_s=60, inter_chunk_floor_s=1, inter_chunk_cap_s=10
    )
    deadlines = Deadlines(settings)
    assert deadlines.inter_chunk("a") == 1 and deadlines.first_byte("a", 100) == 5
    deadlines.observe_gap("a", 0.01)
    assert deadlines.inter_chunk("a") == 1  # 20 x 10 ms is under the floor
    assert deadlines.first_byte("a", 99) == pytest.approx(20)  # 20 x 10 ms x 100 requests
    for _ in range(500):
        deadlines.observe_gap("a", 5.0)
    assert deadlines.inter_chunk("a") == 10 and deadlines.first_byte("a", 0) == 60
    deadlines.forget("a")
    assert deadlines.inter_chunk("a") == 1
    with pytest.raises(ValueError):
        DeadlineSettings(inter_chunk_floor_s=3, inter_chunk_cap_s=2)


def test_loop_lag_is_what_late_ticks_owe() -> None:
    lag = LoopLag(interval_s=0.05, window_s=10)
    lag.expect(1.0)
    lag.record(1.0)  # on time
    assert lag.owed(0.0, now=1.0) == 0
    lag.expect(1.05)
    lag.record(2.05)  # a second late: the loop was busy
    assert lag.owed(0.0, now=2.05) == pytest.approx(1.0)
    assert lag.owed(1.8, now=2.05) == pytest.approx(0.25)  # only what falls after `since`
    assert lag.saturated(now=2.05)
    lag.expect(2.1)
    assert lag.owed(2.05, now=2.6) == pytest.approx(0.5)  # the pending tick is overdue
    lag.record(2.1)
    lag.expect(20.0)
    lag.record(20.0)
    assert lag.owed(0.0, now=20.0) == 0 and not lag.saturated(now=20.0)  # out of the window


def test_ejection_is_bounded_and_spares_the_last_healthy_instance() -> None:
    detector = OutlierDetector(consecutive_failures=1, max_ejection_fraction=0.5)
    for name in "abcd":
        detector.add(name)
    assert detector.record_failure("a", 0) is Health.EJECTED
    assert detector.record_failure("b", 0) is Health.EJECTED
    assert detector.record_failure("c", 0) is None  # half the fleet is out already
    assert detector.healthy("c", 0) and detector.healthy("d", 0)
    alone = OutlierDetector(consecutive_failures=1)
    alone.add("x")
    assert alone.record_failure("x", 0) is None and alone.healthy("x", 0)
    pair = OutlierDetector(consecutive_failures=1)
    pair.add("x")
    pair.add("y")
    assert pair.record_failure("x", 0) is Health.EJECTED
    assert pair.record_failure("y", 0) is None  # the last healthy one stays


async def test_abort_fails_every_request_in_flight_to_an_instance_at_once() -> None:
    accepted: list[asyncio.StreamWriter] = []

    async def hang(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted.append(writer)  # a hung instance: reads nothing, answers nothing

    server = await asyncio.start_server(hang, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    pool = UpstreamPool(head_timeout=60)
    try:
        sends = [
            asyncio.ensure_future(pool.send(url, b"POST", b"/v1/completions", [], b"{}"))
            for _ in range(3)
        ]
        while len(accepted) < 3:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)  # the requests are written and waiting for their heads
        assert pool.abort(url, "ejected") == 3
        for send in sends:
            with pytest.raises(UpstreamConnectError, match="ejected"):
                await asyncio.wait_for(send, 5)
        assert pool.abort(url, "again") == 0
    finally:
        for writer in accepted:
            writer.close()
        server.close()
        await server.wait_closed()
        await pool.close()
