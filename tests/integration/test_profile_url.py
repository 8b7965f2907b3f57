"""`kvherd profile --url` against a running kvherd agent: a profile the simulator runs, from outside.

The agent is a real process; the profiler sees it only through the OpenAI API and ``/metrics``.
Accuracy is not asserted here (the machine is shared and noisy; `bench/sim_fidelity.py` measures
it): what is asserted is what the profile is made of, that the engine's own cache facts reached
it, and that `kvherd sim` replays a trace on it.
"""

from __future__ import annotations

import json
from pathlib import Path

from agent_process import agent_process

from kvherd.cli import main
from simulator.host_model import HostModel
from simulator.latency.calibrated import CalibratedModel

ROOT = Path(__file__).resolve().parents[2]


def test_a_profile_taken_through_the_api_drives_the_simulator(tmp_path: Path) -> None:
    profile_path = tmp_path / "agent-profile.json"
    with agent_process("--block-size", "16", "--num-gpu-blocks", "512") as agent:
        argv = ["profile", "--url", agent.url, "--out", str(profile_path)]
        argv += ["--max-context", "256", "--max-batch", "4", "--repeats", "1"]
        assert main(argv) == 0
        again = tmp_path / "again.json"
        assert main([*argv[:3], "--out", str(again), *argv[5:]]) == 0
    profile = json.loads(profile_path.read_text())
    # The engine's facts, read from its /metrics and /v1/models, not from flags.
    assert profile["engine"]["block_size"] == 16 and profile["engine"]["num_blocks"] == 512
    assert profile["engine"]["max_model_len"] == 2048
    assert profile["reports_cached_tokens"] is True
    prefill = [p for p in profile["points"] if p["prefill"]]
    decode = [p for p in profile["points"] if p["decode"]]
    assert prefill and decode and all(p["measured_s"] > 0 for p in profile["points"])
    # Prefix points hit what was warmed (whole blocks), as the engine itself reported; cold ones
    # hit nothing, in the second run too (its prompts are fresh, the server's cache is not).
    hits = {before for p in prefill for _, before in p["prefill"]}
    assert 0 in hits and any(before >= 16 and before % 16 == 0 for before in hits)
    second = json.loads(again.read_text())
    cold = [p for p in second["points"] if p["prefill"] and p["warmed_tokens"] == 0]
    assert cold and all(p["prefill"][0][1] == 0 for p in cold)
    assert {len(p["decode"]) for p in decode} == {1, 2, 4}
    assert profile["host"]["request_overhead_s"] >= 0
    assert profile["coefficients_s"][1] == 0.0  # prefill_sequences: not separable from outside

    model = CalibratedModel(profile)
    assert model.kv_capacity_tokens == 512 * 16
    assert (
        HostModel.from_profile(profile).request_overhead_s == profile["host"]["request_overhead_s"]
    )
    out = tmp_path / "sim"
    trace = ROOT / "traces" / "azure-llm-2023" / "AzureLLMInferenceTrace_conv_1500.csv"
    sim = ["sim", str(trace), "--instances", "2", "--max-requests", "30", "--no-plots", "--quiet"]
    sim += ["--latency-model", f"calibrated:{profile_path}", "--profile", str(profile_path)]
    assert main([*sim, "--out", str(out)]) == 0
    result = json.loads((out / "summary.json").read_text())["results"]["kvherd"]
    # The profile's context length holds: requests longer than the agent's 2,048 tokens fail.
    rows = trace.read_text().splitlines()[1:31]
    too_long = sum(int(r.split(",")[1]) + int(r.split(",")[2]) > 2048 for r in rows)
    assert too_long > 0 and result["failed"] == too_long
    assert result["completed"] == 30 - too_long and result["ttft_ms_mean"] > 0

    # `kvherd plan` sizes a fleet of these engines: the profile's block size and host section.
    plan_json = tmp_path / "plan.json"
    spec = "synthetic:requests=40,rate=4,input_mean=200,output_mean=16,seed=1"
    plan = ["plan", spec, "--latency-model", f"calibrated:{profile_path}"]
    plan += ["--profile", str(profile_path), "--instances", "1:3", "--workers", "1"]
    assert main([*plan, "--slo", "ttft_p99=30", "--json", str(plan_json)]) == 0
    cheapest = json.loads(plan_json.read_text())["cheapest"]
    assert cheapest["block_size"] == 16 and 1 <= cheapest["instances"] <= 3
