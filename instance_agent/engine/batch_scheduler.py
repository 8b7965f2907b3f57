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
- Migration support: a request can be suspended (kept with its blocks, not scheduled), resumed,
  released (it left for another instance), or adopted with blocks already filled.
The scheduler is pure Python: the engine drives it with a model, the simulator with a latency model.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from dataclasses import dataclass, field

from sortedcontainers import SortedList

from instance_agent.engine.block_manager import BlockManager
from instance_agent.engine.request import InvalidRequestError, Request, RequestStatus


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


@dataclass(slots=True)
class SchedulerOutput:
    step_id: int
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    num_batched_tokens: int = 0

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
        self.suspended: dict[str, Request] = {}
        self.requests: dict[str, Request] = {}  # every unfinished request, by id
        self._admission_seq: dict[str, int] = {}
        self._seq = itertools.count()
        self._step_ids = itertools.count()
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
        return len(self.waiting)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

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
            raise InvalidRequestError(f"request id {request.request_id!r} is already in use")
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
        self.waiting.add(request)

    def finish_request(self, request_id: str, status: RequestStatus) -> Request | None:
        """End a request with `status` (abort, stop string, migrated away) and free its blocks."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        if request in self.running:
            self.running.remove(request)
        elif request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
            self.waiting.remove(request)
        self.suspended.pop(request_id, None)
        self._admission_seq.pop(request_id, None)
        request.status = status
        request.finish_reason = status.finish_reason
        self.block_manager.free(request)
        return request

    def abort_request(self, request_id: str) -> Request | None:
        return self.finish_request(request_id, RequestStatus.FINISHED_ABORTED)

    # -- migration support -------------------------------------------------------------------
    def suspend(self, request_id: str) -> Request:
        """Stop scheduling a running request; it keeps its blocks and state."""
        request = self.requests[request_id]
        if request not in self.running:
            raise ValueError(f"request {request_id!r} is not running")
        self.running.remove(request)
        request.status = RequestStatus.SUSPENDED
        self.suspended[request_id] = request
        return request

    def resume(self, request_id: str) -> Request:
        request = self.suspended.pop(request_id)
        request.status = RequestStatus.RUNNING
        self.running.append(request)
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
        self.block_manager.cache_full_blocks(request)

    # -- scheduling --------------------------------------------------------------------------
    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.block_manager.free(request)
        request.num_computed_tokens = 0
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.add(request)

    def schedule(self) -> SchedulerOutput:
        cfg = self.config
        bm = self.block_manager
        output = SchedulerOutput(step_id=next(self._step_ids))
        budget = cfg.max_num_batched_tokens

        # 1. Running requests, in admission order; preempt from the back when blocks run out.
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            if num_new <= 0:  # nothing to compute (cannot happen for a healthy request)
                index += 1
                continue
            while not bm.allocate_slots(request, num_new):
                victim = max(self.running[index:], key=self._queue_key)
                self._preempt(victim)
                output.preempted.append(victim)
                if victim is request:
                    break
            else:
                output.scheduled.append(self._scheduled(request, num_new))
                budget -= num_new
                index += 1

        # 2. Waiting requests, head of line first; stop at the first that does not fit.
        if not output.preempted:
            while self.waiting and budget > 0 and len(self.running) < cfg.max_num_seqs:
                request = self.waiting[0]
                computed_blocks, num_hit = bm.get_computed_blocks(request)
                num_new = request.num_tokens - num_hit
                if not cfg.enable_chunked_prefill and num_new > budget:
                    break
                num_new = min(num_new, budget)
                if not bm.allocate_slots(request, num_new, computed_blocks, respect_watermark=True):
                    break
                self.waiting.pop(0)
                request.num_computed_tokens = num_hit
                if request.num_cached_tokens < 0:
                    request.num_cached_tokens = num_hit
                    self.prefix_cache_queries += request.num_tokens
                    self.prefix_cache_hits += num_hit
                request.status = RequestStatus.RUNNING
                self.running.append(request)
                output.scheduled.append(self._scheduled(request, num_new))
                budget -= num_new

        output.num_batched_tokens = cfg.max_num_batched_tokens - budget
        return output

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
        for item in output.scheduled:
            request = item.request
            if request.status is not RequestStatus.RUNNING:
                continue  # aborted, suspended or preempted after the step was planned
            if request.num_computed_tokens != item.num_computed_before:
                continue  # preempted and re-admitted since: this result is stale
            request.num_computed_tokens += item.num_new_tokens
            if item.samples:
                request.append_output_token(sampled[request.request_id])
            self.block_manager.cache_full_blocks(request)
            if item.samples:
                stop = request.check_stop(self.config.max_model_len)
                if stop is not None:
                    done = self.finish_request(request.request_id, stop)
                    assert done is not None
                    finished.append(done)
        return finished
