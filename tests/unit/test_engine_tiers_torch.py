"""KV tiers in the real engine (tiny random model, CPU, fp32): blocks really go down and come back.

The working set (a few long shared prefixes revisited) is several times the GPU pool, so without
tiers the prefixes are recomputed, with them they load back from host memory or the disk file;
either way every request's tokens, greedy and seeded, are bit-identical.
"""

from __future__ import annotations

import json
import logging
import random
from pathlib import Path

import pytest
import torch

from instance_agent.engine.core.batch_scheduler import KVLoad
from instance_agent.engine.core.request import SamplingParams
from instance_agent.engine.core.tiers import BlockCopy
from instance_agent.engine.kv_tiers import TierBuffers, _groups
from instance_agent.engine.llm_engine import EngineConfig, LLMEngine, RequestOutput
from kvherd.kv_events import MEDIUM_CPU, MEDIUM_GPU, MEDIUM_STORAGE, BlockStored, KVEventBatch

BLOCK = 16


def prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(256) for _ in range(n)]


def workload() -> list[tuple[str, list[int], SamplingParams]]:
    """Four 64-token prefixes (4 blocks each), each revisited after the others pushed it out."""
    heads = [prompt(64, seed) for seed in range(4)]
    requests = []
    for round_ in range(3):
        for n, head in enumerate(heads):
            params = (
                SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
                if n % 2
                else SamplingParams(max_tokens=6, temperature=0.9, seed=round_ * 10 + n)
            )
            requests.append((f"r{round_}-{n}", head + prompt(5, 100 + round_ * 4 + n), params))
    return requests


def run(
    engine: LLMEngine, requests: list[tuple[str, list[int], SamplingParams]] | None = None
) -> dict[str, RequestOutput]:
    final: dict[str, RequestOutput] = {}
    for rid, ids, params in requests or workload():  # one at a time: the pool holds one prompt
        engine.add_request(rid, ids, params)
        while engine.has_unfinished():
            for out in engine.step():
                if out.finished:
                    final[out.request_id] = out
            engine.block_manager.check_integrity()
    engine.close()
    return final


def engine(**tiers: object) -> LLMEngine:
    config = EngineConfig(model="tiny", device="cpu", num_gpu_blocks=8, watermark=0.0, **tiers)  # type: ignore[arg-type]
    return LLMEngine(config)


def test_outputs_are_bit_identical_with_tiers_and_the_prefixes_come_back(tmp_path: Path) -> None:
    plain = engine()
    baseline = run(plain)
    cpu = engine(num_cpu_blocks=32)
    with_cpu = run(cpu)
    disk = engine(num_cpu_blocks=4, disk_kv_file=str(tmp_path / "kv.bin"), num_disk_blocks=32)
    with_disk = run(disk)
    for outputs in (with_cpu, with_disk):
        assert {r: o.output_token_ids for r, o in outputs.items()} == {
            r: o.output_token_ids for r, o in baseline.items()
        }
    # Without tiers every revisit recomputes its prefix; with them rounds 2 and 3 load 4 blocks.
    assert all(o.num_cached_tokens == 0 for o in baseline.values())
    for outputs in (with_cpu, with_disk):
        revisits = [o for r, o in outputs.items() if not r.startswith("r0-")]
        assert [o.num_cached_tokens for o in revisits] == [64] * 8
    assert cpu.num_computed_tokens_total < plain.num_computed_tokens_total - 8 * 60
    assert cpu.tier_buffers is not None and disk.tier_buffers is not None
    assert cpu.tier_buffers.stats()[MEDIUM_CPU].load_blocks == 32
    disk_stats = disk.tier_buffers.stats()
    assert (
        disk_stats[MEDIUM_STORAGE].load_blocks > 0 and disk_stats[MEDIUM_STORAGE].offload_blocks > 0
    )
    assert (tmp_path / "kv.bin").stat().st_size == 32 * disk.tier_buffers.bytes_per_block


def test_copies_group_into_indexed_runs_that_keep_their_order() -> None:
    g2c = [BlockCopy(MEDIUM_GPU, b, MEDIUM_CPU, s) for b, s in ((1, 0), (2, 1))]
    c2d = BlockCopy(MEDIUM_CPU, 0, MEDIUM_STORAGE, 5)
    again = BlockCopy(MEDIUM_GPU, 3, MEDIUM_CPU, 0)  # slot 0 reused after it went down
    assert _groups([*g2c, c2d, again, BlockCopy(MEDIUM_GPU, 4, MEDIUM_CPU, 0)]) == [
        g2c,
        [c2d],
        [again],
        [BlockCopy(MEDIUM_GPU, 4, MEDIUM_CPU, 0)],
    ]


def test_round_trip_through_both_tiers_is_exact(tmp_path: Path) -> None:
    cache = torch.randn(2, 2, 6, 4, 2, 8)
    buffers = TierBuffers(cache, 2, tmp_path / "kv.bin", 2)
    original = cache.clone()
    buffers.offload(
        [
            BlockCopy(MEDIUM_GPU, 1, MEDIUM_CPU, 0),
            BlockCopy(MEDIUM_CPU, 0, MEDIUM_STORAGE, 1),
            BlockCopy(MEDIUM_GPU, 4, MEDIUM_CPU, 0),
        ]
    )
    cache.zero_()
    buffers.start_load(
        KVLoad(
            "r",
            [BlockCopy(MEDIUM_STORAGE, 1, MEDIUM_GPU, 2), BlockCopy(MEDIUM_CPU, 0, MEDIUM_GPU, 3)],
            8,
        )
    )
    buffers.wait(10.0)
    assert buffers.landed() == [("r", True)]
    assert torch.equal(cache[:, :, 2], original[:, :, 1])
    assert torch.equal(cache[:, :, 3], original[:, :, 4])
    buffers.close()
    # The file keeps what was written (the mapping is shared): a new mapping reads it back.
    reopened = TierBuffers(torch.zeros_like(original), 0, tmp_path / "kv.bin", 2)
    assert torch.equal(reopened.stores[MEDIUM_STORAGE][1], original[:, :, 1])
    reopened.close()


def test_a_load_that_raises_lands_not_ok() -> None:
    buffers = TierBuffers(torch.zeros(1, 2, 2, 4, 1, 4), 1)
    buffers.start_load(KVLoad("r", [BlockCopy(MEDIUM_CPU, 0, MEDIUM_GPU, 99)], 4))
    buffers.wait(10.0)
    assert buffers.landed() == [("r", False)]
    buffers.close()


def test_a_disk_tier_needs_a_file() -> None:
    with pytest.raises(ValueError, match="file"):
        engine(num_disk_blocks=4)


# -- warm restart ----------------------------------------------------------------------------


def disk_engine(path: Path, **overrides: object) -> LLMEngine:
    return engine(num_disk_blocks=32, disk_kv_file=str(path / "kv.bin"), **overrides)


def storage_stores(batch: KVEventBatch | None) -> list[int]:
    assert batch is not None
    assert all(isinstance(e, BlockStored) and e.medium == MEDIUM_STORAGE for e in batch.events)
    return [h for e in batch.events for h in e.block_hashes]  # type: ignore[union-attr]


def test_the_disk_tier_outlives_the_engine_and_serves_the_same_tokens(tmp_path: Path) -> None:
    first = disk_engine(tmp_path)
    before = run(first, workload()[:4])  # closes it: the manifest is written
    assert first.block_manager.tiers is not None
    held = first.block_manager.tiers.block_hashes()[MEDIUM_STORAGE]
    manifest = json.loads((tmp_path / "kv.json").read_text())
    assert (manifest["block_size"], manifest["model"], len(manifest["slots"])) == (
        16,
        "tiny",
        len(held),
    )
    again = disk_engine(tmp_path)
    assert sorted(storage_stores(again.take_kv_event_batch())) == sorted(held)
    rid, ids, params = workload()[1]  # a greedy one; the next two pushed its head to disk
    again.add_request("again", ids, params)
    (out,) = [o for o in iter_steps(again) if o.finished]
    assert out.num_cached_tokens == 64
    assert out.output_token_ids == before[rid].output_token_ids
    again.close()


def iter_steps(e: LLMEngine) -> list[RequestOutput]:
    outputs = []
    while e.has_unfinished():
        outputs += e.step()
    return outputs


def test_a_changed_block_size_or_a_torn_slot_is_not_trusted(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    run(disk_engine(tmp_path), workload()[:4])
    listed = json.loads((tmp_path / "kv.json").read_text())["slots"]
    # A slot written again after the manifest (or torn by a crash) fails its checksum.
    bytes_per_block = (tmp_path / "kv.bin").stat().st_size // 32
    with open(tmp_path / "kv.bin", "r+b") as handle:
        handle.seek(listed[0][0] * bytes_per_block + 100)
        handle.write(b"\xff" * 8)
    with caplog.at_level(logging.WARNING):
        again = disk_engine(tmp_path)
    assert f"dropping 1 of the {len(listed)} blocks" in caplog.text
    assert len(storage_stores(again.take_kv_event_batch())) == len(listed) - 1
    again.close()
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        other = engine(num_disk_blocks=32, disk_kv_file=str(tmp_path / "kv.bin"), block_size=8)
    assert "discarding the disk KV tier" in caplog.text and "block_size 16 (now 8)" in caplog.text
    assert other.take_kv_event_batch() is None
    assert not (tmp_path / "kv.json").exists()
    other.close()  # writes its own, empty, manifest
    assert json.loads((tmp_path / "kv.json").read_text())["slots"] == []
