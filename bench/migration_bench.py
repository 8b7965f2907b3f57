"""Live-migration benchmark: kvherd's multi-stage migration vs a blocking copy vs recompute, one run.

Setup: two engines with preset ``small`` shapes (8 layers, hidden 512, 4 KV heads of 64, fp32, CPU,
block size 16, one torch thread each) in one process, each stepping on its own thread
(`tests/support/engine_thread.py`). KV bytes move over a real gloo pair group on loopback
(`migration.transport`); control messages are direct calls to the destination driver, so the
figures isolate the migration from HTTP. To reach 8k tokens of context the ``small`` shapes are
registered with 8,448 positions (same weights, longer RoPE tables).

(a) Downtime by context length (256, 1k, 2k, 4k, 8k tokens of prompt): a request decodes on the
    source; after 4 output tokens it moves between the two instances, by
    - kvherd: multi-stage copy (live stages while decoding, then stop-and-copy of <= 4 blocks),
      `--rounds` times back and forth (medians);
    - blocking full copy: suspend first, then copy every block (the same driver with no live
      stage), half as many rounds;
    - recompute: the destination prefills as many tokens (what re-dispatching costs).
    Cache-aware transfer is off here (the instance a request left still caches its blocks).
    Downtime is the time the request makes no progress: suspend to commit for the copies, the
    prefill for recompute. Also shown: the token stall (last token on the source to first token on
    the destination, which adds a decode step and the wait for the step in flight) against the
    request's median inter-token time.
(b) Cache-aware transfer: the destination has served a request with the same 4,096-token prefix;
    bytes sent migrating a request of that prefix plus 256 tokens of its own, with and without.
(c) Transfer rate: bytes per second of downtime of the blocking copy at the longest context
    (suspend, reservation, the copy from cache to cache, commit) vs one raw gloo send of the same
    bytes between two ranks of a fresh pair group (preallocated tensors, nothing else).

Usage: ``python bench/migration_bench.py [--preset small] [--contexts 256,1024,...] [--json out.json]``.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import itertools
import json
import random
import statistics
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
# The in-process engine thread the migration tests use (a test support module, not a product one).
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "support"))

from engine_thread import EngineThread

from instance_agent.engine.config import PRESETS
from instance_agent.engine.core.request import SamplingParams
from instance_agent.engine.llm_engine import EngineConfig, LLMEngine
from instance_agent.migration_routes import EngineMigrationAdapter
from migration.core.protocol import MigrationOutcome, MigrationStatus
from migration.core.reservations import ReservationTable
from migration.core.stages import StageConfig
from migration.destination import MigrationDestination
from migration.source import migrate_out
from migration.transport import TransportHub

BLOCK_SIZE = 16
DECODE_BEFORE = 4  # output tokens before the migration starts
MAX_DECODE = 500  # enough for every round of migrations of one request
# Cache-aware transfer is off for the downtime rounds: the request moves back and forth, and the
# instance it left still caches its blocks; (b) measures cache-aware transfer on its own.
MULTI_STAGE = StageConfig(last_stage_max_blocks=4, max_live_stages=8, cache_aware=False)
BLOCKING = StageConfig(max_live_stages=0, cache_aware=False)


@dataclasses.dataclass
class Instance:
    name: str
    engine: LLMEngine
    thread: EngineThread
    hub: TransportHub
    destination: MigrationDestination

    @property
    def src_name(self) -> str:
        return f"{self.name}#{self.hub.incarnation}"

    def close(self) -> None:
        self.thread.stop()
        self.hub.close()


def make_instance(name: str, preset: str, max_len: int, num_blocks: int) -> Instance:
    engine = LLMEngine(
        EngineConfig(
            model=preset,
            block_size=BLOCK_SIZE,
            num_gpu_blocks=num_blocks,
            max_model_len=max_len,
            max_num_batched_tokens=2048,
        )
    )
    # Write every KV page once, as a serving engine has: a fresh zeroed cache is mapped lazily,
    # and the first bytes landing in a page would pay a page fault the raw baseline does not.
    engine.runner.kv_cache.fill_(0)
    adapter = EngineMigrationAdapter(engine)
    thread = EngineThread(engine, adapter, name=name)
    hub = TransportHub(timeout_s=60.0)
    destination = MigrationDestination(
        thread.call,
        hub,
        ReservationTable(max_incoming=1, timeout_s=120.0),
        adapter.block_size,
        adapter.kv_bytes_per_block(),
    )
    return Instance(name, engine, thread, hub, destination)


async def wait_for(predicate: Any, timeout: float = 600.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError("benchmark condition not reached")
        await asyncio.sleep(0.001)


def prompt(length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(256) for _ in range(length)]


async def start_decoding(inst: Instance, rid: str, tokens: list[int], max_tokens: int) -> None:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    await inst.thread.run(lambda e: e.add_request(rid, tokens, params))
    await wait_for(lambda: len(inst.thread.tokens.get(rid, [])) >= DECODE_BEFORE)


async def migrate(src: Instance, dst: Instance, rid: str, config: StageConfig) -> MigrationOutcome:
    outcome = await migrate_out(
        src.thread.call, src.hub, dst.destination, rid, src.src_name, config
    )
    if outcome.status is not MigrationStatus.COMMITTED:
        raise RuntimeError(f"migration of {rid} did not commit: {outcome}")
    return outcome


def token_gaps(times: list[float]) -> list[float]:
    return [b - a for a, b in itertools.pairwise(times)]


async def warm_pair(src: Instance, dst: Instance) -> None:
    """Form the pair group before measuring: a rendezvous is a one-time cost per instance pair."""
    endpoint = dst.hub.offer(src.src_name)
    await asyncio.gather(
        asyncio.to_thread(src.hub.connect, endpoint),
        asyncio.to_thread(dst.hub.accepted, src.src_name, endpoint.group),
    )


async def bounce(
    a: Instance, b: Instance, rid: str, config: StageConfig, rounds: int
) -> tuple[list[MigrationOutcome], list[float], Instance]:
    """Migrate `rid` back and forth `rounds` times, letting it decode a token in between.

    Returns the outcomes, each migration's token stall (last token on the source to first token
    on the destination) and the instance the request ends on."""
    outcomes, stalls = [], []
    src, dst = a, b
    for _ in range(rounds):
        outcomes.append(await migrate(src, dst, rid, config))
        last_src = src.thread.token_times[rid][-1]
        have = len(dst.thread.token_times.get(rid, []))
        await wait_for(lambda dst=dst, have=have: len(dst.thread.token_times.get(rid, [])) > have)
        stalls.append(dst.thread.token_times[rid][have] - last_src)
        src, dst = dst, src
    return outcomes, stalls, src


async def measure_context(
    a: Instance, b: Instance, length: int, seed: int, rounds: int
) -> dict[str, Any]:
    rid = f"ctx{length}"
    await start_decoding(a, rid, prompt(length, seed), max_tokens=MAX_DECODE)
    tbt = statistics.median(token_gaps(a.thread.token_times[rid])[1:])
    multi, stalls, at = await bounce(a, b, rid, MULTI_STAGE, rounds)
    blocking, _, at = await bounce(at, a if at is b else b, rid, BLOCKING, max(1, rounds // 2))
    await at.thread.run(_aborter(rid))
    # Recompute: the destination prefills as many tokens, from scratch (fresh tokens: no hits).
    fresh = prompt(length + DECODE_BEFORE, seed + 10_000)
    started = time.perf_counter()
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    await b.thread.run(lambda e: e.add_request(f"re{length}", fresh, params))
    await wait_for(lambda: f"re{length}" in b.thread.finish_reasons)
    recompute_s = b.thread.token_times[f"re{length}"][0] - started
    await b.thread.run(_aborter(f"re{length}"))
    return {
        "context": length,
        "multi_stage": outcome_row(multi),
        "blocking": outcome_row(blocking),
        "recompute_s": recompute_s,
        "multi_stage_token_stall_s": statistics.median(stalls),
        "median_tbt_s": tbt,
    }


def outcome_row(outcomes: list[MigrationOutcome]) -> dict[str, Any]:
    """Medians over repeated migrations of one request (downtimes listed too)."""
    return {
        "downtime_s": statistics.median(o.downtime_s for o in outcomes),
        "downtimes_s": [o.downtime_s for o in outcomes],
        "duration_s": statistics.median(o.duration_s for o in outcomes),
        "stages": statistics.median_low(o.stages for o in outcomes),
        "blocks_sent": statistics.median_low(o.blocks_sent for o in outcomes),
        "blocks_skipped": statistics.median_low(o.blocks_skipped for o in outcomes),
        "bytes_sent": statistics.median_low(o.bytes_sent for o in outcomes),
        "bytes_skipped": statistics.median_low(o.bytes_skipped for o in outcomes),
    }


async def measure_cache_aware(a: Instance, b: Instance, prefix_len: int) -> dict[str, Any]:
    prefix = prompt(prefix_len, 7)
    # b served a request with this prefix: its blocks are in b's prefix cache.
    warm = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    await b.thread.run(lambda e: e.add_request("warm", prefix + prompt(64, 8), warm))
    await wait_for(lambda: "warm" in b.thread.finish_reasons)
    rows = {}
    for seed, (name, config) in enumerate(
        (("without", MULTI_STAGE), ("with", dataclasses.replace(MULTI_STAGE, cache_aware=True)))
    ):
        rid = f"shared-{name}"
        await start_decoding(a, rid, prefix + prompt(256, 20 + seed), max_tokens=64)
        rows[name] = outcome_row([await migrate(a, b, rid, config)])
        await b.thread.run(_aborter(rid))
    return {"prefix": prefix_len, **rows}


def _aborter(request_id: str) -> Any:
    def abort(engine: LLMEngine) -> None:
        engine.abort(request_id)

    return abort


def raw_gloo_rate(nbytes: int, repeats: int = 5) -> float:
    """Bytes per second of one plain gloo send of `nbytes` between two ranks of a fresh pair group
    (preallocated tensors, one message, no chunking): the transport's ceiling here."""
    timeout = timedelta(seconds=60)
    master = dist.TCPStore("127.0.0.1", 0, None, True, timeout, wait_for_workers=False)
    # One store connection per rank: a blocking wait on a shared connection would stall the other.
    stores = [dist.TCPStore("127.0.0.1", master.port, None, False, timeout), master]
    groups: dict[int, Any] = {}

    def join(rank: int) -> None:
        store = dist.PrefixStore("raw", stores[rank])
        groups[rank] = dist.ProcessGroupGloo(store, rank, 2, timeout)

    joiner = threading.Thread(target=join, args=(1,))
    joiner.start()
    join(0)
    joiner.join()
    payload = torch.ones(nbytes, dtype=torch.uint8)
    sink = torch.empty(nbytes, dtype=torch.uint8)
    sink.fill_(0)  # touch the pages once, as the engine's KV cache is
    times = []
    for _ in range(repeats):
        receiver = threading.Thread(target=lambda: groups[1].recv([sink], 0, 0).wait())
        started = time.perf_counter()
        receiver.start()
        groups[0].send([payload], 1, 0).wait()
        receiver.join()
        times.append(time.perf_counter() - started)
    return nbytes / statistics.median(times)


async def run(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(1)
    contexts = [int(c) for c in args.contexts.split(",")]
    max_len = max(max(contexts), args.prefix + 256) + MAX_DECODE + 64
    preset = f"{args.preset}-{max_len}"
    PRESETS[preset] = dataclasses.replace(PRESETS[args.preset], max_position_embeddings=max_len)
    num_blocks = 3 * (max_len // BLOCK_SIZE) + 64
    a = make_instance("a", preset, max_len, num_blocks)
    b = make_instance("b", preset, max_len, num_blocks)
    try:
        await warm_pair(a, b)
        await warm_pair(b, a)
        per_context = []
        for i, length in enumerate(contexts):
            per_context.append(await measure_context(a, b, length, 100 + i, args.rounds))
            row = per_context[-1]
            print(
                f"  {length:>5} tokens: multi-stage {row['multi_stage']['downtime_s'] * 1e3:.1f} ms, "
                f"blocking {row['blocking']['downtime_s'] * 1e3:.1f} ms, "
                f"recompute {row['recompute_s'] * 1e3:.1f} ms",
                flush=True,
            )
        cache = await measure_cache_aware(a, b, args.prefix)
        longest = per_context[-1]
        moved = longest["blocking"]["bytes_sent"]
        raw = raw_gloo_rate(moved)
        for inst in (a, b):
            inst.engine.block_manager.check_integrity()
        return {
            "preset": args.preset,
            "block_size": BLOCK_SIZE,
            "contexts": per_context,
            "cache_aware": cache,
            "transfer": {
                "bytes": moved,
                "kvherd_rate_Bps": moved / longest["blocking"]["downtime_s"],
                "raw_gloo_rate_Bps": raw,
            },
        }
    finally:
        a.close()
        b.close()


def report(result: dict[str, Any]) -> None:
    print(f"\nLive migration, preset {result['preset']}, block size {result['block_size']}")
    header = (
        f"{'context':>8} {'kvherd ms':>10} {'stages':>6} {'blocking ms':>12} {'recompute ms':>13}"
        f" {'recompute/kvherd':>17} {'stall ms':>9} {'TBT ms':>7}"
    )
    print(header)
    for row in result["contexts"]:
        multi, blocking = row["multi_stage"], row["blocking"]
        print(
            f"{row['context']:>8} {multi['downtime_s'] * 1e3:>10.1f} {multi['stages']:>6} "
            f"{blocking['downtime_s'] * 1e3:>12.1f} {row['recompute_s'] * 1e3:>13.1f} "
            f"{row['recompute_s'] / multi['downtime_s']:>16.1f}x "
            f"{row['multi_stage_token_stall_s'] * 1e3:>9.1f} {row['median_tbt_s'] * 1e3:>7.1f}"
        )
    rows = result["contexts"]
    flat = rows[-1]["multi_stage"]["downtime_s"] / rows[0]["multi_stage"]["downtime_s"]
    print(
        f"kvherd downtime {rows[-1]['context']}/{rows[0]['context']} tokens: {flat:.2f}x "
        f"(target <= 1.5); blocking: "
        f"{rows[-1]['blocking']['downtime_s'] / rows[0]['blocking']['downtime_s']:.1f}x"
    )
    cache = result["cache_aware"]
    without, with_ = cache["without"], cache["with"]
    print(
        f"cache-aware ({cache['prefix']}-token shared prefix + 256): "
        f"bytes sent {with_['bytes_sent'] / 2**20:.1f} MiB "
        f"vs {without['bytes_sent'] / 2**20:.1f} MiB without "
        f"({without['bytes_sent'] / max(with_['bytes_sent'], 1):.1f}x less, "
        f"{with_['blocks_skipped']} blocks shared)"
    )
    transfer = result["transfer"]
    ratio = transfer["kvherd_rate_Bps"] / transfer["raw_gloo_rate_Bps"]
    print(
        f"transfer rate ({transfer['bytes'] / 2**20:.0f} MiB): kvherd blocking copy "
        f"{transfer['kvherd_rate_Bps'] / 1e9:.2f} GB/s vs raw gloo "
        f"{transfer['raw_gloo_rate_Bps'] / 1e9:.2f} GB/s ({ratio:.0%}, target >= 50%)"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="small", choices=sorted(PRESETS))
    parser.add_argument("--contexts", default="256,1024,2048,4096,8192")
    parser.add_argument("--prefix", type=int, default=4096, help="shared prefix for (b)")
    parser.add_argument("--rounds", type=int, default=6, help="migrations per context (medians)")
    parser.add_argument("--json", default=None, help="also write the figures here")
    args = parser.parse_args()
    result = asyncio.run(run(args))
    report(result)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
