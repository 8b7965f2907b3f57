"""The load an engine state gives: the one set of figures the agent reports and the simulator uses.

Contract:
- `engine_load(scheduler, block_manager)` reads a `BatchScheduler` and its `BlockManager` between
  steps and returns an `EngineLoad`: request counts, pool sizes (``num_free_blocks`` counts
  evictable cached blocks as free), preemptions, and the two queue figures below. The agent's state
  snapshot (``GET /kvherd/v1/state``) writes these figures under the same names, and the simulator
  builds its `LoadReport` from the same call, so production and simulation never define load twice.
- ``waiting_prefill_tokens``: the prefill work a newly arriving request would queue behind — every
  token still to compute of the waiting requests (a prompt, or a preempted request's whole
  sequence) plus the rest of each running request still in prefill (admitted and not sampled
  since: a long prompt in chunked prefill runs for several steps). A decoding request adds
  nothing: its one uncomputed token is the next decode step, not queued prefill.
- ``head_waiting_blocks``: the blocks the head-of-line waiting request needs beyond those it holds
  (0 when nothing waits): what must come free before anything new is admitted.
- `pool` overrides (free, cached) blocks as an observer saw them (the simulator's decode runs,
  `SimInstance.pool_at`); the queue figures do not move during a run of pure decode steps.
- Pure: no I/O, no clock; O(requests in prefill) per call (the scheduler keeps both sums' parts).
"""

from __future__ import annotations

from typing import NamedTuple

from instance_agent.engine.core.batch_scheduler import BatchScheduler
from instance_agent.engine.core.block_manager import BlockManager


class EngineLoad(NamedTuple):
    num_running: int
    num_waiting: int
    num_total_blocks: int
    num_free_blocks: int
    num_cached_blocks: int
    num_preemptions: int
    waiting_prefill_tokens: int
    head_waiting_blocks: int
    block_size: int

    @property
    def kv_usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_total_blocks


def waiting_prefill_tokens(scheduler: BatchScheduler) -> int:
    """Prefill tokens a new request would queue behind (see the module contract)."""
    return scheduler.num_waiting_tokens + scheduler.running_prefill_tokens


def head_waiting_blocks(scheduler: BatchScheduler, block_manager: BlockManager) -> int:
    """Blocks the first waiting request needs beyond those it already holds."""
    if not scheduler.waiting:
        return 0
    head = scheduler.waiting[0]
    held = len(block_manager.block_ids(head.request_id))
    return max(0, block_manager.blocks_needed(head.num_tokens) - held)


def engine_load(
    scheduler: BatchScheduler,
    block_manager: BlockManager,
    pool: tuple[int, int] | None = None,
) -> EngineLoad:
    """The engine's load now; `pool` replaces (free, cached) blocks when given."""
    num_free, num_cached = block_manager.pool_counts() if pool is None else pool
    waiting = scheduler.waiting
    # (Positional: a simulated fleet takes this for every instance every report interval.)
    return EngineLoad(
        len(scheduler.running),
        len(waiting),
        block_manager.num_blocks,
        num_free,
        num_cached,
        scheduler.num_preemptions,
        scheduler.num_waiting_tokens + scheduler.running_prefill_tokens,
        head_waiting_blocks(scheduler, block_manager) if waiting else 0,
        block_manager.block_size,
    )
