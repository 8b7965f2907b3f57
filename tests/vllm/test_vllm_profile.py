"""`kvherd profile --url` against a real vLLM server: the profile users can simulate their engine by.

The engine's facts come from vLLM itself (``vllm:cache_config_info``: the CPU build's block size
128 and its KV blocks; ``/v1/models``: the context length), prefix points hit what vLLM reports as
``cached_tokens`` in whole 128-token blocks, and `kvherd sim` replays a trace on the result.
Accuracy is measured by ``bench/sim_fidelity.py`` on a quiet machine, not asserted here.
"""

from __future__ import annotations

import json
from pathlib import Path

from vllm_fleet import VLLM_BLOCK_SIZE, VllmServer

from kvherd.cli import main
from simulator.latency.calibrated import CalibratedModel

ROOT = Path(__file__).resolve().parents[2]


def test_a_vllm_profile_from_outside_drives_the_simulator(
    vllm_pair: tuple[VllmServer, VllmServer], tmp_path: Path
) -> None:
    a, _ = vllm_pair
    path = tmp_path / "vllm-profile.json"
    argv = ["profile", "--url", a.url, "--out", str(path), "--max-context", "512"]
    assert main([*argv, "--max-batch", "4", "--repeats", "1"]) == 0
    profile = json.loads(path.read_text())
    engine = profile["engine"]
    assert engine["block_size"] == VLLM_BLOCK_SIZE == a.block_size()
    assert engine["num_blocks"] > 0 and engine["max_model_len"] >= 512
    assert profile["reports_cached_tokens"] is True
    prefill = [p for p in profile["points"] if p["prefill"]]
    hits = {before for p in prefill for _, before in p["prefill"]}
    assert 0 in hits and VLLM_BLOCK_SIZE in hits and all(h % VLLM_BLOCK_SIZE == 0 for h in hits)
    assert {len(p["decode"]) for p in profile["points"] if p["decode"]} == {1, 2, 4}
    assert all(p["measured_s"] > 0 for p in profile["points"])
    model = CalibratedModel(profile)
    assert model.kv_capacity_tokens == engine["num_blocks"] * VLLM_BLOCK_SIZE

    out = tmp_path / "sim"
    trace = ROOT / "traces" / "azure-llm-2023" / "AzureLLMInferenceTrace_conv_1500.csv"
    sim = ["sim", str(trace), "--instances", "2", "--max-requests", "20", "--no-plots", "--quiet"]
    sim += ["--latency-model", f"calibrated:{path}", "--profile", str(path), "--out", str(out)]
    assert main(sim) == 0
    result = json.loads((out / "summary.json").read_text())["results"]["kvherd"]
    assert result["completed"] + result["failed"] == 20 and result["completed"] > 0

    # `kvherd plan` sizes a fleet of these engines: the profile's block size and host section.
    plan_json = tmp_path / "plan.json"
    spec = "synthetic:requests=40,rate=4,input_mean=200,output_mean=16,seed=1"
    plan = ["plan", spec, "--latency-model", f"calibrated:{path}"]
    plan += ["--profile", str(path), "--instances", "1:3", "--workers", "1"]
    assert main([*plan, "--slo", "ttft_p99=30", "--json", str(plan_json)]) == 0
    cheapest = json.loads(plan_json.read_text())["cheapest"]
    assert cheapest["block_size"] == VLLM_BLOCK_SIZE and 1 <= cheapest["instances"] <= 3
