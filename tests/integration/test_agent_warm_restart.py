"""Warm restart: a real agent's disk KV tier outlives the process (SIGTERM, start again, same dir).

Six 64-token prefixes through a GPU pool of 8 blocks and a CPU tier of 4 push the first three to
disk. Restarted on the same folder, the agent announces those blocks as ``STORAGE`` (its replay
buffer holds them, so a prefix index learns them before any request) and serves the prompts from
disk with the same greedy tokens. Restarted with another block size, it discards the file's
contents with a WARNING and still answers the same.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import httpx
import zmq

from instance_agent.kv_publisher import END_SEQ
from kvherd.block_hash import block_hash_chain
from kvherd.kv_events import MEDIUM_STORAGE, BlockStored, KVEventBatch, decode_batch
from scheduler.core.prefix_index import PrefixIndex
from tests.support.agent_process import agent_process

BLOCK = 16


def tiers(folder: Path, block_size: int = BLOCK) -> tuple[str, ...]:
    return (
        *("--instance-id", "warm", "--seed", "0", "--block-size", str(block_size)),
        *("--num-gpu-blocks", str(8 * BLOCK // block_size), "--num-cpu-blocks", "4"),
        *("--disk-kv-dir", str(folder), "--num-disk-blocks", "32"),
    )


def prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(256) for _ in range(n)]


HEADS = [prompt(64, seed) for seed in range(6)]
PROMPTS = [head + prompt(5, 100 + n) for n, head in enumerate(HEADS)]


def complete(url: str, ids: list[int]) -> tuple[dict[str, Any], int]:
    body = {"prompt": ids, "max_tokens": 8, "temperature": 0.0, "ignore_eos": True}
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    data = response.json()
    return data["choices"][0], data["usage"]["prompt_tokens_details"]["cached_tokens"]


def replay(endpoint: str) -> list[KVEventBatch]:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.connect(endpoint)
    try:
        sock.send_multipart([b"", (0).to_bytes(8, "big")])
        batches = []
        while True:
            assert sock.poll(10_000), "replay did not answer"
            _, _, seq, payload = sock.recv_multipart()
            if seq == END_SEQ:
                return batches
            batches.append(decode_batch(int.from_bytes(seq, "big"), payload))
    finally:
        sock.close(linger=0)
        ctx.term()


def test_a_restarted_agent_serves_its_disk_tier_and_another_block_size_discards_it(
    tmp_path: Path,
) -> None:
    with agent_process(*tiers(tmp_path)) as agent:
        first = [complete(agent.url, ids) for ids in PROMPTS]
        assert agent.terminate() == 0
    assert [cached for _, cached in first] == [0] * 6

    with agent_process(*tiers(tmp_path), kv_events=True) as agent:
        assert agent.replay_endpoint is not None
        announced = replay(agent.replay_endpoint)  # before any request
        again = [complete(agent.url, ids) for ids in PROMPTS[:2]]
        log = agent.log()
        assert agent.terminate() == 0
    stores = [e for batch in announced for e in batch.events]
    assert all(isinstance(e, BlockStored) and e.medium == MEDIUM_STORAGE for e in stores)
    held = [h for e in stores for h in e.block_hashes]
    assert f"restored {len(held)} blocks of the disk KV tier" in log
    heads = [block_hash_chain(head, BLOCK) for head in HEADS[:2]]
    assert set(heads[0] + heads[1]) <= set(held)
    index = PrefixIndex(BLOCK)  # what a proxy learns from the replay alone
    index.add_instance("warm", next_seq=0)
    for batch in announced:
        assert index.apply_batch("warm", batch).applied
    assert [index.match_tiers(chain) for chain in heads] == [{"warm": [0, 0, 4]}] * 2
    # Served from disk, token for token what the first process answered.
    assert [cached for _, cached in again] == [64, 64]
    assert [choice for choice, _ in again] == [choice for choice, _ in first[:2]]

    with agent_process(*tiers(tmp_path, block_size=8), kv_events=True) as agent:
        assert agent.replay_endpoint is not None
        assert replay(agent.replay_endpoint) == []
        choice, cached = complete(agent.url, PROMPTS[2])  # was on disk, under 16-token blocks
        log = agent.log()
    assert "WARNING" in log and "discarding the disk KV tier" in log
    assert "block_size 16 (now 8)" in log
    assert cached == 0 and choice == first[2][0]
