"""`kvherd agent --num-cpu-blocks / --disk-kv-dir --num-disk-blocks`: real agents on loopback.

A working set four times the GPU pool, revisited: the tiered agent loads the prefixes back from host
memory and its disk file (``cached_tokens`` says so) and answers exactly what the agent without
tiers answers, greedy and seeded.
"""

from __future__ import annotations

import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx

from tests.support.agent_process import agent_process

ENGINE = ("--num-gpu-blocks", "8", "--block-size", "16", "--seed", "0")


def prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(256) for _ in range(n)]


def workload() -> list[dict[str, Any]]:
    heads = [prompt(64, seed) for seed in range(4)]
    bodies = []
    for round_ in range(3):
        for n, head in enumerate(heads):
            sampling = {"temperature": 0.0} if n % 2 else {"temperature": 0.9, "seed": round_ + n}
            bodies.append(
                {
                    "prompt": head + prompt(5, 100 + round_ * 4 + n),
                    "max_tokens": 6,
                    "ignore_eos": True,
                    "return_token_ids": True,
                    **sampling,
                }
            )
    return bodies


def answers(url: str) -> list[tuple[str, int]]:
    out = []
    with httpx.Client(timeout=60) as client:
        for body in workload():
            response = client.post(f"{url}/v1/completions", json=body)
            assert response.status_code == 200, response.text
            data = response.json()
            out.append(
                (
                    data["choices"][0]["text"],
                    data["usage"]["prompt_tokens_details"]["cached_tokens"],
                )
            )
    return out


def test_tiered_agent_answers_exactly_and_serves_prefixes_from_cpu_and_disk(
    tmp_path: Path,
) -> None:
    tiers = ("--num-cpu-blocks", "4", "--disk-kv-dir", str(tmp_path), "--num-disk-blocks", "32")
    with (
        agent_process(*ENGINE, "--instance-id", "plain") as plain,
        agent_process(*ENGINE, *tiers, "--instance-id", "tiered") as tiered,
    ):
        baseline = answers(plain.url)
        with_tiers = answers(tiered.url)
        state = httpx.get(f"{tiered.url}/kvherd/v1/state", timeout=30).json()
        metrics = httpx.get(f"{tiered.url}/metrics", timeout=30).text
    assert [text for text, _ in with_tiers] == [text for text, _ in baseline]
    assert [cached for _, cached in baseline] == [0] * 12
    assert [cached for _, cached in with_tiers] == [0] * 4 + [64] * 8
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "kvherd-kv-tiered.bin",
        "kvherd-kv-tiered.json",
    ]
    gpu, cpu, disk = state["tiers"]
    assert [t["medium"] for t in state["tiers"]] == ["GPU", "CPU", "STORAGE"]
    assert [t["capacity_blocks"] for t in state["tiers"]] == [8, 4, 32]
    assert cpu["num_blocks"] == 4 and disk["num_blocks"] > 0 and gpu["evicted_blocks"] > 0
    assert cpu["hit_tokens"] + disk["hit_tokens"] == 8 * 64  # every revisit came from below
    assert disk["load_bytes"] == disk["load_blocks"] * (
        disk["offload_bytes"] // disk["offload_blocks"]
    )
    labels = 'engine="0",medium="STORAGE",model_name="tiny"'
    assert f"kvherd_kv_tier_capacity_blocks{{{labels}}} 32.0" in metrics
    assert f"kvherd_kv_load_bytes_total{{{labels}}} {float(disk['load_bytes'])}" in metrics


def test_a_disk_tier_without_its_folder_is_refused() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "kvherd", "agent", "--num-disk-blocks", "4"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2 and "--disk-kv-dir" in result.stderr
