"""Fault-tolerance cores: the stream ledger, deadlines, loop lag, the ejection bound, failing over."""

from __future__ import annotations

import asyncio

import pytest

from kvherd import wire
from scheduler.core.deadlines import Deadlines, DeadlineSettings
from scheduler.core.outliers import Health, OutlierDetector
from scheduler.proxy.continuation import StreamLedger
from scheduler.proxy.forwarding import UpstreamConnectError, UpstreamError, UpstreamPool
from scheduler.proxy.loop_lag import LoopLag

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
    body = ledger.continuation_body({"prompt": "hello", "stream": True})
    assert body is not None
    assert body["prompt"] == "hello"
    cont = body["kvherd_continuation"]
    assert cont["output_token_ids"] == [1, 2, 3]
    assert cont["emitted_text"] == "abc"
    assert cont["sampling_seed"] == 99
    assert cont["resume"] == {**RESUME, "from": 3}


def test_ledger_refuses_what_it_cannot_continue_exactly() -> None:
    plain = StreamLedger()  # no ledger lines: not a kvherd agent
    plain.feed(wire.sse({"choices": [{"text": "a", "finish_reason": None}]}))
    assert plain.continuation_body({"prompt": "p"}) is None
    gap = StreamLedger()
    gap.feed(wire.ledger_line({"resume": RESUME, "sampling_seed": 1}) + frame(0, [1], "a"))
    gap.feed(frame(5, [2], "b"))  # tokens 1-4 never relayed
    assert gap.continuation_body({"prompt": "p"}) is None


def test_ledger_turns_an_error_frame_into_an_upstream_failure() -> None:
    ledger = StreamLedger()
    good = wire.ledger_line({"resume": RESUME, "sampling_seed": 1}) + frame(0, [1], "a")
    error = wire.sse(wire.OpenAIError(500, "engine failed", type="server_error").body())
    with pytest.raises(UpstreamError):
        ledger.feed(good + error + wire.SSE_DONE)
    body = ledger.continuation_body({"prompt": "p"})
    assert body is not None and body["kvherd_continuation"]["output_token_ids"] == [1]


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
