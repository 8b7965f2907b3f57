"""KV event subscriber: one ZMQ SUB per instance, gap repair through the instance's replay socket.

Contract:
- Topologies: for an instance whose engine binds its PUB (vLLM with ``tcp://*:P``, kvherd agents),
  the subscriber connects a SUB (`add(..., bind=False)`); for an engine that connects its PUB
  (vLLM with ``tcp://host:P``), it binds a SUB of the instance's own on that endpoint
  (``bind=True``), so every message on it is the instance's. `bind_shared(endpoint)` binds one SUB
  that several engines connect to; its messages are attributed by topic (vLLM's
  ``kv-events-config`` ``"topic"``), each instance added with ``topic=NAME``; a topic no instance
  claims is counted (`unclaimed_topics`) and logged once.
- Messages are vLLM's ``[topic, seq (8 bytes big-endian), msgpack EventBatch]``; payloads are
  decoded with `kvherd.kv_events.decode_batch` and handed to the sink in sequence order, each batch
  exactly once.
- Replay (vLLM 0.32's framing, which kvherd agents answer too): a DEALER sends ``[b"", start]``;
  the ROUTER answers ``[b"", topic, seq, payload]`` per buffered batch, then ``seq == -1``. Older
  kvherd agents' ``[b"", seq, payload]`` replies are read as well.
- Joining (and re-joining) an instance: the sink's view of it is cleared, then everything the
  instance's replay buffer still holds is replayed from sequence 0, so the index starts from the
  instance's current cache rather than from whatever happens to be published next.
- A sequence gap (seq > last + 1) asks the replay socket for the missing batches. If the replay
  cannot cover them (no replay socket, no answer within ``replay_timeout_s``, or a buffer that no
  longer reaches back to them) the instance's view is cleared and rebuilt from what can still be
  replayed; the same holds at join time for a buffer that no longer starts at 0. Either way part
  of the instance's cache is unknown: that is logged at WARNING, counted (``history_lost``) and
  reported to the observer's `kv_history_lost`, which falls back to the approximate index for it.
- Each BlockStored's ``block_size`` is checked; the first size an instance reports, and any later
  change, goes to the observer's `kv_block_size_seen` (the fleet compares it with its own).
- Silence: `note_traffic(instance)` (a routed request that should make the engine store blocks)
  starts a clock; an instance that then sends no batch for `silence_warn_s` is logged at WARNING
  once and reported to `kv_events_silent`, until its next batch.
- Batches at or below the last applied sequence number are duplicates of replayed ones and skipped.
- Malformed payloads are logged and skipped; they never stop the subscriber.
- Sockets are closed when an instance is removed or the subscriber stops (no leaked sockets/tasks).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import Protocol

import zmq
import zmq.asyncio

from kvherd.kv_events import BlockStored, KVEventBatch, KVEventDecodeError, decode_batch

log = logging.getLogger("kvherd.kv_events")

_END_SEQ = -1


class KVEventSink(Protocol):
    """Where decoded batches go (the prefix index, through the proxy's fleet state)."""

    def apply_kv_batch(self, instance_id: str, batch: KVEventBatch) -> None: ...

    def clear_kv_view(self, instance_id: str) -> None: ...


class KVStreamObserver(Protocol):
    """What the subscriber learns about a stream besides its events (the fleet acts on it)."""

    def kv_block_size_seen(self, instance_id: str, block_size: int) -> None: ...

    def kv_history_lost(self, instance_id: str, detail: str) -> None: ...

    def kv_events_silent(self, instance_id: str, silent_s: float) -> None: ...


class _InstanceStream:
    """One instance's messages, sequence tracking and replay requests."""

    def __init__(
        self,
        subscriber: KVEventSubscriber,
        instance_id: str,
        endpoint: str | None,
        replay_endpoint: str | None,
        bind: bool,
    ) -> None:
        self.instance_id = instance_id
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self._owner = subscriber
        self.last_seq = -1
        self.batches = 0
        self.gaps = 0
        self.resyncs = 0
        self.history_lost = 0
        self.block_size: int | None = None
        self.last_batch_at: float | None = None
        self.awaiting_since: float | None = None  # traffic routed here since the last batch
        self.silent = False
        self._sub: zmq.asyncio.Socket | None = None
        self.queue: asyncio.Queue[tuple[int, bytes]] | None = None
        if endpoint is None:  # fed by the shared bound socket
            self.queue = asyncio.Queue()
        else:
            sub = subscriber.ctx.socket(zmq.SUB)
            sub.setsockopt(zmq.LINGER, 0)
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            try:
                if bind:
                    sub.bind(endpoint)
                else:
                    sub.connect(endpoint)
            except zmq.ZMQError:
                sub.close(linger=0)
                raise
            self._sub = sub
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name=f"kv-events-{self.instance_id}")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self._sub is not None:
            self._sub.close(linger=0)

    def _apply(self, seq: int, payload: bytes) -> None:
        try:
            batch = decode_batch(seq, payload)
        except KVEventDecodeError as exc:
            log.warning("instance %s: skipping KV event batch %d: %s", self.instance_id, seq, exc)
        else:
            for event in batch.events:
                if type(event) is BlockStored and event.block_size != self.block_size:
                    self.block_size = event.block_size
                    self._owner.observer_block_size(self.instance_id, event.block_size)
            self._owner.sink.apply_kv_batch(self.instance_id, batch)
            self.batches += 1
        self.last_seq = seq
        self.last_batch_at = self._owner.clock()
        self.awaiting_since = None
        self.silent = False

    async def _replay(self, start: int) -> list[tuple[int, bytes]] | None:
        """Buffered batches from `start` on, or None when the replay socket did not answer."""
        if self.replay_endpoint is None:
            return None
        dealer = self._owner.ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        try:
            dealer.connect(self.replay_endpoint)
            await dealer.send_multipart([b"", start.to_bytes(8, "big", signed=True)])
            batches: list[tuple[int, bytes]] = []
            async with asyncio.timeout(self._owner.replay_timeout_s):
                while True:
                    frames = await dealer.recv_multipart()
                    if frames and frames[0] == b"":
                        frames = frames[1:]
                    if len(frames) == 3:  # vLLM 0.32: [topic, seq, payload]
                        frames = frames[1:]
                    if len(frames) != 2 or len(frames[0]) != 8:
                        log.warning(
                            "instance %s: malformed replay reply (%d frames)",
                            self.instance_id,
                            len(frames),
                        )
                        return None
                    seq = int.from_bytes(frames[0], "big", signed=True)
                    if seq == _END_SEQ:
                        return batches
                    batches.append((seq, frames[1]))
        except TimeoutError:
            log.warning("instance %s: KV event replay timed out", self.instance_id)
            return None
        finally:
            dealer.close(linger=0)

    def _lost(self, detail: str) -> None:
        self.history_lost += 1
        log.warning(
            "instance %s: %s; its prefix view is rebuilt from what is still replayable and "
            "routing falls back to the approximate index for it",
            self.instance_id,
            detail,
        )
        self._owner.observer_history_lost(self.instance_id, detail)

    async def resync(self, lost: str | None = None) -> None:
        """Clear the instance's view and rebuild it from everything still replayable.

        `lost` says which events are known to be gone (a gap the replay could not cover)."""
        self.resyncs += 1
        self._owner.sink.clear_kv_view(self.instance_id)
        self.last_seq = -1
        batches = await self._replay(0) or []
        if batches and batches[0][0] > 0 and lost is None:
            lost = f"KV events 0..{batches[0][0] - 1} are no longer in its replay buffer"
        if lost is not None:
            self._lost(lost)
        for seq, payload in batches:
            if seq > self.last_seq:
                self._apply(seq, payload)

    async def _fill_gap(self, upto: int) -> None:
        """Replay batches last_seq+1 .. upto-1; resync when they are not all available."""
        self.gaps += 1
        start = self.last_seq + 1
        batches = await self._replay(start)
        if batches is None or not batches or batches[0][0] > start:
            if self.replay_endpoint is None:
                why = "it has no replay endpoint"
            elif batches is None:
                why = "its replay socket did not answer"
            else:
                why = "its replay buffer no longer holds them"
            await self.resync(f"KV events {start}..{upto - 1} were missed and {why}")
            return
        for seq, payload in batches:
            if self.last_seq < seq < upto:
                self._apply(seq, payload)

    async def _next(self) -> tuple[int, bytes] | None:
        if self.queue is not None:
            return await self.queue.get()
        assert self._sub is not None
        frames = await self._sub.recv_multipart()
        if len(frames) < 2 or len(frames[-2]) != 8:
            return None
        return int.from_bytes(frames[-2], "big"), frames[-1]

    async def _run(self) -> None:
        await self.resync()
        while True:
            message = await self._next()
            if message is None:
                continue
            seq, payload = message
            if seq <= self.last_seq:
                continue  # already applied through a replay
            elif seq > self.last_seq + 1:
                await self._fill_gap(seq)
                if seq <= self.last_seq:
                    continue
            self._apply(seq, payload)


class KVEventSubscriber:
    """All instances' KV event streams, feeding one sink."""

    def __init__(
        self,
        sink: KVEventSink,
        replay_timeout_s: float = 2.0,
        observer: KVStreamObserver | None = None,
        silence_warn_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.sink = sink
        self.observer = observer
        self.clock = clock
        self.ctx = zmq.asyncio.Context()
        self._streams: dict[str, _InstanceStream] = {}
        self._by_topic: dict[bytes, _InstanceStream] = {}
        self.replay_timeout_s = replay_timeout_s
        self.silence_warn_s = silence_warn_s
        self.shared_endpoint: str | None = None
        self.unclaimed_topics: dict[bytes, int] = {}
        self._shared: zmq.asyncio.Socket | None = None
        self._tasks: list[asyncio.Task[None]] = []

    # -- observer hooks ----------------------------------------------------------------------
    def observer_block_size(self, instance_id: str, block_size: int) -> None:
        if self.observer is not None:
            self.observer.kv_block_size_seen(instance_id, block_size)

    def observer_history_lost(self, instance_id: str, detail: str) -> None:
        if self.observer is not None:
            self.observer.kv_history_lost(instance_id, detail)

    # -- streams -----------------------------------------------------------------------------
    def stats(self, instance_id: str) -> dict[str, object] | None:
        stream = self._streams.get(instance_id)
        if stream is None:
            return None
        return {
            "last_seq": stream.last_seq,
            "batches": stream.batches,
            "gaps": stream.gaps,
            "resyncs": stream.resyncs,
            "history_lost": stream.history_lost,
            "block_size": stream.block_size,
            "silent": stream.silent,
        }

    async def add(
        self,
        instance_id: str,
        endpoint: str | None,
        replay_endpoint: str | None,
        *,
        bind: bool = False,
        topic: str | None = None,
    ) -> None:
        """Subscribe to an instance (re-subscribes from scratch if it was already known).

        `endpoint` None with a `topic`: the instance's messages arrive on the shared bound socket.
        Raises `zmq.ZMQError` when a `bind` endpoint cannot be bound."""
        await self.remove(instance_id)
        if endpoint is None and (topic is None or self._shared is None):
            raise ValueError("an instance without an endpoint needs a topic and bind_shared")
        stream = _InstanceStream(self, instance_id, endpoint, replay_endpoint, bind)
        self._streams[instance_id] = stream
        if endpoint is None:
            assert topic is not None
            self._by_topic[topic.encode()] = stream
        stream.start()

    async def remove(self, instance_id: str) -> None:
        stream = self._streams.pop(instance_id, None)
        if stream is not None:
            for topic, owner in list(self._by_topic.items()):
                if owner is stream:
                    del self._by_topic[topic]
            await stream.stop()

    async def bind_shared(self, endpoint: str) -> str:
        """Bind the SUB that engines connecting their PUB share; returns the bound endpoint."""
        sub = self.ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        try:
            sub.bind(endpoint)
        except zmq.ZMQError:
            sub.close(linger=0)
            raise
        self._shared = sub
        self.shared_endpoint = sub.getsockopt_string(zmq.LAST_ENDPOINT)
        self._tasks.append(asyncio.create_task(self._demux(sub), name="kv-events-shared"))
        return self.shared_endpoint

    async def _demux(self, sub: zmq.asyncio.Socket) -> None:
        while True:
            frames = await sub.recv_multipart()
            if len(frames) != 3 or len(frames[1]) != 8:
                continue
            topic, seq_bytes, payload = frames
            stream = self._by_topic.get(topic)
            if stream is None or stream.queue is None:
                seen = self.unclaimed_topics.get(topic, 0)
                if not seen:
                    log.warning(
                        "KV events on %s with topic %r, which no instance claims (add the "
                        "instance with topic=%s)",
                        self.shared_endpoint,
                        topic.decode(errors="replace"),
                        topic.decode(errors="replace"),
                    )
                self.unclaimed_topics[topic] = seen + 1
                continue
            stream.queue.put_nowait((int.from_bytes(seq_bytes, "big"), payload))

    # -- silence -----------------------------------------------------------------------------
    def note_traffic(self, instance_id: str) -> None:
        """A request that should make the instance store blocks was routed there."""
        stream = self._streams.get(instance_id)
        if stream is not None and stream.awaiting_since is None:
            stream.awaiting_since = self.clock()

    def check_silence(self) -> list[str]:
        """Warn about instances silent for `silence_warn_s` since traffic; returns them."""
        now = self.clock()
        silent = []
        for stream in self._streams.values():
            since = stream.awaiting_since
            if since is None or stream.silent or now - since < self.silence_warn_s:
                continue
            stream.silent = True
            silent.append(stream.instance_id)
            log.warning(
                "instance %s: no KV event for %.0f s although requests were routed there "
                "(check its --kv-events-config endpoint and kvherd's kv_events / bind options)",
                stream.instance_id,
                now - since,
            )
            if self.observer is not None:
                self.observer.kv_events_silent(stream.instance_id, now - since)
        return silent

    async def _watch_silence(self) -> None:
        while True:
            await asyncio.sleep(max(0.05, min(1.0, self.silence_warn_s / 4)))
            self.check_silence()

    def start(self) -> None:
        """Start the silence watch (streams start as they are added)."""
        self._tasks.append(asyncio.create_task(self._watch_silence(), name="kv-events-silence"))

    async def close(self) -> None:
        for instance_id in list(self._streams):
            await self.remove(instance_id)
        for task in self._tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks.clear()
        if self._shared is not None:
            self._shared.close(linger=0)
            self._shared = None
        self.ctx.term()
