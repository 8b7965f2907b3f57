"""The agent's state snapshot (``GET /kvherd/v1/state``) and Llumnix freeness.

Contract:
- `snapshot` must run on the engine thread (it reads the live scheduler and block manager) and returns a
  JSON-ready dict: ``instance_id``, ``model``, ``block_size``, ``total_blocks``, ``free_blocks`` (free plus
  evictable cached), ``cached_blocks``, ``kv_usage``, ``running`` and ``waiting`` (each request's
  ``request_id``, ``num_tokens``, ``num_prompt_tokens``, ``num_output_tokens``, ``max_tokens``,
  ``num_computed_tokens``, ``blocks`` held; waiting in scheduling order), ``num_running``,
  ``num_waiting``, ``max_num_seqs`` (batch slots), ``num_preemptions``,
  ``waiting_prefill_tokens`` and ``head_waiting_blocks`` (the engine's one load report,
  `instance_agent.engine.core.load`), ``freeness``, ``step_latency`` (recent steps: count, mean, p50, p99,
  seconds), ``last_kv_event_seq`` (-1 before the first batch), ``draining``, ``role`` (``prefill``,
  ``decode`` or ``mixed``: what the proxy pairs it for under P/D disaggregation), ``tiers`` (the
  engine's `LLMEngine.tier_usage`: per medium, GPU first, blocks held and capacity, hits, moves); with
  ``include_block_hashes`` also ``cached_block_hashes``, the exact set the KV event stream describes.
- Freeness is Llumnix's load measure: ``(free blocks - head_waiting_blocks) / number of requests`` (running
  + waiting; at least 1 so an idle instance reports its free blocks). Higher is freer; it goes negative when
  the queue head cannot be admitted.
- `StepLatencyWindow` keeps the durations of the last `size` engine steps (bounded).
"""

from __future__ import annotations

import statistics
import threading
from collections import deque
from typing import Any

from instance_agent.engine.core.batch_scheduler import BatchScheduler
from instance_agent.engine.core.block_manager import BlockManager
from instance_agent.engine.core.load import engine_load
from instance_agent.engine.core.request import Request


def freeness(free_blocks: int, head_of_line_blocks: int, num_requests: int) -> float:
    return (free_blocks - head_of_line_blocks) / max(1, num_requests)


class StepLatencyWindow:
    """Durations of recent engine steps; written by the engine thread, read by anyone."""

    def __init__(self, size: int = 256) -> None:
        self._durations: deque[float] = deque(maxlen=size)
        self._lock = threading.Lock()
        self.total_steps = 0

    def record(self, seconds: float) -> None:
        with self._lock:
            self._durations.append(seconds)
            self.total_steps += 1

    def summary(self) -> dict[str, float | int | None]:
        with self._lock:
            recent = sorted(self._durations)
            total = self.total_steps
        if not recent:
            return {"count": 0, "total_steps": total, "mean": None, "p50": None, "p99": None}
        return {
            "count": len(recent),
            "total_steps": total,
            "mean": statistics.fmean(recent),
            "p50": recent[len(recent) // 2],
            "p99": recent[min(len(recent) - 1, int(len(recent) * 0.99))],
        }


def _request_view(request: Request, block_manager: BlockManager) -> dict[str, Any]:
    return {
        "request_id": request.request_id,
        "num_tokens": request.num_tokens,
        "num_prompt_tokens": request.num_prompt_tokens,
        "num_output_tokens": request.num_output_tokens,
        "max_tokens": request.sampling_params.max_tokens,
        "num_computed_tokens": request.num_computed_tokens,
        "blocks": len(block_manager.block_ids(request.request_id)),
    }


def snapshot(
    scheduler: BatchScheduler,
    block_manager: BlockManager,
    *,
    instance_id: str,
    model: str,
    draining: bool,
    step_latency: StepLatencyWindow,
    last_kv_event_seq: int,
    include_block_hashes: bool = False,
    role: str = "mixed",
    tiers: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    running = [_request_view(r, block_manager) for r in scheduler.running]
    waiting = [_request_view(r, block_manager) for r in scheduler.waiting]
    load = engine_load(scheduler, block_manager)
    state: dict[str, Any] = {
        "instance_id": instance_id,
        "model": model,
        "block_size": load.block_size,
        "total_blocks": load.num_total_blocks,
        "free_blocks": load.num_free_blocks,
        "cached_blocks": load.num_cached_blocks,
        "kv_usage": load.kv_usage,
        "num_running": load.num_running,
        "num_waiting": load.num_waiting,
        "max_num_seqs": scheduler.config.max_num_seqs,
        "running": running,
        "waiting": waiting,
        "num_preemptions": load.num_preemptions,
        "waiting_prefill_tokens": load.waiting_prefill_tokens,
        "head_waiting_blocks": load.head_waiting_blocks,
        "freeness": freeness(
            load.num_free_blocks, load.head_waiting_blocks, load.num_running + load.num_waiting
        ),
        "step_latency": step_latency.summary(),
        "last_kv_event_seq": last_kv_event_seq,
        "draining": draining,
        "role": role,
        "tiers": tiers or [],
    }
    if include_block_hashes:
        state["cached_block_hashes"] = block_manager.cached_block_hashes()
    return state
