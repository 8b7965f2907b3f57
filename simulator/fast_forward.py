"""Decode fast-forward: a run of pure-decode engine steps applied at once, on the engine core's API.

The engine core has one execution path, `BatchScheduler.schedule` + `update_from_output`. Most
simulated steps are uneventful (every running request decodes one token, nothing is admitted,
nothing finishes), so the simulator applies a run of them at once with the same outcome.

Contract:
- `decode_run_length(scheduler, limit)` says how many of the next steps (at most `limit`) are
  certain to be pure decode steps of an unchanged running set: every running request decodes one
  token per step (none is in prefill), none finishes by length or model length (while a request
  that may stop on a sampled token, a stop token or EOS, runs, there is no run), every block
  crossing finds a free block (no preemption), and the waiting head, if `schedule` would try it,
  stays refused: it is refused now, free blocks only shrink during the run, and the run stops
  before evicting any block cached under one of the head's hashes (which could change its prefix
  hit: `BlockManager.num_free_before_evicting`). 0 when the next step is not a pure decode step,
  and 0 while the head's prefix continues on a lower KV tier (`BlockManager.lower_tier_hits`):
  `schedule` would try it as a load, and any eviction the run makes moves blocks down the tiers,
  which may push the head's own lower-tier blocks along and change what it needs.
- `advance_decode(scheduler, k, next_tokens)` applies `k` such steps (at most that length); the
  result equals `k` rounds of `schedule` + `update_from_output`: the same tokens appended, the
  same blocks allocated in the same order (step by step, running order, by the allocation
  `schedule` makes: `BlockManager.allocate_slots(request, 1)`), the same blocks cached with the
  same KV events (`cache_full_blocks`), the same step ids (`BatchScheduler.record_steps`). It
  stops early, at the step that caches a block under a hash of the waiting head, which the next
  `schedule` must see. `pools` and `step_events`, when given, record per step what an observer
  of stepping would see: (free, cached) blocks while the step is in flight, and its KV events.
- Only the public API of the scheduler, block manager and request is used. The rules of
  `schedule` this module relies on (running requests first, in order, one token per decode; a
  crossing allocates one block, watermark ignored; the waiting head is tried while fewer than
  `max_num_seqs` run and budget is left, admitted only if `can_allocate` with the watermark;
  `update_from_output` caches full blocks and stops by length) are checked, not trusted: the
  property test tests/unit/test_fast_forward_equals_stepping.py runs random workloads both ways
  and compares tokens, block tables, cached blocks, KV events, step ids and pool counts, so a
  change to `schedule` that this module does not follow fails it.
- Work is per request and per block crossing, not per token: tokens and block hashes are
  appended in bulk, and only steps that allocate or complete a block are visited.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from instance_agent.engine.core.batch_scheduler import BatchScheduler
from instance_agent.engine.core.request import Request, RequestStatus
from kvherd.kv_events import KVEvent


def _admission_head(scheduler: BatchScheduler) -> Request | None:
    """The waiting head `schedule` would try to admit after a pure-decode pass, or None."""
    cfg = scheduler.config
    n = len(scheduler.running)
    if not scheduler.waiting or n >= cfg.max_num_seqs or n >= cfg.max_num_batched_tokens:
        return None
    head: Request = scheduler.waiting[0]
    return head


def _head_admissible(scheduler: BatchScheduler, head: Request) -> bool:
    """Whether `schedule`, after a pure-decode pass, would admit `head` (as it decides it)."""
    cfg = scheduler.config
    bm = scheduler.block_manager
    budget = cfg.max_num_batched_tokens - len(scheduler.running)
    computed_blocks, num_hit = bm.get_computed_blocks(head)
    num_new = head.num_tokens - num_hit
    if not cfg.enable_chunked_prefill and num_new > budget:
        return False
    return bm.can_allocate(head, min(num_new, budget), computed_blocks, respect_watermark=True)


def decode_run_length(scheduler: BatchScheduler, limit: int) -> int:
    """How many of the next steps (at most `limit`) are certain to be pure decode steps."""
    cfg = scheduler.config
    bm = scheduler.block_manager
    bs = bm.block_size
    running = scheduler.running
    if limit <= 0 or not running or len(running) > cfg.max_num_batched_tokens:
        return 0
    if scheduler.running_prefill_tokens:  # a request still in prefill samples its first token
        return 0
    k = limit
    max_model_len = cfg.max_model_len
    tables = bm.block_tables
    running_status = RequestStatus.RUNNING
    first_alloc: list[int] = []  # per request: the step of its first new block
    for request in running:
        params = request.sampling_params
        num_tokens = len(request.token_ids)
        num_outputs = len(request.output_token_ids)
        if (
            request.status is not running_status
            or request.num_computed_tokens != num_tokens - 1
            or not num_outputs
            or params.stop_token_ids
            or (not params.ignore_eos and request.eos_token_id is not None)
        ):
            return 0
        # Step j appends output token (outputs + j) and makes the sequence num_tokens + j long.
        # (Comparisons, not min(): this loop runs over every running request per run.)
        steps_left = params.max_tokens - num_outputs - 1
        if steps_left < k:
            k = steps_left
        if max_model_len - num_tokens - 1 < k:
            k = max_model_len - num_tokens - 1
        if k <= 0:
            return 0
        capacity = len(tables.get(request.request_id, ())) * bs
        # Step j computes position num_tokens + j - 2, so it needs num_tokens + j - 1 slots.
        first_alloc.append(capacity - num_tokens + 2)
    free = bm.num_free_blocks
    head = _admission_head(scheduler)
    if head is not None:
        if bm.tiers is not None and bm.lower_tier_hits(head, len(bm.get_computed_blocks(head)[0])):
            return 0
        if _head_admissible(scheduler, head):
            return 0
        free = bm.num_free_before_evicting(head.block_hashes, free)
    if max(first_alloc) > k:  # requests with no crossing in the run cost nothing
        first_alloc = [c for c in first_alloc if c <= k]

    def allocations(steps: int) -> int:
        return sum([(steps - c) // bs + 1 for c in first_alloc if steps >= c])

    if allocations(k) <= free:
        return k
    low, high = 0, k  # allocations(low) <= free < allocations(high)
    while high - low > 1:
        mid = (low + high) // 2
        if allocations(mid) <= free:
            low = mid
        else:
            high = mid
    return low


def advance_decode(
    scheduler: BatchScheduler,
    num_steps: int,
    next_tokens: Callable[[Request, int], Sequence[int]],
    *,
    pools: list[tuple[int, int]] | None = None,
    step_events: list[list[KVEvent]] | None = None,
) -> int:
    """Apply `num_steps` pure-decode steps (at most `decode_run_length`) at once.

    `next_tokens(request, n)` gives the request's next `n` sampled tokens (counter-based sampling
    makes them a function of its seed and output length). `pools` and `step_events` get, per
    step, (free blocks, cached blocks) after the step's allocations and the KV events it emitted
    (events pending before the run count as the first step's). Returns the steps applied: fewer
    than `num_steps` only when a step caches a block under a hash of the waiting head.
    """
    bm = scheduler.block_manager
    bs = bm.block_size
    running = scheduler.running
    tables = bm.block_tables
    starts: list[int] = []
    # Per step, in running order: who crosses into a new block (with its computed tokens before
    # the step), whose block completes (for all `num_steps`; a run cut short below never reaches
    # the later ones). One pass over the running requests: with short runs, per-request work is
    # most of the cost.
    allocs: dict[int, list[tuple[Request, int]]] = {}
    completions: dict[int, list[tuple[Request, int]]] = {}
    for request in running:
        start = request.num_computed_tokens  # = num_tokens - 1: pure decode
        starts.append(start)
        tokens = next_tokens(request, num_steps)
        assert len(tokens) == num_steps, "next_tokens must give exactly the tokens asked for"
        if not isinstance(tokens, list):
            tokens = list(tokens)
        request.output_token_ids.extend(tokens)
        sequence = request.token_ids
        sequence.fromlist(tokens)  # (2x faster than array.extend from a list)
        if (len(request.block_hashes) + 1) * bs <= len(sequence):  # a block filled up
            request.update_block_hashes()
        # Step j computes position start + j - 1, so it needs start + j slots.
        first_alloc = len(tables[request.request_id]) * bs - start + 1
        if first_alloc <= num_steps:
            for j in range(first_alloc, num_steps + 1, bs):
                allocs.setdefault(j, []).append((request, start + j - 1))
        first_completion = bs - start % bs
        if first_completion <= num_steps:
            for j in range(first_completion, num_steps + 1, bs):
                completions.setdefault(j, []).append((request, start + j))
    steps = num_steps
    head = _admission_head(scheduler)
    head_hashes = set(head.block_hashes) if head is not None else None
    if head_hashes:
        # Step j completes a block of request i when starts[i] + j is a multiple of bs:
        # blocks starts[i] // bs on, those completed before the last step can matter.
        for i, request in enumerate(running):
            first_block = starts[i] // bs
            last_block = (starts[i] + steps - 1) // bs
            if first_block >= last_block or head_hashes.isdisjoint(
                request.block_hashes[first_block:last_block]
            ):
                continue
            j = bs - starts[i] % bs
            while j < steps:
                if request.block_hashes[(starts[i] + j) // bs - 1] in head_hashes:
                    steps = j
                    break
                j += bs
        if steps < num_steps:
            surplus = num_steps - steps
            for request in running:
                del request.output_token_ids[len(request.output_token_ids) - surplus :]
                del request.token_ids[len(request.token_ids) - surplus :]
                del request.block_hashes[len(request.token_ids) // bs :]
    scheduler.record_steps(steps)
    allocate_slots = bm.allocate_slots
    cache_full_blocks = bm.cache_full_blocks
    pool = (-1, -1)
    changed = True  # the pool (and pending events) must be read at the first step
    for j in range(1, steps + 1):
        crossings = allocs.get(j)
        if crossings is not None:
            for request, computed in crossings:
                request.num_computed_tokens = computed
                allocated = allocate_slots(request, 1)
                assert allocated, "advance_decode past decode_run_length"
            changed = True
        if pools is not None:
            if changed:  # only allocations and completions move the pool
                pool = bm.pool_counts()
            pools.append(pool)
        completed = completions.get(j)
        if completed is not None:
            for request, computed in completed:
                request.num_computed_tokens = computed
                cache_full_blocks(request)
        if step_events is not None:
            step_events.append(bm.take_events() if changed or completed else [])
        changed = completed is not None
    for request, start in zip(running, starts, strict=True):
        request.num_computed_tokens = start + steps
    return steps
