"""Continuous-batching scheduler: which requests run in the next engine step, and how many tokens each.

Contract (vLLM v1's unified token-budget design):
- One step schedules at most `max_num_batched_tokens` tokens across at most `max_num_seqs` running
  requests. Running requests come first (a decode costs one token; an unfinished prefill continues),
  then waiting requests in (priority, arrival) order — FCFS with a priority field, lower value first.
- Chunked prefill: a prompt longer than the remaining budget is computed over several steps.
- Prefix-cache hits skip already computed tokens (`BlockManager.get_computed_blocks`).
- When blocks run out, the lowest-priority, newest running request not yet scheduled this step is
  preempted by recompute: its blocks are freed and it waits again, first among its peers; its
  tokens so far (prompt and output) are recomputed when it is resumed. No new request is admitted in a
  step that preempted.
- `update_from_output` advances progress, appends sampled tokens, caches full blocks, applies
  token-level stop conditions and frees finished requests' blocks.
- One execution path: a step is `schedule` + `update_from_output`, nothing else. Each step gets
  the next step id (`num_steps`); a driver that applies steps itself through this public API (the
  simulator's decode fast-forward) counts them with `record_steps`.
- `num_waiting_tokens` (the queued work a load report names) is kept as requests join and leave
  the waiting queue, O(1) to read; `running_prefill_tokens` sums the rest of the running requests
  still in prefill (admitted, not yet sampled: a prompt in chunked prefill), kept as a small set.
- Migration support: a request can be suspended (kept with its blocks, not scheduled), resumed,
  released (it left for another instance), or adopted with blocks already filled. A request held
  at its first token (`hold_at_first_token`: a P/D handoff out of a prefill-only instance) is
  suspended by the very `update_from_output` that samples it (unless that token ends it), so it
  never decodes here; suspended requests are in no step's batch.
- KV tiers (a block manager with `tiers`): a waiting request whose prefix continues on a lower tier
  is admitted as a load (vLLM's WAITING_FOR_REMOTE_KVS): it gets its blocks, the step's output lists
  the copies (`SchedulerOutput.loads`, `KVLoad`), and it is status `WAITING_FOR_KV`, in no batch,
  while the others keep stepping. The driver runs the copies, after the step's offloads
  (`BlockManager.take_offloads`), and reports every load it started with `finish_load` (ok or
  not) whatever became of the request: the request then runs with the loaded tokens computed, or
  after a failed copy waits again at its place to be recomputed; one aborted meanwhile keeps its
  blocks until then (the copy may still be writing them). A load counts toward `max_num_seqs`,
  `num_waiting` and the request's `num_cached_tokens` (hits from any tier).
The scheduler is pure Python: the engine drives it with a model, the simulator with a latency model.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from dataclasses import dataclass, field

from sortedcontainers import SortedList

from instance_agent.engine.core.block_manager import BlockManager
from instance_agent.engine.core.request import (
    REQUEST_ID_IN_USE,
    InvalidRequestError,
    Request,
    RequestStatus,
)
from instance_agent.engine.core.tiers import BlockCopy


@dataclass(slots=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int = 2048
    enable_chunked_prefill: bool = True

    def validate(self) -> None:
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1 or self.max_model_len < 2:
            raise ValueError("max_num_seqs, max_num_batched_tokens >= 1 and max_model_len >= 2")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                "without chunked prefill, max_num_batched_tokens must be >= max_model_len"
            )


@dataclass(slots=True)
class ScheduledRequest:
    request: Request
    num_new_tokens: int
    num_computed_before: int
    block_ids: list[int]
    samples: bool  # the chunk reaches the last known token: sample the next one

    @property
    def is_prefill(self) -> bool:
        return self.num_new_tokens > 1 or not self.request.output_token_ids


@dataclass(frozen=True, slots=True)
class KVLoad:
    """A request's prefix blocks to copy from lower tiers into its GPU blocks before it runs."""

    request_id: str
    copies: list[BlockCopy]
    num_tokens: int  # tokens the copies bring (they skip the prefill)


@dataclass(slots=True)
class SchedulerOutput:
    step_id: int
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    num_batched_tokens: int = 0
    loads: list[KVLoad] = field(default_factory=list)  # started this step

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class BatchScheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager) -> None:
        config.validate()
        self.config = config
        self.block_manager = block_manager
        self.running: list[Request] = []
        self.waiting: SortedList = SortedList(key=self._queue_key)
        # Tokens the waiting requests still have to compute, kept as they join and leave the
        # queue (a load report reads it every interval; a queue can hold thousands).
        self._waiting_tokens = 0
        # Running requests still in prefill (admitted, no token sampled since), by id.
        self._prefilling: dict[str, Request] = {}
        self.suspended: dict[str, Request] = {}
        # Loads in flight, by id: the request, the tokens computed once loaded, its GPU hit.
        self._loading: dict[str, tuple[Request, int, int]] = {}
        self._hold_at_first_token: set[str] = set()  # ids to suspend once they sample
        self.requests: dict[str, Request] = {}  # every unfinished request, by id
        self._admission_seq: dict[str, int] = {}
        self._seq = itertools.count()
        self._num_steps = 0  # the next step's id
        # Counters read by metrics (tokens, like vLLM's prefix_cache_queries/hits).
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self.num_preemptions = 0

    def _queue_key(self, request: Request) -> tuple[int, float, int]:
        return (request.priority, request.arrival_time, self._admission_seq[request.request_id])

    # -- queue management --------------------------------------------------------------------
    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting) + len(self._loading)

    @property
    def num_loading(self) -> int:
        """Requests whose KV loads from a lower tier (ended ones included until reported)."""
        return len(self._loading)

    @property
    def num_waiting_tokens(self) -> int:
        """Tokens the waiting requests still have to compute: prompts, or a preempted request's
        whole sequence (its recompute). A waiting request does not grow, so this is kept as
        requests join and leave the queue, not summed on every read."""
        return self._waiting_tokens

    @property
    def running_prefill_tokens(self) -> int:
        """Tokens the running requests still in prefill have left to compute (a long prompt in
        chunked prefill runs for several steps); 0 when every running request decodes."""
        prefilling = self._prefilling
        if not prefilling:  # (the usual case: read once per instance per load report)
            return 0
        return sum([len(r.token_ids) - r.num_computed_tokens for r in prefilling.values()])

    def _enqueue(self, request: Request) -> None:
        self.waiting.add(request)
        self._waiting_tokens += request.num_tokens - request.num_computed_tokens

    def _dequeued(self, request: Request) -> None:
        self._waiting_tokens -= request.num_tokens - request.num_computed_tokens

    @property
    def num_steps(self) -> int:
        """Steps so far (`schedule` calls and `record_steps`): the id the next step gets."""
        return self._num_steps

    def record_steps(self, count: int) -> None:
        """Count `count` steps a driver applied through this API without calling `schedule` (the
        simulator's decode fast-forward), so the step ids that follow are those of stepping."""
        if count < 0:
            raise ValueError("count must be >= 0")
        self._num_steps += count

    def has_unfinished(self) -> bool:
        return bool(self.requests or self._loading)

    def blocks_for_full_length(self, request: Request) -> int:
        """Blocks the request holds when it reaches its maximum length."""
        max_len = min(
            request.num_prompt_tokens + request.sampling_params.max_tokens,
            self.config.max_model_len,
        )
        return self.block_manager.blocks_needed(max_len)

    def add_request(self, request: Request) -> None:
        """Queue a request. Refuses, before any block is allocated, one that could never fit."""
        if request.request_id in self.requests:
            raise InvalidRequestError(
                f"request id {request.request_id!r} is already in use",
                "X-Request-Id",
                REQUEST_ID_IN_USE,
            )
        if request.num_prompt_tokens == 0:
            raise InvalidRequestError("the prompt must contain at least one token", "prompt")
        if request.num_prompt_tokens >= self.config.max_model_len:
            raise InvalidRequestError(
                f"prompt has {request.num_prompt_tokens} tokens; the maximum context length is "
                f"{self.config.max_model_len}",
                "prompt",
                "context_length_exceeded",
            )
        capacity = self.block_manager.num_blocks - self.block_manager.watermark_blocks
        if self.blocks_for_full_length(request) > capacity:
            raise InvalidRequestError(
                f"request needs {self.blocks_for_full_length(request)} KV blocks at full length "
                f"but the instance has {capacity}",
                "max_tokens",
            )
        self._admission_seq[request.request_id] = next(self._seq)
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        self._enqueue(request)

    def finish_request(self, request_id: str, status: RequestStatus) -> Request | None:
        """End a request with `status` (abort, stop string, migrated away) and free its blocks."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        loading = request.status is RequestStatus.WAITING_FOR_KV
        if request in self.running:
            self.running.remove(request)
            self._prefilling.pop(request_id, None)
        elif request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
            self.waiting.remove(request)
            self._dequeued(request)
        self.suspended.pop(request_id, None)
        self._hold_at_first_token.discard(request_id)
        self._admission_seq.pop(request_id, None)
        request.status = status
        request.finish_reason = status.finish_reason
        if not loading:  # (a load in flight may still write its blocks: `finish_load` frees)
            self.block_manager.free(request)
        return request

    def abort_request(self, request_id: str) -> Request | None:
        return self.finish_request(request_id, RequestStatus.FINISHED_ABORTED)

    # -- migration support -------------------------------------------------------------------
    def hold_at_first_token(self, request_id: str) -> None:
        """Suspend the request in the step that samples its next token (see the contract)."""
        if request_id not in self.requests:
            raise KeyError(request_id)
        self._hold_at_first_token.add(request_id)

    def cancel_hold(self, request_id: str) -> None:
        """Let the request decode here after all (its handoff failed before its first token)."""
        self._hold_at_first_token.discard(request_id)

    def suspend(self, request_id: str) -> Request:
        """Stop scheduling a running request; it keeps its blocks and state."""
        request = self.requests[request_id]
        if request not in self.running:
            raise ValueError(f"request {request_id!r} is not running")
        self.running.remove(request)
        self._prefilling.pop(request_id, None)
        request.status = RequestStatus.SUSPENDED
        self.suspended[request_id] = request
        return request

    def resume(self, request_id: str) -> Request:
        request = self.suspended.pop(request_id)
        request.status = RequestStatus.RUNNING
        self.running.append(request)
        if request.is_prefill:
            self._prefilling[request_id] = request
        return request

    def adopt(self, request: Request) -> None:
        """Join a request whose blocks are already filled (a committed migration) to the batch.

        The block manager must already list its blocks under `request.request_id`, covering
        `request.num_computed_tokens` tokens.
        """
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        self._admission_seq[request.request_id] = next(self._seq)
        request.status = RequestStatus.RUNNING
        self.requests[request.request_id] = request
        self.running.append(request)
        if request.is_prefill:
            self._prefilling[request.request_id] = request
        self.block_manager.cache_full_blocks(request)

    # -- scheduling --------------------------------------------------------------------------
    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self._prefilling.pop(request.request_id, None)
        self.block_manager.free(request)
        request.num_computed_tokens = 0
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        self.num_preemptions += 1
        self._enqueue(request)

    def schedule(self) -> SchedulerOutput:
        cfg = self.config
        bm = self.block_manager
        output = SchedulerOutput(step_id=self._num_steps)
        self._num_steps += 1
        budget = cfg.max_num_batched_tokens

        # 1. Running requests, in admission order; preempt from the back when blocks run out.
        running = self.running
        scheduled = output.scheduled
        tables = bm.block_tables
        slots_per_block = bm.block_size
        index = 0
        while index < len(running) and budget > 0:
            request = running[index]
            computed = request.num_computed_tokens
            num_new = len(request.token_ids) - computed
            if num_new > budget:  # (not min(): this runs for every running request per step)
                num_new = budget
            if num_new <= 0:  # nothing to compute (cannot happen for a healthy request)
                index += 1
                continue
            table = tables.get(request.request_id)
            if table is not None and computed + num_new <= len(table) * slots_per_block:
                # The common decode step: its slot is in the last block, nothing to allocate.
                scheduled.append(
                    ScheduledRequest(
                        request,
                        num_new,
                        computed,
                        table,
                        computed + num_new == len(request.token_ids),
                    )
                )
                budget -= num_new
                index += 1
                continue
            while not bm.allocate_slots(request, num_new):
                victim = max(running[index:], key=self._queue_key)
                self._preempt(victim)
                output.preempted.append(victim)
                if victim is request:
                    break
            else:
                scheduled.append(self._scheduled(request, num_new))
                budget -= num_new
                index += 1

        # 2. Waiting requests, head of line first; stop at the first that does not fit.
        if not output.preempted:
            loading = self._loading
            while (
                self.waiting and budget > 0 and len(self.running) + len(loading) < cfg.max_num_seqs
            ):
                request = self.waiting[0]
                computed_blocks, num_hit = bm.get_computed_blocks(request)
                tier_hits = (
                    bm.lower_tier_hits(request, len(computed_blocks))
                    if bm.tiers is not None
                    else ()
                )
                num_loaded = len(tier_hits) * slots_per_block
                num_new = request.num_tokens - num_hit - num_loaded
                if not cfg.enable_chunked_prefill and num_new > budget:
                    break
                num_new = min(num_new, budget)
                if tier_hits:
                    copies = bm.start_load(
                        request, computed_blocks, tier_hits, num_new, respect_watermark=True
                    )
                    if copies is None:
                        break
                    self.waiting.pop(0)
                    self._dequeued(request)
                    self._count_hit(request, num_hit + num_loaded)
                    request.status = RequestStatus.WAITING_FOR_KV
                    loading[request.request_id] = (request, num_hit + num_loaded, num_hit)
                    output.loads.append(KVLoad(request.request_id, copies, num_loaded))
                    continue  # it computes nothing this step: no budget spent
                if not bm.allocate_slots(request, num_new, computed_blocks, respect_watermark=True):
                    break
                self.waiting.pop(0)
                self._dequeued(request)
                request.num_computed_tokens = num_hit
                self._count_hit(request, num_hit)
                request.status = RequestStatus.RUNNING
                self.running.append(request)
                self._prefilling[request.request_id] = request
                output.scheduled.append(self._scheduled(request, num_new))
                budget -= num_new

        output.num_batched_tokens = cfg.max_num_batched_tokens - budget
        return output

    def _count_hit(self, request: Request, num_hit: int) -> None:
        if request.num_cached_tokens < 0:  # first admission only (not after a preemption)
            request.num_cached_tokens = num_hit
            self.prefix_cache_queries += request.num_tokens
            self.prefix_cache_hits += num_hit

    def finish_load(self, request_id: str, ok: bool = True) -> None:
        """The driver ran (`ok`) or failed to run a `KVLoad` this scheduler started."""
        request, num_computed, num_hit = self._loading.pop(request_id)
        bm = self.block_manager
        if request.status is not RequestStatus.WAITING_FOR_KV:  # ended while loading
            bm.finish_load(request, "abandoned")
            bm.free(request)
            return
        if not ok:  # recompute instead: wait again at its place in the queue, with no blocks
            bm.finish_load(request, "failed")
            bm.free(request)
            if request.num_cached_tokens == num_computed:
                self.prefix_cache_hits -= num_computed - num_hit
                request.num_cached_tokens = num_hit
            request.status = RequestStatus.WAITING
            self._enqueue(request)
            return
        request.num_computed_tokens = num_computed
        bm.finish_load(request, "loaded")
        request.status = RequestStatus.RUNNING
        self.running.append(request)
        self._prefilling[request_id] = request

    def _scheduled(self, request: Request, num_new: int) -> ScheduledRequest:
        start = request.num_computed_tokens
        return ScheduledRequest(
            request=request,
            num_new_tokens=num_new,
            num_computed_before=start,
            block_ids=self.block_manager.block_ids(request.request_id),
            samples=start + num_new == request.num_tokens,
        )

    def update_from_output(
        self, output: SchedulerOutput, sampled: Mapping[str, int]
    ) -> list[Request]:
        """Apply a step's results; returns the requests that finished in it."""
        finished: list[Request] = []
        bs = self.block_manager.block_size
        cache_full_blocks = self.block_manager.cache_full_blocks
        max_model_len = self.config.max_model_len
        running_status = RequestStatus.RUNNING
        prefilling = self._prefilling
        holds = self._hold_at_first_token
        for item in output.scheduled:
            request = item.request
            if request.status is not running_status:
                continue  # aborted, suspended or preempted after the step was planned
            before = item.num_computed_before
            if request.num_computed_tokens != before:
                continue  # preempted and re-admitted since: this result is stale
            computed = request.num_computed_tokens = before + item.num_new_tokens
            if item.samples:
                request.append_output_token(sampled[request.request_id])
                if prefilling:  # (empty through the usual decode steps)
                    prefilling.pop(request.request_id, None)
            # Only a step that fills a block can cache one: blocks full before it were handled
            # by earlier steps or came as prefix hits (most decode steps fill none).
            if computed // bs != before // bs:
                cache_full_blocks(request)
            if item.samples:
                stop = request.check_stop(max_model_len)
                if stop is not None:
                    done = self.finish_request(request.request_id, stop)
                    assert done is not None
                    finished.append(done)
                elif holds and request.request_id in holds:
                    holds.discard(request.request_id)
                    self.suspend(request.request_id)
        return finished
