"""`kvherd profile`: measure the built-in engine's step time and fit the simulator's latency model.

Contract:
- ``--url URL`` profiles a running OpenAI-compatible server instead (vLLM, a kvherd agent), from
  outside, through its API: `instance_agent.remote_profile`. The rest is the built-in engine's.
- Runs the real `LLMEngine` (``--model tiny|small|PATH``) over a grid of workloads: cold prefills
  of several lengths, prefills after a cached prefix (chunks with context), and decode batches of
  several sizes and context lengths (mixed prefill+decode steps occur naturally between them).
  Every engine step is timed as the agent's engine loop runs it (``engine.step()`` plus taking the
  step's KV event batch: scheduling, the forward pass, sampling, detokenizing and block accounting,
  not the forward pass alone) and its batch shape recorded from the scheduler's own plan; each
  workload runs `--repeats` times and a batch shape keeps its fastest time (the usual defence
  against interference from other processes on a shared machine).
- ``--torch-threads`` sets torch's intra-op threads as ``kvherd agent --torch-threads`` does: a
  profile only predicts an agent that computes with as many threads. ``--clock thread`` times
  steps in CPU time of the stepping thread instead of wall time; with one torch thread that is all
  the work of a step, and other processes competing for the cores do not inflate it.
- Fits, by least squares (numpy), one linear model over the named features
  ``const, prefill_sequences, prefill_tokens, prefill_attention_pairs, decode_batch,
  decode_context_tokens`` (attention pairs of a chunk of n new tokens after c computed ones:
  n*c + n(n+1)/2; the per-sequence terms carry the engine's Python work per request) and writes
  ``--out FILE.json`` in the format ``kvherd-latency-profile/v2``: features, coefficients (seconds),
  fit quality (RMSE, mean absolute percentage error, R^2), the engine configuration measured
  (block size, pool size, batch limits, torch threads, clock: `kvherd sim` adopts the engine
  limits), KV bytes per token, and every measured point with its prediction. The feature names
  are the file's contract with the simulator: both compute them with
  `kvherd.profile_format`. It writes no ``host`` section (`kvherd sim --profile`): one engine
  alone cannot measure the request path or co-location; bench/sim_fidelity.py probes them on a
  live fleet and writes the section, or it is written by hand.
- Bad arguments exit with status 2 and one line on stderr.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvherd.profile_format import (
    FEATURES,
    PROFILE_FORMAT,
    doubling_grid,
    fastest_per_shape,
    fit_steps,
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="tiny", help="preset (tiny, small) or HF checkpoint dir")
    parser.add_argument("--out", required=True, type=Path, help="profile JSON to write")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--num-blocks", type=int, default=None, help="KV pool (default: engine's)")
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument(
        "--max-context", type=int, default=1024, help="largest context length measured"
    )
    parser.add_argument("--max-batch", type=int, default=32, help="largest decode batch measured")
    parser.add_argument("--repeats", type=int, default=3, help="runs of every workload")
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument(
        "--torch-threads", type=int, default=None, help="intra-op CPU threads (default: torch's)"
    )
    parser.add_argument(
        "--clock",
        choices=("wall", "thread"),
        default="wall",
        help="time steps in wall time, or in CPU time of the stepping thread (needs "
        "--torch-threads 1 on CPU; robust on a busy machine)",
    )
    parser.add_argument("--seed", type=int, default=0)
    remote = parser.add_argument_group(
        "a running server (--url): vLLM or any OpenAI-compatible one"
    )
    remote.add_argument("--url", default=None, help="profile this server instead of the engine")
    remote.add_argument("--served-model", default=None, help="model name (default: its first)")
    remote.add_argument("--api-key", default=None)
    remote.add_argument("--request-timeout", type=float, default=120.0, help="seconds a request")
    remote.add_argument("--decode-tokens", type=int, default=16, help="tokens of a decode point")
    remote.add_argument(
        "--vocab-limit", type=int, default=256, help="prompts draw token ids in [3, this)"
    )


def _fail(message: str) -> int:
    print(f"kvherd profile: error: {message}", file=sys.stderr)
    return 2


class _Profiler:
    def __init__(self, engine: Any, seed: int, clock: Callable[[], float]) -> None:
        self.engine = engine
        self.clock = clock
        self.points: list[dict[str, Any]] = []
        self._rng = random.Random(seed)
        self._ids = 0
        vocab = engine.model_config.vocab_size
        self._low, self._high = 3, min(vocab, 256)  # regular tokens of every kvherd vocabulary

    def tokens(self, n: int) -> list[int]:
        return [self._rng.randrange(self._low, self._high) for _ in range(n)]

    def add(self, prompt: list[int], max_tokens: int) -> None:
        from instance_agent.engine.core.request import SamplingParams

        self._ids += 1
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        self.engine.add_request(f"profile-{self._ids}", prompt, params)

    def drain(self, record: bool = True) -> None:
        engine = self.engine
        scheduler = engine.scheduler
        while engine.has_unfinished():
            shapes: list[tuple[list[tuple[int, int]], list[int]]] = []
            schedule = scheduler.schedule

            def planned(schedule: Any = schedule, shapes: Any = shapes) -> Any:
                output = schedule()
                prefill, decode = [], []
                for item in output.scheduled:
                    if item.num_new_tokens == 1 and item.request.output_token_ids:
                        decode.append(item.num_computed_before + 1)
                    else:
                        prefill.append((item.num_new_tokens, item.num_computed_before))
                shapes.append((prefill, decode))
                return output

            scheduler.schedule = planned
            clock = self.clock
            try:
                start = clock()
                engine.step()
                engine.take_kv_event_batch()  # the engine loop publishes it after every step
                elapsed = clock() - start
            finally:
                del scheduler.schedule  # back to the class method
            prefill, decode = shapes[0]
            if record and (prefill or decode):
                self.points.append({"prefill": prefill, "decode": decode, "measured_s": elapsed})


def _workloads(prof: _Profiler, args: argparse.Namespace, max_len: int) -> None:
    max_ctx = min(args.max_context, max_len - 16)
    lengths = doubling_grid(max_ctx, 16)
    for _ in range(args.repeats):
        for length in lengths:  # cold prefills (chunked beyond the token budget)
            prof.add(prof.tokens(length), 1)
            prof.drain()
        for context in lengths[1:]:  # a chunk after a cached prefix
            prefix = prof.tokens(context - context % args.block_size)
            prof.add(prefix, 1)
            prof.drain(record=False)
            for new in (16, 128):
                if len(prefix) + new < max_len:
                    prof.add(prefix + prof.tokens(new), 1)
                    prof.drain()
        for batch in doubling_grid(args.max_batch, 1):  # decode batches at several contexts
            for context in (16, *lengths[2::2]):
                if context + 8 >= max_len:
                    continue
                for _ in range(batch):
                    prof.add(prof.tokens(context), 8)
                prof.drain()


def run(args: argparse.Namespace) -> int:
    if args.url is not None:
        from instance_agent.remote_profile import run_remote

        return run_remote(args)
    if args.repeats < 1 or args.max_context < 32 or args.max_batch < 1:
        return _fail("--repeats >= 1, --max-context >= 32 and --max-batch >= 1 are required")
    if args.torch_threads is not None and args.torch_threads < 1:
        return _fail("--torch-threads must be at least 1")
    import torch

    threads_before = torch.get_num_threads()
    if args.torch_threads is not None:
        torch.set_num_threads(args.torch_threads)
    try:
        return _profile(args)
    finally:  # an in-process caller keeps its own thread count
        torch.set_num_threads(threads_before)


def _profile(args: argparse.Namespace) -> int:
    import torch

    from instance_agent.engine.llm_engine import EngineConfig, LLMEngine
    from instance_agent.engine.model import kv_bytes_per_block

    try:
        engine = LLMEngine(
            EngineConfig(
                model=args.model,
                seed=args.seed,
                block_size=args.block_size,
                num_gpu_blocks=args.num_blocks,
                max_num_seqs=max(args.max_num_seqs, args.max_batch),
                max_num_batched_tokens=args.max_num_batched_tokens,
                max_model_len=args.max_model_len,
                device=args.device,
                dtype=args.dtype,
            )
        )
    except (ValueError, OSError) as exc:
        return _fail(str(exc))
    threads = torch.get_num_threads()
    if args.clock == "thread" and (engine.device.type != "cpu" or threads != 1):
        # Other threads' work (intra-op workers, GPU kernels) would not be counted.
        return _fail("--clock thread needs the CPU device and --torch-threads 1")
    clock = time.thread_time if args.clock == "thread" else time.perf_counter
    prof = _Profiler(engine, args.seed, clock)
    prof.add(prof.tokens(64), 4)  # warm-up: first calls allocate and compile
    prof.drain(record=False)
    started = time.perf_counter()
    _workloads(prof, args, engine.max_model_len)
    points = fastest_per_shape(prof.points)
    coef, stats, predicted = fit_steps(points)
    for point, pred in zip(points, predicted, strict=True):
        point["predicted_s"] = pred
    cfg = engine.config
    bm = engine.block_manager
    profile = {
        "format": PROFILE_FORMAT,
        "model": args.model,
        "device": str(engine.device),
        "torch_threads": threads,
        "clock": args.clock,
        "features": list(FEATURES),
        "coefficients_s": coef,
        "fit": stats,
        "engine": {
            "block_size": bm.block_size,
            "num_blocks": bm.num_blocks,
            "max_num_seqs": cfg.max_num_seqs,
            "max_num_batched_tokens": cfg.max_num_batched_tokens,
            "max_model_len": engine.max_model_len,
        },
        "kv_bytes_per_token": kv_bytes_per_block(
            engine.model_config, bm.block_size, engine.runner.dtype
        )
        / bm.block_size,
        "points": points,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(profile, indent=1) + "\n")
    print(
        f"{len(prof.points)} steps ({len(points)} distinct batch shapes) measured in "
        f"{time.perf_counter() - started:.1f} s on "
        f"{engine.device}; fit: RMSE {stats['rmse_ms']:.3f} ms, "
        f"mean |error| {stats['mean_abs_pct_error']:.1f}%, R^2 {stats['r2']:.4f}"
    )
    print("  t = " + " + ".join(f"{c:.3e}*{f}" for c, f in zip(coef, FEATURES, strict=True)))
    print(f"wrote {args.out}; use it with: kvherd sim TRACE --latency-model calibrated:{args.out}")
    return 0
