"""Tier-tagged KV events, byte for byte as vLLM 0.32's own encoder writes them.

The engine core with a CPU and a disk tier moves blocks down (GPU -> CPU -> STORAGE, then out) and
loads them back; every event it emits, batched as the agent batches them, is encoded by kvherd
and by vLLM's `KVEventBatch` + msgspec encoder (``tests/support/vllm_kv_encode.py`` under
``$KVHERD_VLLM_PYTHON``): the payloads must be identical, and kvherd decodes vLLM's back to the
same events.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

from instance_agent.engine.core.batch_scheduler import BatchScheduler, SchedulerConfig
from instance_agent.engine.core.block_manager import BlockManager
from instance_agent.engine.core.request import Request, SamplingParams
from instance_agent.engine.core.tiers import TierConfig, TierStore
from kvherd.kv_events import (
    MEDIUM_CPU,
    MEDIUM_GPU,
    MEDIUM_STORAGE,
    BlockRemoved,
    BlockStored,
    KVEvent,
    KVEventBatch,
    decode_batch,
    encode_batch,
)

ENCODER = Path(__file__).resolve().parent.parent / "support" / "vllm_kv_encode.py"
BLOCK = 4


def tier_event_batches() -> list[KVEventBatch]:
    """One batch per engine step of a pool of 4 blocks over CPU 2 / disk 2, four prompts, then
    the first prompt again (its blocks come back from the tiers)."""
    tiers = TierStore([TierConfig(MEDIUM_CPU, 2), TierConfig(MEDIUM_STORAGE, 2)], BLOCK)
    bm = BlockManager(4, BLOCK, watermark=0.0, tiers=tiers)
    sched = BatchScheduler(SchedulerConfig(max_model_len=64), bm)
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    prompts = [[base + i for i in range(13)] for base in (1, 101, 201, 301, 401)]
    prompts.append(prompts[3])
    batches = []
    for n, prompt in enumerate(prompts):
        sched.add_request(
            Request(f"r{n}", prompt, params, BLOCK, cache_salt="s" if n == 4 else None)
        )
        while sched.has_unfinished():
            out = sched.schedule()
            bm.take_offloads()
            sched.update_from_output(
                out, {s.request.request_id: 7 for s in out.scheduled if s.samples}
            )
            for load in out.loads:
                sched.finish_load(load.request_id)
            events = bm.take_events()
            if events:
                batches.append(KVEventBatch(len(batches), 1000.0 + len(batches) / 8, events, 0))
    return batches


def vllm_fields(event: KVEvent) -> dict[str, Any]:
    if isinstance(event, BlockStored):
        return {
            "type": "BlockStored",
            "block_hashes": event.block_hashes,
            "parent_block_hash": event.parent_block_hash,
            "token_ids": event.token_ids,
            "block_size": event.block_size,
            "lora_id": event.lora_id,
            "medium": event.medium,
            "lora_name": event.lora_name,
        }
    if isinstance(event, BlockRemoved):
        return {"type": "BlockRemoved", "block_hashes": event.block_hashes, "medium": event.medium}
    return {"type": "AllBlocksCleared"}


def test_tier_events_are_byte_identical_to_vllms_encoder(vllm_python: str) -> None:
    batches = tier_event_batches()
    events = [e for b in batches for e in b.events]
    media = {(type(e).__name__, getattr(e, "medium", None)) for e in events}
    assert media == {
        (kind, medium)
        for kind in ("BlockStored", "BlockRemoved")
        for medium in (MEDIUM_GPU, MEDIUM_CPU, MEDIUM_STORAGE)
    }  # every move: stored on and removed from each tier
    lines = [
        json.dumps({"ts": b.ts, "dp_rank": b.dp_rank, "events": [vllm_fields(e) for e in b.events]})
        for b in batches
    ]
    result = subprocess.run(
        [vllm_python, str(ENCODER)],
        input="\n".join(lines) + "\n",
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    theirs = [bytes.fromhex(h) for h in result.stdout.split()]
    assert len(theirs) == len(batches)
    for batch, payload in zip(batches, theirs, strict=True):
        assert encode_batch(batch) == payload
        assert decode_batch(batch.seq, payload) == batch
