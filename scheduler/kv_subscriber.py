"""KV event subscriber: one ZMQ SUB per instance, gap repair through the instance's replay socket.

Contract:
- For each instance with a KV event endpoint, `KVEventSubscriber` connects a SUB socket (all topics)
  and reads vLLM-format messages ``[topic, seq (8 bytes big-endian), msgpack EventBatch]``; payloads
  are decoded with `kvherd.kv_events.decode_batch` and handed to the sink in sequence
  order, each batch exactly once.
- Joining (and re-joining) an instance: the sink's view of it is cleared, then everything the
  instance's replay buffer still holds is replayed from sequence 0, so the index starts from the
  instance's current cache rather than from whatever happens to be published next.
- A sequence gap (seq > last + 1) asks the replay socket (DEALER, ``[b"", start]`` -> ``[b"", seq,
  payload]``... then the end marker with an empty payload) for the missing batches. If the replay
  cannot cover the gap (buffer already dropped them, no replay socket, or no answer within
  ``replay_timeout_s``) the instance's view is cleared and rebuilt from what can still be replayed:
  a smaller, correct view is better than a stale one that routes to blocks that are gone.
- Batches at or below the last applied sequence number are duplicates of replayed ones and skipped.
  An instance that restarts re-registers (or comes back from ejection), and the proxy then re-adds
  it here, which clears and rebuilds its view.
- Malformed payloads are logged and skipped; they never stop the subscriber.
- Sockets are closed when an instance is removed or the subscriber stops (no leaked sockets/tasks).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Protocol

import zmq
import zmq.asyncio

from kvherd.kv_events import KVEventBatch, KVEventDecodeError, decode_batch

log = logging.getLogger("kvherd.kv_events")

_END_SEQ = -1


class KVEventSink(Protocol):
    """Where decoded batches go (the prefix index, through the proxy's fleet state)."""

    def apply_kv_batch(self, instance_id: str, batch: KVEventBatch) -> None: ...

    def clear_kv_view(self, instance_id: str) -> None: ...


class _InstanceStream:
    """One instance's SUB socket, sequence tracking and replay requests."""

    def __init__(
        self,
        ctx: zmq.asyncio.Context,
        instance_id: str,
        endpoint: str,
        replay_endpoint: str | None,
        sink: KVEventSink,
        replay_timeout_s: float,
    ) -> None:
        self.instance_id = instance_id
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self._ctx = ctx
        self._sink = sink
        self._replay_timeout_s = replay_timeout_s
        self.last_seq = -1
        self.batches = 0
        self.gaps = 0
        self.resyncs = 0
        self._sub = ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.LINGER, 0)
        self._sub.setsockopt(zmq.SUBSCRIBE, b"")
        self._sub.connect(endpoint)
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name=f"kv-events-{self.instance_id}")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self._sub.close(linger=0)

    def _apply(self, seq: int, payload: bytes) -> None:
        try:
            batch = decode_batch(seq, payload)
        except KVEventDecodeError as exc:
            log.warning("instance %s: skipping KV event batch %d: %s", self.instance_id, seq, exc)
        else:
            self._sink.apply_kv_batch(self.instance_id, batch)
            self.batches += 1
        self.last_seq = seq

    async def _replay(self, start: int) -> list[tuple[int, bytes]] | None:
        """Buffered batches from `start` on, or None when the replay socket did not answer."""
        if self.replay_endpoint is None:
            return None
        dealer = self._ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        try:
            dealer.connect(self.replay_endpoint)
            await dealer.send_multipart([b"", start.to_bytes(8, "big", signed=True)])
            batches: list[tuple[int, bytes]] = []
            async with asyncio.timeout(self._replay_timeout_s):
                while True:
                    frames = await dealer.recv_multipart()
                    if frames and frames[0] == b"":
                        frames = frames[1:]
                    if len(frames) != 2:
                        log.warning("instance %s: malformed replay reply", self.instance_id)
                        return None
                    seq = int.from_bytes(frames[0], "big", signed=True)
                    if seq == _END_SEQ or not frames[1]:
                        return batches
                    batches.append((seq, frames[1]))
        except TimeoutError:
            log.warning("instance %s: KV event replay timed out", self.instance_id)
            return None
        finally:
            dealer.close(linger=0)

    async def resync(self) -> None:
        """Clear the instance's view and rebuild it from everything still replayable."""
        self.resyncs += 1
        self._sink.clear_kv_view(self.instance_id)
        self.last_seq = -1
        for seq, payload in await self._replay(0) or ():
            if seq > self.last_seq:
                self._apply(seq, payload)

    async def _fill_gap(self, upto: int) -> None:
        """Replay batches last_seq+1 .. upto-1; resync when they are not all available."""
        self.gaps += 1
        start = self.last_seq + 1
        batches = await self._replay(start)
        if batches is None or not batches or batches[0][0] > start:
            log.warning(
                "instance %s: KV events %d..%d lost; resyncing", self.instance_id, start, upto - 1
            )
            await self.resync()
            return
        for seq, payload in batches:
            if self.last_seq < seq < upto:
                self._apply(seq, payload)

    async def _run(self) -> None:
        await self.resync()
        while True:
            frames = await self._sub.recv_multipart()
            if len(frames) < 2:
                continue
            seq = int.from_bytes(frames[-2], "big")
            payload = frames[-1]
            if seq <= self.last_seq:
                continue  # already applied through a replay
            elif seq > self.last_seq + 1:
                await self._fill_gap(seq)
                if seq <= self.last_seq:
                    continue
            self._apply(seq, payload)


class KVEventSubscriber:
    """All instances' KV event streams, feeding one sink."""

    def __init__(self, sink: KVEventSink, replay_timeout_s: float = 2.0) -> None:
        self._sink = sink
        self._ctx = zmq.asyncio.Context()
        self._streams: dict[str, _InstanceStream] = {}
        self.replay_timeout_s = replay_timeout_s

    def stats(self, instance_id: str) -> dict[str, int] | None:
        stream = self._streams.get(instance_id)
        if stream is None:
            return None
        return {
            "last_seq": stream.last_seq,
            "batches": stream.batches,
            "gaps": stream.gaps,
            "resyncs": stream.resyncs,
        }

    async def add(self, instance_id: str, endpoint: str, replay_endpoint: str | None) -> None:
        """Subscribe to an instance (re-subscribes from scratch if it was already known)."""
        await self.remove(instance_id)
        stream = _InstanceStream(
            self._ctx, instance_id, endpoint, replay_endpoint, self._sink, self.replay_timeout_s
        )
        self._streams[instance_id] = stream
        stream.start()

    async def remove(self, instance_id: str) -> None:
        stream = self._streams.pop(instance_id, None)
        if stream is not None:
            await stream.stop()

    async def close(self) -> None:
        for instance_id in list(self._streams):
            await self.remove(instance_id)
        self._ctx.term()
