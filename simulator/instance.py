"""A simulated engine instance: the engine's own batch scheduler and block manager, timed by a model.

Contract:
- `SimInstance` owns a real `BlockManager` and `BatchScheduler` (instance_agent.engine). A step is
  `scheduler.schedule()`; its duration is the latency model's `step_time` of exactly the batch the
  scheduler produced (prefill chunks with their context, decode contexts); at the step's end the
  instance calls `scheduler.update_from_output` with one synthetic token per sampling request. So
  admission, chunked prefill, prefix hits, preemption and block accounting are the engine's, not an
  imitation.
- Every request is submitted with `ignore_eos` and `max_tokens` = its trace output length, so it
  finishes by length after exactly that many tokens (or at the model's max length).
- The instance reports each token's time to a `TokenSink` (metrics) and keeps the KV events the block
  manager emits for the cluster to deliver (with delay) to the scheduler's prefix index.
- Decode fast-forward (`start_decode_run`): when the scheduler guarantees a run of pure-decode
  steps and they all end before `horizon` (the next event that could observe or change the
  instance), the instance applies them at once (`simulator.fast_forward`) with the same step
  times, token times, block allocations and per-step KV events as stepping one by one.
  `continue_decode_run` applies the next steps of the same guaranteed run, up to a new horizon,
  as long as no request was added since (an admission ends the guarantee).
- KV tiers (`InstanceConfig.num_cpu_blocks`, `num_disk_blocks`): the block manager gets the
  engine's own `TierStore`. A step that starts loads (`SchedulerOutput.loads`) prices each on its
  tiers' links (bytes = blocks x block size x `kv_bytes_per_token`, over `cpu_bandwidth` or
  `disk_bandwidth`), one link per tier and instance, loads queued on it in order (contention);
  `take_loads` hands the driver (request id, seconds from now) to call `finish_load` after.
  Offloads (evictions moving down) run on the device-to-host direction beside compute: counted
  in `tier_stats`, never delaying a step. `tier_stats` also counts tokens loaded per tier.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol

from instance_agent.engine.core.batch_scheduler import (
    BatchScheduler,
    SchedulerConfig,
    SchedulerOutput,
)
from instance_agent.engine.core.block_manager import BlockManager
from instance_agent.engine.core.request import Request, SamplingParams
from instance_agent.engine.core.tiers import BlockCopy, TierConfig, TierStore
from kvherd.kv_events import MEDIUM_CPU, MEDIUM_GPU, MEDIUM_STORAGE, KVEvent
from simulator.fast_forward import advance_decode, decode_run_length
from simulator.latency.base import LatencyModel
from simulator.prompts import DEFAULT_LOW_TOKEN, DEFAULT_VOCAB_SIZE, synthesize_prompt
from simulator.traces import TraceRequest

# Synthetic sampled tokens: distinct per (request, position) so output blocks never alias across
# requests, inside the same alphabet the prompts use.
_TOKEN_LOW = DEFAULT_LOW_TOKEN
_TOKEN_RANGE = DEFAULT_VOCAB_SIZE - DEFAULT_LOW_TOKEN


class TokenSink(Protocol):
    def on_scheduled(self, request_id: str, now: float) -> None: ...
    def on_tokens(self, request_ids: list[str], now: float) -> None:
        """Each request got one token at `now` (a request's first, or a later one)."""

    def on_decode_run(self, request_ids: list[str], times: list[float]) -> None:
        """Each request got one token at each of `times` (never its first)."""

    def on_finished(self, request: Request, instance_id: str, now: float) -> None: ...


def sampled_token(request: Request) -> int:
    """The synthetic token a request samples next."""
    return _TOKEN_LOW + (
        (request.sampling_seed * 40503 + len(request.output_token_ids)) % _TOKEN_RANGE
    )


# The alphabet repeated: `sampled_tokens` is one slice of it (consecutive tokens wrap around),
# for runs of up to 4,096 tokens.
_TOKEN_CYCLE = list(range(_TOKEN_LOW, _TOKEN_LOW + _TOKEN_RANGE)) * (2 + 4096 // _TOKEN_RANGE)


def sampled_tokens(request: Request, count: int) -> list[int]:
    """The next `count` tokens `sampled_token` gives, one step after another."""
    start = (request.sampling_seed * 40503 + len(request.output_token_ids)) % _TOKEN_RANGE
    if start + count <= len(_TOKEN_CYCLE):
        return _TOKEN_CYCLE[start : start + count]
    return [_TOKEN_CYCLE[(start + i) % _TOKEN_RANGE] for i in range(count)]


@dataclass(slots=True)
class DecodeRun:
    """A fast-forwarded run of decode steps: each step's start and end time, its KV events, and
    the pool as an observer saw it while the step was in flight (free and cached blocks)."""

    step_starts: list[float]
    step_ends: list[float]
    events: list[list[KVEvent]]
    pool: list[tuple[int, int]]


@dataclass(slots=True)
class TierStats:
    """Tokens loaded back from each lower tier, and what offloads moved down (bytes)."""

    loaded_tokens: dict[str, int]
    load_s: float = 0.0
    offload_bytes: float = 0.0
    loads: int = 0


@dataclass(slots=True)
class InstanceConfig:
    num_blocks: int
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int = 1 << 20
    enable_prefix_caching: bool = True
    # Off: a prompt is admitted only whole (vLLM before chunked prefill); then
    # max_num_batched_tokens must cover max_model_len (`SchedulerConfig.validate`).
    enable_chunked_prefill: bool = True
    watermark: float = 0.01
    # Serving-loop cost per step outside the forward pass (HTTP streaming, thread hand-offs).
    step_overhead_s: float = 0.0
    # KV tiers under the GPU pool, in blocks (0: none), and their links' bytes/s: host DRAM over
    # PCIe Gen5 x16 (~32 GB/s of pinned copies), one NVMe drive (~4 GB/s of block reads).
    num_cpu_blocks: int = 0
    num_disk_blocks: int = 0
    cpu_bandwidth: float = 32e9
    disk_bandwidth: float = 4e9

    def tier_store(self) -> TierStore | None:
        configs = [
            TierConfig(medium, count)
            for medium, count in (
                (MEDIUM_CPU, self.num_cpu_blocks),
                (MEDIUM_STORAGE, self.num_disk_blocks),
            )
            if count > 0
        ]
        return TierStore(configs, self.block_size) if configs else None

    def bandwidth(self, medium: str) -> float:
        return self.cpu_bandwidth if medium == MEDIUM_CPU else self.disk_bandwidth

    def scheduler_config(self) -> SchedulerConfig:
        return SchedulerConfig(
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_model_len=self.max_model_len,
            enable_chunked_prefill=self.enable_chunked_prefill,
        )


def make_request(
    trace_request: TraceRequest,
    id_block_size: int,
    engine_block_size: int,
    arrival_time: float,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    lora_name: str | None = None,
) -> Request:
    """The engine request for a trace entry: synthesised prompt, ignore_eos, max_tokens = output;
    with `lora_name` it runs with that LoRA adapter (its blocks hash with the name)."""
    prompt = synthesize_prompt(
        trace_request.hash_ids, trace_request.input_length, id_block_size, vocab_size, _TOKEN_LOW
    )
    params = SamplingParams(
        max_tokens=trace_request.output_length,
        temperature=0.0,
        seed=trace_request.index,
        ignore_eos=True,
    )
    return Request(
        trace_request.request_id,
        prompt,
        params,
        engine_block_size,
        arrival_time=arrival_time,
        lora_name=lora_name,
    )


def step_shape(output: SchedulerOutput) -> tuple[list[tuple[int, int]], list[int]]:
    """Split a scheduler output into prefill chunks (new, before) and decode contexts."""
    prefill: list[tuple[int, int]] = []
    decode: list[int] = []
    for item in output.scheduled:
        if item.num_new_tokens == 1 and item.request.output_token_ids:
            decode.append(item.num_computed_before + 1)
        else:
            prefill.append((item.num_new_tokens, item.num_computed_before))
    return prefill, decode


class SimInstance:
    def __init__(
        self, instance_id: str, config: InstanceConfig, latency: LatencyModel, sink: TokenSink
    ) -> None:
        self.instance_id = instance_id
        self.config = config
        self.latency = latency
        self.sink = sink
        self.block_manager = BlockManager(
            config.num_blocks,
            config.block_size,
            config.enable_prefix_caching,
            config.watermark,
            config.tier_store() if config.enable_prefix_caching else None,
        )
        self.tier_stats = TierStats({MEDIUM_CPU: 0, MEDIUM_STORAGE: 0})
        self._link_free: dict[str, float] = {}  # per lower tier: when its link is free again
        self._loads: list[tuple[str, float]] = []  # started, for the driver: (id, seconds)
        self.scheduler = BatchScheduler(config.scheduler_config(), self.block_manager)
        self._output: SchedulerOutput | None = None
        self._run: DecodeRun | None = None
        # The guaranteed run the current decode run belongs to: its step times still to plan
        # (one drawn but not planned yet, if a horizon stopped it), how many steps it may still
        # take, and its requests.
        self._step_times: Iterator[float] = iter(())
        self._drawn: float | None = None
        self._steps_left = 0
        self._run_request_ids: list[str] = []
        self._scheduled_once: set[str] = set()
        self.step_end: float | None = None  # virtual time the running step ends; None when idle
        self.last_busy = 0.0  # virtual time the last step ended
        self.num_steps = 0
        self.busy_time = 0.0

    @property
    def idle(self) -> bool:
        return self.step_end is None

    def add_request(self, request: Request) -> None:
        self.scheduler.add_request(request)
        # The next `schedule` may admit it: the guaranteed decode run ends with the current one.
        self._steps_left = 0

    def start_step(self, now: float, stretch: float = 1.0) -> float | None:
        """Plan the next step at `now`, its time multiplied by `stretch` (contention from
        co-located instances); returns its end time, or None when there is nothing to run."""
        output = self.scheduler.schedule()
        while output.is_empty and output.preempted:
            # The plan only preempted (the last running request gave up its own blocks): the
            # engine loop steps again at once, and so does the simulated one.
            output = self.scheduler.schedule()
        if self.block_manager.tiers is not None:
            self._price_tier_copies(now, output)
        if output.is_empty:
            self._output = None
            self.step_end = None
            return None
        prefill, decode = step_shape(output)
        duration = (self.latency.step_time(prefill, decode) + self.config.step_overhead_s) * stretch
        for item in output.scheduled:
            rid = item.request.request_id
            if rid not in self._scheduled_once:
                self._scheduled_once.add(rid)
                self.sink.on_scheduled(rid, now)
        self._output = output
        self.step_end = now + duration
        self.num_steps += 1
        self.busy_time += duration
        return self.step_end

    def _price_tier_copies(self, now: float, output: SchedulerOutput) -> None:
        """Time the loads `output` started on their tiers' links; count the offloads queued."""
        self._count_offloads(self.block_manager.take_offloads())
        kv_bytes = (self.latency.kv_bytes_per_token or 0.0) * self.config.block_size
        stats = self.tier_stats
        for load in output.loads:
            done = now
            for medium in (MEDIUM_CPU, MEDIUM_STORAGE):
                blocks = sum(1 for copy in load.copies if copy.src_medium == medium)
                if not blocks:
                    continue
                start = max(now, self._link_free.get(medium, now))
                end = start + blocks * kv_bytes / self.config.bandwidth(medium)
                self._link_free[medium] = end
                done = max(done, end)
                stats.loaded_tokens[medium] += blocks * self.config.block_size
            stats.loads += 1
            stats.load_s += done - now
            self._loads.append((load.request_id, done - now))

    def _count_offloads(self, copies: list[BlockCopy]) -> None:
        if copies:
            kv_bytes = (self.latency.kv_bytes_per_token or 0.0) * self.config.block_size
            self.tier_stats.offload_bytes += kv_bytes * sum(
                1 for copy in copies if copy.src_medium == MEDIUM_GPU
            )

    def take_loads(self) -> list[tuple[str, float]]:
        """Loads started since the last call: (request id, seconds until its copies land)."""
        loads, self._loads = self._loads, []
        return loads

    def finish_step(self, now: float) -> list[Request]:
        """Apply the running step's results at its end time; returns the finished requests."""
        output = self._output
        assert output is not None, "finish_step without a running step"
        self._output = None
        self.step_end = None
        self.last_busy = now
        sampled: dict[str, int] = {}
        sampling = [item for item in output.scheduled if item.samples]
        for item in sampling:
            sampled[item.request.request_id] = sampled_token(item.request)
        finished = self.scheduler.update_from_output(output, sampled)
        got_token = [
            item.request.request_id
            for item in sampling
            if item.request.num_computed_tokens > item.num_computed_before
        ]
        if got_token:
            self.sink.on_tokens(got_token, now)
        for req in finished:
            self._scheduled_once.discard(req.request_id)
            self.sink.on_finished(req, self.instance_id, now)
        return finished

    def start_decode_run(
        self, now: float, horizon: float, max_steps: int, straddle: bool = False
    ) -> DecodeRun | None:
        """Fast-forward the next pure-decode steps that end before `horizon`; None if none (fewer
        than 2 without `straddle`) fits.

        With `straddle`, the run also takes the step in flight at `horizon` (it starts before and
        ends at or after it): right when the barrier event only queues work for the next
        `schedule` (an admission), which a step already planned cannot see. Such a run may be
        a single step, since `continue_decode_run` extends it past barriers that change nothing.
        The instance is busy until the run's last step end; then call `continue_decode_run`
        or `finish_decode_run`.
        """
        scheduler = self.scheduler
        running = scheduler.running
        if not running:
            return None
        # A decode's context: its computed tokens + 1.
        self._step_times = self.latency.decode_step_times(
            [len(r.token_ids) for r in running], max_steps
        )
        self._drawn = None
        starts: list[float] = []
        ends: list[float] = []
        durations: list[float] = []
        # Check that enough steps fit before the horizon first: a run that could not start
        # needs no run-length check over every running request.
        min_steps = 1 if straddle else 2
        self._plan(now, horizon, straddle, min_steps, starts, ends, durations)
        if len(ends) < min_steps:
            return None
        k = decode_run_length(scheduler, max_steps)
        if k < min_steps:
            return None
        self._plan(now, horizon, straddle, k, starts, ends, durations)
        self._steps_left = k - len(ends)
        # Every request of a decode run was scheduled before (it has output): no on_scheduled.
        self._run_request_ids = [r.request_id for r in running]
        return self._apply_run(starts, ends, durations)

    def continue_decode_run(
        self, now: float, horizon: float, straddle: bool = False
    ) -> DecodeRun | None:
        """At the end of a decode run, fast-forward the next steps of the same guaranteed run
        (see `start_decode_run`) that fit before `horizon`, without checking the run anew; None
        when it has no step left or none fits. Nothing but an admission (`add_request`, which
        ends the guaranteed run) may have changed the instance since the run started.
        """
        if self._steps_left <= 0:
            return None
        starts: list[float] = []
        ends: list[float] = []
        durations: list[float] = []
        self._plan(now, horizon, straddle, self._steps_left, starts, ends, durations)
        if not ends:
            return None
        self._steps_left -= len(ends)
        return self._apply_run(starts, ends, durations)

    def _plan(
        self,
        now: float,
        horizon: float,
        straddle: bool,
        count: int,
        starts: list[float],
        ends: list[float],
        durations: list[float],
    ) -> None:
        """Extend a run's steps to `count`, stopping at the horizon; a step time drawn but not
        planned is kept for the next part of the run."""
        overhead = self.config.step_overhead_s
        t = ends[-1] if ends else now
        need = count - len(ends)
        # A barrier at a step start comes first (it was queued first).
        if need <= 0 or t >= horizon:
            return
        times: Iterator[float] = self._step_times
        if self._drawn is not None:
            times = itertools.chain((self._drawn,), times)
            self._drawn = None
        for step_time in times:
            duration = step_time + overhead
            end = t + duration
            if end >= horizon and not straddle:
                self._drawn = step_time
                return
            starts.append(t)
            ends.append(end)
            durations.append(duration)
            t = end
            need -= 1
            if not need or t >= horizon:
                return

    def _apply_run(
        self, starts: list[float], ends: list[float], durations: list[float]
    ) -> DecodeRun:
        events: list[list[KVEvent]] = []
        pool: list[tuple[int, int]] = []
        applied = advance_decode(
            self.scheduler, len(ends), sampled_tokens, pools=pool, step_events=events
        )
        if self.block_manager.tiers is not None:
            self._count_offloads(self.block_manager.take_offloads())
        if applied < len(ends):  # the waiting head must see a block this run cached
            self._steps_left = 0
            del starts[applied:]
            del ends[applied:]
        self.sink.on_decode_run(self._run_request_ids, ends)
        for duration in durations[:applied]:
            self.busy_time += duration
        self.num_steps += applied
        self.step_end = ends[-1]
        self._run = DecodeRun(starts, ends, events, pool)
        return self._run

    def finish_decode_run(self) -> None:
        assert self._run is not None and self.step_end is not None, "no decode run in flight"
        self._run = None
        self._steps_left = 0
        self.last_busy = self.step_end
        self.step_end = None

    def pool_at(self, now: float) -> tuple[int, int]:
        """(free blocks, cached blocks) as seen at `now`, inside a decode run or not.

        Inside a run the pool is already at the run's end; an observer at `now` sees it as it was
        while the step in flight at `now` ran (a tie with a step start counts as the step before).
        """
        run = self._run
        bm = self.block_manager
        if run is None:
            return bm.pool_counts()
        index = max(bisect.bisect_left(run.step_starts, now) - 1, 0)
        return run.pool[index]

    def take_events(self) -> list[KVEvent]:
        return self.block_manager.take_events()
