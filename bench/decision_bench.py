"""The routing decision's cost per prompt block, in front of two instances fed as vLLM feeds them.

What it does: two event-publishing instances (`ClusterState`, kvherd policy, `Router`), each
holding the prefixes of `--conversations` shared conversations, stored as vLLM's KV events store
them (one `BlockStored` per scheduler step: engine hashes of vLLM's own, so every block is
re-hashed; each batch chained on its parent block; a prompt's decode blocks after it); then each
prompt of `--blocks` blocks (a cached conversation prefix, then new text) is routed end to end:
``Router.route`` from token ids (block hashing, the view, the prefix match, the policy, the
charge and the approximate-index record) and finished, one after another, as the proxy does.
It prints the thread CPU per decision for each block size and prompt length, and the cost per
block (the slope between the shortest and the longest prompt); ``--profile`` adds a cProfile of
the longest prompts' decisions.

    python bench/decision_bench.py                        # block sizes 16 and 128
    python bench/decision_bench.py --profile --block-size 16
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import random
import statistics
import time

from kvherd.block_hash import block_hash_chain
from kvherd.kv_events import BlockStored, KVEventBatch
from policies import load_dispatch_policy
from scheduler.core.cluster_state import ClusterState
from scheduler.core.load_report import LoadReport
from scheduler.core.router import Router

INSTANCES = ("vllm-a", "vllm-b")


def fill(cluster: ClusterState, block_size: int, docs: list[list[int]], seed: int) -> None:
    """Each instance stores a random half of each document's prefix, step by step, as vLLM does."""
    rng = random.Random(seed)
    for k, instance_id in enumerate(INSTANCES):
        seq = 0
        for doc in docs:
            if rng.random() < 0.5:
                continue
            keep = rng.randrange(len(doc) // 2, len(doc)) // block_size * block_size
            tokens = doc[:keep]
            engine = block_hash_chain(tokens, block_size, cache_salt=f"engine-{k}")
            parent = None
            at = 0
            while at < len(engine):  # a chunked prefill: up to 8 blocks a step
                step = min(len(engine) - at, rng.randrange(1, 9))
                stored = BlockStored(
                    engine[at : at + step],
                    parent,
                    tokens[at * block_size : (at + step) * block_size],
                    block_size,
                )
                cluster.apply_kv_batch(instance_id, KVEventBatch(seq, 0.0, [stored]))
                seq += 1
                parent = engine[at + step - 1]
                at += step


def build(block_size: int, args: argparse.Namespace) -> tuple[Router, list[list[int]]]:
    rng = random.Random(args.seed)
    length = args.max_blocks * block_size * 2
    docs = [[rng.randrange(50000) for _ in range(length)] for _ in range(args.conversations)]
    cluster = ClusterState(block_size=block_size)
    for instance_id in INSTANCES:
        cluster.add_instance(instance_id, has_kv_events=True)
        cluster.apply_report(
            instance_id,
            LoadReport(
                num_running=rng.randrange(0, 16),
                num_waiting=rng.randrange(0, 4),
                num_total_blocks=8192,
                num_free_blocks=rng.randrange(0, 8192),
                waiting_prefill_tokens=rng.randrange(0, 4096),
            ),
            now=0.0,
        )
    fill(cluster, block_size, docs, args.seed)
    return Router(cluster, load_dispatch_policy("kvherd")), docs


def prompts(docs: list[list[int]], blocks: int, block_size: int, count: int, seed: int) -> list:
    """`count` prompts of `blocks` full blocks plus half a block: a document prefix, then new text."""
    rng = random.Random(seed)
    length = blocks * block_size + block_size // 2
    out = []
    for _ in range(count):
        doc = docs[rng.randrange(len(docs))]
        keep = rng.randrange(length // 2, length)
        out.append(doc[:keep] + [rng.randrange(50000) for _ in range(length - keep)])
    return out


def run(router: Router, batch: list[list[int]], tag: str) -> list[float]:
    """Thread CPU seconds per decision (route, then finish: the load stays put)."""
    cpu = []
    now = 1.0
    for k, tokens in enumerate(batch):
        rid = f"{tag}-{k}"
        start = time.thread_time()
        router.route(rid, tokens, now=now)
        cpu.append(time.thread_time() - start)
        router.on_finish(rid, now=now)
        now += 0.4  # 2.6 req/s: pending approximate entries expire as in the proxy
    return cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--block-size", type=int, action="append")
    parser.add_argument("--blocks", type=int, action="append", help="prompt blocks (repeatable)")
    parser.add_argument("--max-blocks", type=int, default=400)
    parser.add_argument("--conversations", type=int, default=64)
    parser.add_argument("--queries", type=int, default=300)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    sizes = args.block_size or [16, 128]
    lengths = sorted(args.blocks or [1, 10, 100, 400])
    args.max_blocks = max(args.max_blocks, lengths[-1])
    print(f"{'block size':>10} {'blocks':>7} {'mean us':>9} {'p50 us':>9} {'p99 us':>9}")
    for block_size in sizes:
        router, docs = build(block_size, args)
        means = {}
        for blocks in lengths:
            batch = prompts(docs, blocks, block_size, args.queries, args.seed + blocks)
            run(router, batch[:20], f"warm{blocks}")
            cpu = sorted(run(router, batch, f"b{blocks}"))
            means[blocks] = statistics.fmean(cpu)
            print(
                f"{block_size:>10} {blocks:>7} {1e6 * means[blocks]:>9.1f} "
                f"{1e6 * cpu[len(cpu) // 2]:>9.1f} {1e6 * cpu[int(0.99 * len(cpu))]:>9.1f}"
            )
        if len(lengths) > 1:
            slope = (means[lengths[-1]] - means[lengths[0]]) / (lengths[-1] - lengths[0])
            print(f"{block_size:>10} {'per block':>7} {1e6 * slope:>9.2f}")
        if args.profile:
            batch = prompts(docs, lengths[-1], block_size, args.queries, args.seed + 7)
            profiler = cProfile.Profile()
            profiler.enable()
            run(router, batch, "profile")
            profiler.disable()
            pstats.Stats(profiler).sort_stats("tottime").print_stats(15)


if __name__ == "__main__":
    main()
