"""The engine thread: steps the (not thread-safe) engine and feeds asyncio streams.

Contract:
- Every engine call happens on one thread. The asyncio side submits commands (add, abort, run a
  function against the engine) through a queue; the thread runs them between steps, in order.
- The thread steps while the engine has unfinished work and otherwise sleeps on a condition (no busy
  spin). After each step it hands the outputs to per-request asyncio queues with a single
  ``loop.call_soon_threadsafe`` per step, records the step latency, updates the load gauges and
  latency histograms, and publishes the step's KV event batch. Before its first command it
  publishes what the engine holds already (a warm restart's disk tier), so subscribers and the
  replay buffer have it at once.
- `add` resolves once the engine accepted the request (or raises the engine's `InvalidRequestError`,
  which it raises before allocating anything); `open` does the same for any way of starting a
  request on the engine thread (e.g. adopting a migrated one), and `call` runs any function there
  (`call_threadsafe` from another thread).
  The returned `RequestStream` yields the engine's outputs until the one with ``finished``; closing
  it early (client gone, cancellation) aborts the request on the engine thread, which frees its
  blocks. A request aborted by the agent itself (drain timeout) ends its stream with
  `RequestAborted`.
- Migration: the engine steps every schedulable request, streamed or not. Outputs of a request
  nobody streams (adopted from another instance) are buffered in a detached stream that `attach`
  hands to a follower, or that is aborted after `detached_ttl_s`. On the source, `hand_off`
  continues a client's stream from the request's new home, exactly once; `redirect` instead ends
  it with `RequestMigrated`, for a client that reattaches at the destination itself (the proxy
  marks such streams `reattach`). `RequestStream.started` is set once the stream has an output
  with tokens queued, or has ended (a P/D handoff waits for it: `instance_agent.pd_handoff`).
- If a step raises, the engine is considered dead: every open stream fails with `EngineDeadError`,
  new requests are refused, and `/health` reports it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from instance_agent.engine.core.request import SamplingParams
from instance_agent.kv_publisher import KVEventPublisher
from instance_agent.metrics import AgentMetrics
from instance_agent.state import StepLatencyWindow

if TYPE_CHECKING:
    from instance_agent.engine.llm_engine import LLMEngine, RequestOutput
    from instance_agent.tracing import AgentTracing

log = logging.getLogger(__name__)

T = TypeVar("T")


class EngineDeadError(RuntimeError):
    """The engine thread failed; the agent can no longer serve."""


class RequestAborted(RuntimeError):
    """The agent aborted the request (e.g. a drain timeout)."""


class RequestMigrated(RuntimeError):
    """The request moved to the agent at `dst_url`; its client continues the stream there."""

    def __init__(self, request_id: str, dst_url: str) -> None:
        super().__init__(f"request {request_id} migrated to {dst_url}")
        self.dst_url = dst_url


@dataclass(frozen=True, slots=True)
class _Moved:
    dst_url: str


_ABORTED = object()


@dataclass(slots=True)
class _Timing:
    arrival: float
    first_token: float | None = None
    last_token: float | None = None
    scheduled: float | None = None  # its first step in the batch (noted while tracing)


class RequestStream:
    """Outputs of one request, in order; iterate with ``async for``."""

    def __init__(self, engine_loop: EngineLoop, request_id: str) -> None:
        self.request_id = request_id
        self._engine_loop = engine_loop
        self._queue: asyncio.Queue[Any] = asyncio.Queue()
        self.finished = False
        self._closed = False
        self._relay: asyncio.Task[None] | None = None  # feeds the queue once handed off
        # Position in the whole output of the token after the last one put into this stream
        # (an adopted request's stream starts mid-way).
        self.next_index = 0
        # The client follows a migration itself (`EngineLoop.redirect`) instead of being relayed.
        self.reattach = False
        self.started = asyncio.Event()  # a token output is queued, or the stream ended

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        item = await self._queue.get()
        if item is _ABORTED:
            self.finished = True
            self.close()
            raise RequestAborted(f"request {self.request_id} was aborted by the agent")
        if isinstance(item, _Moved):
            self.finished = True
            self.close()
            raise RequestMigrated(self.request_id, item.dst_url)
        if isinstance(item, BaseException):
            self.finished = True
            self.close()
            raise item
        if item.finished:
            self.finished = True
            self.close()
        return item

    async def batches(self) -> AsyncIterator[list[RequestOutput]]:
        """Like iterating, but yields every output already queued at once (at least one)."""
        while not self.finished:
            try:
                batch = [await self.__anext__()]
            except StopAsyncIteration:
                return
            while not self.finished and not self._queue.empty():
                try:
                    batch.append(await self.__anext__())  # queued already: no waiting
                except (RequestAborted, RequestMigrated, EngineDeadError):
                    yield batch  # what came before the failure still reaches the client
                    raise
            yield batch

    def _put(self, item: Any, index: int | None = None) -> None:
        """Queue an output (`index`: its first token's position, if not the engine's own)."""
        if item is not _ABORTED and not isinstance(item, (BaseException, _Moved)):
            if index is None:
                index = len(item.output_token_ids) - len(item.new_token_ids)
            self.next_index = index + len(item.new_token_ids)
            if item.new_token_ids or item.finished:
                self.started.set()
        else:
            self.started.set()
        self._queue.put_nowait(item)

    def close(self) -> None:
        """Stop listening; aborts the request if the engine has not finished it (idempotent)."""
        if self._closed:
            return
        self._closed = True
        self.started.set()
        if self._relay is not None:
            self._relay.cancel()  # the client left: stop following the request elsewhere
        self._engine_loop._stream_closed(self)


class EngineLoop:
    def __init__(
        self,
        engine: LLMEngine,
        *,
        publisher: KVEventPublisher | None = None,
        metrics: AgentMetrics | None = None,
        step_latency: StepLatencyWindow | None = None,
        detached_ttl_s: float = 30.0,
    ) -> None:
        self.engine = engine
        self.detached_ttl_s = detached_ttl_s
        self.publisher = publisher
        self.metrics = metrics
        self.step_latency = step_latency or StepLatencyWindow()
        self.last_kv_event_seq = -1
        self.dead: BaseException | None = None
        self._cond = threading.Condition()
        self._commands: deque[Callable[[], None]] = deque()
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        # Engine-thread state.
        self._streams: dict[str, RequestStream] = {}
        self._timings: dict[str, _Timing] = {}
        self.tracing: AgentTracing | None = None  # spans of each request's life here, when on
        self._seen_queries = 0
        self._seen_hits = 0
        self._seen_preemptions = 0
        # asyncio-side state.
        self._open: set[RequestStream] = set()
        self._idle: asyncio.Event | None = None
        self._detached: dict[str, RequestStream] = {}
        self._detached_expiry: dict[str, asyncio.TimerHandle] = {}
        self._attach_waiters: dict[str, list[asyncio.Future[None]]] = {}

    # -- lifecycle -------------------------------------------------------------------------------
    def start(self) -> None:
        """Start the engine thread; call from the event loop that will consume the streams."""
        self._loop = asyncio.get_running_loop()
        self._idle = asyncio.Event()
        self._idle.set()
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Abort whatever is left, publish the last events and join the engine thread."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def num_open_requests(self) -> int:
        return len(self._open)

    async def wait_idle(self) -> None:
        """Return once no request is open (used by the SIGTERM drain)."""
        assert self._idle is not None
        await self._idle.wait()

    # -- asyncio-side API ------------------------------------------------------------------------
    async def add(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        *,
        priority: int = 0,
        cache_salt: str | None = None,
    ) -> RequestStream:
        """Submit a request; raises `InvalidRequestError` if the engine refuses it."""

        def start(engine: LLMEngine) -> None:
            engine.add_request(request_id, prompt, params, priority=priority, cache_salt=cache_salt)

        return await self.open(request_id, start)

    async def open(self, request_id: str, start: Callable[[LLMEngine], object]) -> RequestStream:
        """Run `start(engine)` on the engine thread and stream `request_id`'s outputs from then on.

        `start` puts the request into the engine (``add_request``, or ``adopt_request`` for a
        migrated-in request); no output can slip between it and the stream's registration. An
        exception from `start` is raised here and leaves nothing behind.
        """
        if self.dead is not None:
            raise EngineDeadError(f"engine failed: {self.dead!r}")
        stream = RequestStream(self, request_id)
        loop = asyncio.get_running_loop()
        accepted: asyncio.Future[None] = loop.create_future()
        arrival = time.monotonic()

        def command() -> None:
            try:
                start(self.engine)
            except BaseException as exc:  # handed to the caller: the engine's own refusal
                loop.call_soon_threadsafe(_settle, accepted, exc)
                return
            self._streams[request_id] = stream
            self._timings[request_id] = _Timing(arrival)
            loop.call_soon_threadsafe(_settle, accepted, None)

        self._open.add(stream)
        assert self._idle is not None
        self._idle.clear()
        self._submit(command)
        try:
            await accepted
        except BaseException:
            # Refused, or the caller was cancelled while waiting: make sure nothing is left behind.
            stream.close()
            raise
        return stream

    async def attach(self, request_id: str, timeout: float = 5.0) -> RequestStream | None:
        """Take the stream of a request nobody listens to yet (one adopted by a migration).

        Outputs of a request the engine runs without a stream (e.g. adopted from another
        instance) are buffered in a detached stream until someone attaches, or aborted after
        `detached_ttl_s`. Waits up to `timeout` for the request's first output; None if none.
        """
        deadline = time.monotonic() + timeout
        while request_id not in self._detached:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            waiter = asyncio.get_running_loop().create_future()
            self._attach_waiters.setdefault(request_id, []).append(waiter)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(waiter, remaining)
        stream = self._detached.pop(request_id)
        self._detached_expiry.pop(request_id).cancel()
        return stream

    def hand_off(self, request_id: str, outputs: AsyncIterator[tuple[int, RequestOutput]]) -> None:
        """Continue `request_id`'s open stream from `outputs` (the request moved elsewhere).

        Call after the engine let go of the request (``release_migrated``): its outputs so far
        are already in the stream. `outputs` yields ``(index, output)`` with `index` the
        position of the output's first new token; tokens the client already has are skipped,
        so every token reaches it exactly once. Closing the stream cancels the relay.
        """
        stream = self._released_stream(request_id)
        stream._relay = asyncio.ensure_future(self._relay(stream, outputs))

    def redirect(self, request_id: str, dst_url: str) -> None:
        """End `request_id`'s open stream with `RequestMigrated(dst_url)` (after the release,
        like `hand_off`): its client reattaches to the request at `dst_url` itself."""
        self._released_stream(request_id)._put(_Moved(dst_url))

    def stream_of(self, request_id: str) -> RequestStream | None:
        """The open stream of `request_id`, if anyone listens to it."""
        return next((s for s in self._open if s.request_id == request_id and not s._closed), None)

    def _released_stream(self, request_id: str) -> RequestStream:
        stream = self.stream_of(request_id)
        if stream is None:
            raise KeyError(f"no open stream for request {request_id!r}")

        def forget() -> None:
            if self._streams.get(request_id) is stream:
                del self._streams[request_id]
                self._timings.pop(request_id, None)

        self._submit(forget)
        return stream

    async def _relay(
        self, stream: RequestStream, outputs: AsyncIterator[tuple[int, RequestOutput]]
    ) -> None:
        try:
            async for index, output in outputs:
                # Decode outputs carry one token each, so an output is either new or a repeat.
                if index + len(output.new_token_ids) <= stream.next_index and not output.finished:
                    continue
                stream._put(output, index)
                if output.finished:
                    return
            stream._put(RequestAborted(f"request {stream.request_id} ended without finishing"))
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the other instance failed: end the client's stream clearly
            log.warning("relay of %s failed: %r", stream.request_id, exc)
            stream._put(RequestAborted(f"request {stream.request_id} was lost in transit: {exc}"))

    def abort(self, request_id: str) -> None:
        """Abort a request from any thread; its stream ends with `RequestAborted`."""
        self._submit(lambda: self._abort_on_engine(request_id, notify=True))

    def abort_all(self) -> None:
        """Abort every open request (drain timeout); their streams end with `RequestAborted`."""

        def command() -> None:
            for request_id in list(self._streams):
                self._abort_on_engine(request_id, notify=True)

        self._submit(command)

    async def call(self, fn: Callable[[LLMEngine], T]) -> T:
        """Run `fn(engine)` on the engine thread between steps and return its result."""
        loop = asyncio.get_running_loop()
        result: asyncio.Future[T] = loop.create_future()

        def command() -> None:
            try:
                value = fn(self.engine)
            except BaseException as exc:
                loop.call_soon_threadsafe(_settle, result, exc)
                return
            loop.call_soon_threadsafe(_settle_value, result, value)

        self._submit(command)
        return await result

    def call_threadsafe(self, fn: Callable[[LLMEngine], T], timeout: float) -> T:
        """`call` from a thread of its own (not the engine's, nor the event loop's); raises
        TimeoutError when the engine thread did not run it within `timeout`."""
        result: Future[T] = Future()

        def command() -> None:
            try:
                result.set_result(fn(self.engine))
            except BaseException as exc:
                result.set_exception(exc)

        self._submit(command)
        return result.result(timeout)

    def _announce_detached(self, streams: list[RequestStream]) -> None:
        assert self._loop is not None and self._idle is not None
        for stream in streams:
            rid = stream.request_id
            self._open.add(stream)
            self._idle.clear()
            self._detached[rid] = stream
            self._detached_expiry[rid] = self._loop.call_later(
                self.detached_ttl_s, self._expire_detached, stream
            )
            for waiter in self._attach_waiters.pop(rid, []):
                if not waiter.done():
                    waiter.set_result(None)

    def _expire_detached(self, stream: RequestStream) -> None:
        if self._detached.get(stream.request_id) is stream:
            log.warning("nobody attached to %s; aborting it", stream.request_id)
            del self._detached[stream.request_id]
            del self._detached_expiry[stream.request_id]
            stream.close()

    def _stream_closed(self, stream: RequestStream) -> None:
        self._open.discard(stream)
        if not self._open and self._idle is not None:
            self._idle.set()
        if not stream.finished:
            rid = stream.request_id
            self._submit(lambda: self._abort_on_engine(rid, notify=False, owner=stream))

    def _submit(self, command: Callable[[], None]) -> None:
        with self._cond:
            self._commands.append(command)
            self._cond.notify()

    # -- engine thread ---------------------------------------------------------------------------
    def _abort_on_engine(
        self, request_id: str, *, notify: bool, owner: RequestStream | None = None
    ) -> None:
        stream = self._streams.get(request_id)
        if stream is None or (owner is not None and stream is not owner):
            return  # already finished, or the id now belongs to a newer request
        self.engine.abort(request_id)
        del self._streams[request_id]
        self._timings.pop(request_id, None)
        if self.tracing is not None:
            self.tracing.forget(request_id)
        if self.metrics is not None:
            self.metrics.request_finished("abort")
        if notify:
            self._deliver_threadsafe([(stream, _ABORTED)])

    def _run(self) -> None:
        engine = self.engine
        self._after_step()  # a warm restart's restored blocks: announced before any request
        while True:
            with self._cond:
                while not self._commands and not self._stopping and not self._has_work():
                    self._cond.wait()
                commands = list(self._commands)
                self._commands.clear()
                stopping = self._stopping
            for command in commands:
                try:
                    command()
                except Exception:  # a command must never take the engine thread down
                    log.exception("engine command failed")
            if stopping:
                for request_id in list(self._streams):
                    self._abort_on_engine(request_id, notify=True)
                self._after_step()
                return
            if self._has_work():
                step_at = time.monotonic()
                started = time.perf_counter()
                try:
                    outputs = engine.step()
                except Exception as exc:
                    log.exception("engine step failed; the engine is dead")
                    self._fail_all(exc)
                    continue
                self.step_latency.record(time.perf_counter() - started)
                if self.tracing is not None:
                    self._note_scheduled(step_at)
                self._dispatch(outputs)
            self._after_step()

    def _note_scheduled(self, step_at: float) -> None:
        """The requests in this step's batch for the first time were scheduled at `step_at`."""
        timings = self._timings
        for request in self.engine.scheduler.running:
            timing = timings.get(request.request_id)
            if timing is not None and timing.scheduled is None:
                timing.scheduled = step_at

    def _has_work(self) -> bool:
        # Suspended requests (mid-migration) are unfinished but not schedulable: no work then,
        # or the thread would spin on empty steps.
        scheduler = self.engine.scheduler
        return self.dead is None and (scheduler.num_running > 0 or scheduler.num_waiting > 0)

    def _fail_all(self, exc: BaseException) -> None:
        self.dead = exc
        error = EngineDeadError(f"engine failed: {exc!r}")
        items = [(stream, error) for stream in self._streams.values()]
        self._streams.clear()
        self._timings.clear()
        self._deliver_threadsafe(items)

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        now = time.monotonic()
        metrics = self.metrics
        items: list[tuple[RequestStream, Any]] = []
        detached: list[RequestStream] = []
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is None:
                # Running without a stream (adopted from another instance): buffer its outputs
                # until someone attaches.
                stream = RequestStream(self, output.request_id)
                self._streams[output.request_id] = stream
                # Its first token was counted where the request started (no TTFT here).
                self._timings[output.request_id] = _Timing(now, first_token=now)
                detached.append(stream)
            items.append((stream, output))
            timing = self._timings.get(output.request_id)
            if metrics is not None and timing is not None and output.new_token_ids:
                if timing.first_token is None:
                    timing.first_token = now
                    metrics.time_to_first_token.observe(now - timing.arrival)
                    metrics.prompt_tokens.inc(output.num_prompt_tokens)
                elif timing.last_token is not None:
                    metrics.inter_token_latency.observe(now - timing.last_token)
                timing.last_token = now
                metrics.generation_tokens.inc(len(output.new_token_ids))
            if output.finished:
                del self._streams[output.request_id]
                self._timings.pop(output.request_id, None)
                if metrics is not None and timing is not None:
                    metrics.e2e_request_latency.observe(now - timing.arrival)
                    metrics.request_finished(output.finish_reason or "stop")
                if self.tracing is not None and timing is not None:
                    self._traced(output, timing, now)
        if detached:
            assert self._loop is not None
            with contextlib.suppress(RuntimeError):  # closed loop: nobody listens any more
                self._loop.call_soon_threadsafe(self._announce_detached, detached)
        if items:
            self._deliver_threadsafe(items)

    def _traced(self, output: RequestOutput, timing: _Timing, now: float) -> None:
        assert self.tracing is not None
        self.tracing.finished(
            output.request_id, timing.arrival, timing.scheduled, timing.first_token, now,
            {
                "kvherd.prompt_tokens": output.num_prompt_tokens,
                "kvherd.cached_tokens": output.num_cached_tokens,
                "kvherd.output_tokens": len(output.output_token_ids),
                "kvherd.finish_reason": output.finish_reason or "",
            },
        )  # fmt: skip

    def _after_step(self) -> None:
        batch = self.engine.take_kv_event_batch()
        if batch is not None:
            if self.publisher is not None:
                self.publisher.publish(batch)
            self.last_kv_event_seq = batch.seq
        metrics = self.metrics
        if metrics is None:
            return
        scheduler = self.engine.scheduler
        block_manager = self.engine.block_manager
        metrics.set_load(scheduler.num_running, scheduler.num_waiting, block_manager.usage)
        # The scheduler keeps cumulative counters; Prometheus counters take the increments.
        metrics.prefix_cache_queries.inc(scheduler.prefix_cache_queries - self._seen_queries)
        metrics.prefix_cache_hits.inc(scheduler.prefix_cache_hits - self._seen_hits)
        metrics.num_preemptions.inc(scheduler.num_preemptions - self._seen_preemptions)
        self._seen_queries = scheduler.prefix_cache_queries
        self._seen_hits = scheduler.prefix_cache_hits
        self._seen_preemptions = scheduler.num_preemptions
        metrics.set_tiers(self.engine.tier_usage())

    def _deliver_threadsafe(self, items: list[tuple[RequestStream, Any]]) -> None:
        assert self._loop is not None
        # RuntimeError: the event loop is closed, so nobody is listening any more.
        with contextlib.suppress(RuntimeError):
            self._loop.call_soon_threadsafe(_deliver, items)


def _deliver(items: list[tuple[RequestStream, Any]]) -> None:
    for stream, item in items:
        stream._put(item)


def _settle(future: asyncio.Future[Any], exc: BaseException | None) -> None:
    if future.done():
        return
    if exc is None:
        future.set_result(None)
    else:
        future.set_exception(exc)


def _settle_value(future: asyncio.Future[Any], value: Any) -> None:
    if not future.done():
        future.set_result(value)
