"""KV event publisher: vLLM's PUB framing and ROUTER replay protocol, bounded buffer."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator

import msgpack
import pytest
import zmq

from instance_agent.kv_publisher import END_SEQ, KVEventPublisher
from kvherd.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    decode_batch,
)


def _batch(seq: int) -> KVEventBatch:
    stored = BlockStored([seq * 10 + 1, seq * 10 + 2], None, list(range(8)), 4)
    return KVEventBatch(seq, 1000.0 + seq, [stored, BlockRemoved([seq]), AllBlocksCleared()])


@pytest.fixture
def publisher() -> Iterator[KVEventPublisher]:
    pub = KVEventPublisher(
        "tcp://127.0.0.1:*", "tcp://127.0.0.1:*", topic="kv-events", buffer_steps=5
    )
    try:
        yield pub
    finally:
        pub.close()


def _subscribe(ctx: zmq.Context, endpoint: str, pub: KVEventPublisher) -> zmq.Socket:
    """A SUB socket that provably receives (PUB drops messages until the subscription lands)."""
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(endpoint)
    probe_seq = 10_000
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        pub.publish(KVEventBatch(probe_seq, 0.0, []))
        if sub.poll(50):
            while sub.poll(50):  # drain every probe that got through
                sub.recv_multipart()
            return sub
    raise TimeoutError("subscription never became active")


def test_pub_frames_are_topic_seq_payload(publisher: KVEventPublisher) -> None:
    ctx = zmq.Context()
    sub = _subscribe(ctx, publisher.endpoint, publisher)
    try:
        for seq in range(3):
            publisher.publish(_batch(seq))
        for seq in range(3):
            assert sub.poll(5000)
            topic, seq_bytes, payload = sub.recv_multipart()
            assert topic == b"kv-events"
            assert len(seq_bytes) == 8 and int.from_bytes(seq_bytes, "big") == seq
            assert decode_batch(seq, payload) == dataclasses.replace(_batch(seq), dp_rank=0)
            assert msgpack.unpackb(payload)[2] == 0  # [ts, events, dp_rank], as vLLM sends
    finally:
        sub.close(linger=0)
        ctx.term()


def _replay(endpoint: str, start: int, socket_type: int) -> list[tuple[int, bytes]]:
    ctx = zmq.Context()
    sock = ctx.socket(socket_type)
    sock.connect(endpoint)
    try:
        start_frame = start.to_bytes(8, "big", signed=True)
        if socket_type == zmq.DEALER:
            sock.send_multipart([b"", start_frame])
        else:
            sock.send(start_frame)
        replies: list[tuple[int, bytes]] = []
        while True:
            assert sock.poll(5000), "replay did not answer"
            frames = sock.recv_multipart()
            if socket_type == zmq.DEALER:
                assert frames[0] == b""
                frames = frames[1:]
            topic, seq_bytes, payload = frames  # vLLM 0.32's framing
            if seq_bytes == END_SEQ:
                assert (topic, payload) == (b"", b"")
                return replies
            assert topic == b"kv-events"
            replies.append((int.from_bytes(seq_bytes, "big"), payload))
            if socket_type == zmq.REQ:
                return replies  # a REQ socket takes exactly one reply per request
    finally:
        sock.close(linger=0)
        ctx.term()


def test_replay_returns_missed_batches_then_end_marker(publisher: KVEventPublisher) -> None:
    for seq in range(4):
        publisher.publish(_batch(seq))
    assert publisher.replay_endpoint is not None
    replies = _replay(publisher.replay_endpoint, 2, zmq.DEALER)
    assert [seq for seq, _ in replies] == [2, 3]
    assert [decode_batch(seq, p).events for seq, p in replies] == [
        _batch(2).events,
        _batch(3).events,
    ]
    # vLLM's own example subscriber uses a REQ socket: its first reply is the first missed batch.
    assert _replay(publisher.replay_endpoint, 1, zmq.REQ)[0][0] == 1
    # Asking past the newest batch gets just the end marker.
    assert _replay(publisher.replay_endpoint, 99, zmq.DEALER) == []


def test_replay_buffer_is_bounded(publisher: KVEventPublisher) -> None:
    for seq in range(12):
        publisher.publish(_batch(seq))
    assert [seq for seq, _ in publisher.buffered(0)] == [7, 8, 9, 10, 11]
    assert publisher.replay_endpoint is not None
    assert [seq for seq, _ in _replay(publisher.replay_endpoint, 0, zmq.DEALER)] == [
        7, 8, 9, 10, 11,
    ]  # fmt: skip
    assert publisher.last_seq == 11


def test_malformed_replay_request_gets_end_marker(publisher: KVEventPublisher) -> None:
    assert publisher.replay_endpoint is not None
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.connect(publisher.replay_endpoint)
    try:
        sock.send_multipart([b"", b"abc"])  # not an 8-byte sequence number
        assert sock.poll(5000)
        assert sock.recv_multipart() == [b"", b"", END_SEQ, b""]
    finally:
        sock.close(linger=0)
        ctx.term()
