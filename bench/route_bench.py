"""Routing-decision latency of the scheduler core at fleet scale, with a naive baseline.

Builds a precise prefix index over `--instances` instances holding `--blocks` indexed blocks in
total (fed as real KV events, re-hashed), then times `Router.route` end to end — block hashing of
the prompt, the cluster view, the prefix match and the policy — for 2k- and 32k-token prompts.
Prompts reuse cached documents, so matches run deep (the walk's worst case). Side by side, from the
same run: the same route with `round_robin` (hashing and views, no prefix use), and the baseline
prefix match a naive router does (scan every instance's block set), on a sample of the prompts.
Memory: bytes per indexed block of the precise index, measured with tracemalloc while it is built.
Times are wall-clock and thread CPU time; on a shared machine the CPU column is the one to read.

    python bench/route_bench.py                      # 1,024 instances, 1M blocks (~1-2 min)
    python bench/route_bench.py --instances 64 --blocks 50000 --queries 50   # quick
"""

from __future__ import annotations

import argparse
import gc
import random
import resource
import statistics
import time
import tracemalloc
from collections.abc import Sequence

from kvherd.block_hash import block_hash_chain
from kvherd.kv_events import BlockStored
from policies import load_dispatch_policy
from scheduler.core.cluster_state import ClusterState
from scheduler.core.load_report import LoadReport
from scheduler.core.router import Router

BLOCK_SIZE = 16


def build(
    args: argparse.Namespace, trace_memory: bool = True
) -> tuple[ClusterState, list[list[int]], int, int]:
    """The fleet; returns (cluster, documents, index bytes, indexed blocks). Index bytes are
    traced allocations, or without `trace_memory` (tracing costs a few times the build's time and
    memory) the RSS growth while the index fills: an upper bound, transient event lists included."""
    rng = random.Random(args.seed)
    doc_blocks = 2048  # documents are 32k tokens, so the longest prompts can match in full
    documents = [
        [rng.randrange(32000) for _ in range(doc_blocks * BLOCK_SIZE)]
        for _ in range(args.documents)
    ]
    per_instance = args.blocks // args.instances
    cluster = ClusterState(block_size=BLOCK_SIZE, max_blocks_total=max(1 << 22, 2 * args.blocks))
    for k in range(args.instances):
        cluster.add_instance(f"inst-{k:04d}", has_kv_events=True)
        cluster.apply_report(
            f"inst-{k:04d}",
            LoadReport(
                num_running=rng.randrange(0, 32),
                num_waiting=rng.randrange(0, 4),
                num_total_blocks=8192,
                num_free_blocks=rng.randrange(0, 8192),
                waiting_prefill_tokens=rng.randrange(0, 8192),
            ),
            now=0.0,
        )
    gc.collect()
    if trace_memory:
        tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0] if trace_memory else rss_bytes()
    for k in range(args.instances):
        # Half the instance's blocks: a prefix of a shared document; half: its own conversations.
        shared = rng.randrange(0, per_instance + 1)
        doc = documents[rng.randrange(len(documents))]
        own = [rng.randrange(32000) for _ in range((per_instance - shared) * BLOCK_SIZE)]
        events = []
        for tokens in (doc[: shared * BLOCK_SIZE], own):
            # Engine hashes differ from kvherd's (another seed), so every block is re-hashed.
            engine = block_hash_chain(tokens, BLOCK_SIZE, cache_salt="engine")
            events.append(BlockStored(engine, None, tokens, BLOCK_SIZE))
        cluster.apply_kv_events(f"inst-{k:04d}", events)
    after = tracemalloc.get_traced_memory()[0] if trace_memory else rss_bytes()
    tracemalloc.stop()
    return cluster, documents, after - before, cluster.prefix_index.num_blocks()


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def prompts(documents: list[list[int]], length: int, count: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        doc = documents[rng.randrange(len(documents))]
        keep = rng.randrange(length // 2, length)  # a cached document prefix, then new text
        out.append(doc[:keep] + [rng.randrange(32000) for _ in range(length - keep)])
    return out


def time_routes(
    router: Router, batch: Sequence[list[int]], tag: str
) -> tuple[list[float], list[float]]:
    """Wall-clock and this thread's CPU time per decision (CPU time is immune to other
    processes taking the core, which on a shared machine dominates the wall-clock tail)."""
    wall, cpu = [], []
    now = 1.0
    for k, tokens in enumerate(batch):
        rid = f"{tag}-{k}"
        start, start_cpu = time.perf_counter(), time.thread_time()
        router.route(rid, tokens, now=now)
        cpu.append(time.thread_time() - start_cpu)
        wall.append(time.perf_counter() - start)
        router.on_finish(rid, now=now)  # keep the load steady across samples
        now += 0.001
    return wall, cpu


def naive_match(cluster: ClusterState, chain: Sequence[int]) -> dict[str, int]:
    """What a router without a hash->instances map does: test every instance's block set."""
    found = {}
    for instance_id in cluster.instances:
        held = cluster.prefix_index.blocks(instance_id)
        depth = 0
        while depth < len(chain) and chain[depth] in held:
            depth += 1
        if depth:
            found[instance_id] = depth
    return found


def ms(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return 1e3 * ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--instances", type=int, default=1024)
    parser.add_argument("--blocks", type=int, default=1_000_000)
    parser.add_argument("--documents", type=int, default=64)
    parser.add_argument("--queries", type=int, default=300)
    parser.add_argument("--baseline-queries", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    t0 = time.perf_counter()
    cluster, documents, traced, indexed = build(args)
    print(
        f"index: {args.instances} instances, {indexed:,} indexed blocks, "
        f"{len(cluster.prefix_index.owners):,} distinct; built in "
        f"{time.perf_counter() - t0:.1f} s (under tracemalloc)"
    )
    print(
        f"index memory: {traced / indexed:.0f} bytes per indexed block ({traced / 2**20:.0f} MiB)"
    )
    # Long-lived objects (the fleet) leave the cyclic GC's generations, as `kvherd serve` does
    # after start-up. The index's own dicts (ints to ints) are not tracked by the GC at all.
    gc.freeze()
    collections_before = sum(gen["collections"] for gen in gc.get_stats())
    kvherd = Router(cluster, load_dispatch_policy("kvherd"))
    rr = Router(cluster, load_dispatch_policy("round_robin"))
    print()
    print(f"{'':>8} {'':>26} {'wall-clock':^26} {'thread CPU':^17}")
    head = f"{'p50 ms':>8} {'p99 ms':>8}"
    print(f"{'prompt':>8} {'router':>26} {head} {'mean ms':>8} {head}")
    for length in (2048, 32768):
        batch = prompts(documents, length, args.queries, args.seed + length)
        time_routes(kvherd, batch[:10], "warm")
        rows = {
            "kvherd (hash+match+policy)": time_routes(kvherd, batch, f"k{length}"),
            "round_robin (hash+view)": time_routes(rr, batch, f"r{length}"),
        }
        naive_wall, naive_cpu = [], []
        for tokens in batch[: args.baseline_queries]:
            chain = block_hash_chain(tokens, BLOCK_SIZE)
            start, start_cpu = time.perf_counter(), time.thread_time()
            naive_match(cluster, chain)
            naive_cpu.append(time.thread_time() - start_cpu)
            naive_wall.append(time.perf_counter() - start)
        rows["naive scan (match only)"] = (naive_wall, naive_cpu)
        for name, (wall, cpu) in rows.items():
            print(
                f"{length:>8} {name:>26} {ms(wall, 0.5):>8.3f} {ms(wall, 0.99):>8.3f} "
                f"{1e3 * statistics.fmean(wall):>8.3f} {ms(cpu, 0.5):>8.3f} {ms(cpu, 0.99):>8.3f}"
            )
        kv_wall = rows["kvherd (hash+match+policy)"][0]
        ratio = statistics.median(naive_wall) / statistics.median(kv_wall)
        print(f"{'':>8} {'naive / kvherd (median)':>26} {ratio:>8.1f}x")
    collections = sum(gen["collections"] for gen in gc.get_stats()) - collections_before
    print(f"\ncyclic GC collections during the timed decisions and baselines: {collections}")


if __name__ == "__main__":
    main()
