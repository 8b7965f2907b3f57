"""KV event publisher: vLLM's ZMQ wire protocol (PUB stream + ROUTER replay).

Contract (the same bytes vLLM's `ZmqEventPublisher` puts on the wire, so consumers of either work
with both):
- PUB socket: one multipart message per batch ``[topic, seq, payload]`` where ``seq`` is the batch's
  sequence number as 8 bytes big-endian and ``payload`` is `encode_batch` (msgpack EventBatch).
  Sequence numbers are the engine's: consecutive, so a subscriber detects a gap. As vLLM's
  publisher does, a batch without a data-parallel rank is stamped with the publisher's (0), so the
  EventBatch is always ``[ts, events, dp_rank]``.
- ROUTER replay socket, framed exactly as vLLM 0.32's: a client (DEALER sending an empty delimiter
  frame first, or REQ) sends one frame, the 8-byte big-endian sequence number to start from. The
  reply is one message ``[b"", topic, seq, payload]`` per buffered batch with ``seq >= start`` in
  order, then the end marker ``[b"", b"", (-1).to_bytes(8, "big", signed=True), b""]``. A DEALER
  that omits the delimiter gets the same frames without it. A start older than the buffer gets
  what is still buffered (the client sees the gap and must resync).
- The replay buffer keeps the last `buffer_steps` batches (bounded memory).
- Both sockets bind (a fleet's scheduler connects to its agents). ``tcp://host:*`` binds an ephemeral
  port; `endpoint` / `replay_endpoint` report the address actually bound.
- `publish` may be called from one thread at a time (the engine thread); the replay socket is served
  by the publisher's own thread. The buffer is shared under a lock.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections import deque

import zmq

from kvherd.kv_events import KVEventBatch, encode_batch

log = logging.getLogger(__name__)

END_SEQ = (-1).to_bytes(8, "big", signed=True)


class KVEventPublisher:
    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str | None = None,
        *,
        topic: str = "",
        buffer_steps: int = 10_000,
        hwm: int = 100_000,
        dp_rank: int = 0,
    ) -> None:
        self.dp_rank = dp_rank
        self._ctx = zmq.Context()
        self._topic = topic.encode()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._lock = threading.Lock()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(hwm)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._pub.bind(endpoint)
        self.endpoint: str = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self.last_seq = -1
        self.replay_endpoint: str | None = None
        self._closed = threading.Event()
        self._thread: threading.Thread | None = None
        if replay_endpoint is not None:
            router = self._ctx.socket(zmq.ROUTER)
            router.setsockopt(zmq.LINGER, 0)
            router.bind(replay_endpoint)
            self.replay_endpoint = router.getsockopt_string(zmq.LAST_ENDPOINT)
            self._thread = threading.Thread(
                target=self._serve_replay, args=(router,), name="kv-replay", daemon=True
            )
            self._thread.start()

    def publish(self, batch: KVEventBatch) -> None:
        if batch.dp_rank is None:
            batch = dataclasses.replace(batch, dp_rank=self.dp_rank)
        payload = encode_batch(batch)
        seq_bytes = batch.seq.to_bytes(8, "big")
        with self._lock:
            if self._closed.is_set():
                return
            self._buffer.append((batch.seq, payload))
            self.last_seq = batch.seq
            # PUB never blocks: past the high-water mark ZMQ drops, and replay covers the gap.
            self._pub.send_multipart((self._topic, seq_bytes, payload))

    def buffered(self, start_seq: int) -> list[tuple[int, bytes]]:
        with self._lock:
            return [(seq, payload) for seq, payload in self._buffer if seq >= start_seq]

    def _serve_replay(self, router: zmq.Socket) -> None:
        poller = zmq.Poller()
        poller.register(router, zmq.POLLIN)
        try:
            while not self._closed.is_set():
                # The timeout only bounds how long close() waits for this thread.
                if not poller.poll(200):
                    continue
                frames = router.recv_multipart()
                try:
                    self._answer(router, frames)
                except zmq.ZMQError as exc:  # a client that went away mid-reply
                    log.warning("KV event replay reply failed: %s", exc)
        finally:
            router.close(linger=0)

    def _answer(self, router: zmq.Socket, frames: list[bytes]) -> None:
        # vLLM's clients send [identity, b"", start]; a DEALER may omit the delimiter.
        if len(frames) == 3 and frames[1] == b"":
            envelope = [frames[0], b""]
        elif len(frames) == 2:
            envelope = [frames[0]]
        else:
            log.warning("ignoring malformed KV event replay request (%d frames)", len(frames))
            return
        start_bytes = frames[-1]
        if len(start_bytes) != 8:
            log.warning("ignoring KV event replay request with a %d-byte start", len(start_bytes))
            router.send_multipart([*envelope, b"", END_SEQ, b""])
            return
        start = int.from_bytes(start_bytes, "big", signed=True)
        topic = self._topic
        for seq, payload in self.buffered(start):
            router.send_multipart([*envelope, topic, seq.to_bytes(8, "big"), payload])
        router.send_multipart([*envelope, b"", END_SEQ, b""])

    def close(self) -> None:
        with self._lock:
            if self._closed.is_set():
                return
            self._closed.set()
            self._pub.close(linger=0)
        if self._thread is not None:
            self._thread.join(timeout=2.0)
        self._ctx.term()
