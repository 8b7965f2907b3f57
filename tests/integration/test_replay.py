"""`kvherd replay` against a real `kvherd agent` process on loopback."""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any

import pytest
from agent_process import agent_process, free_port

from kvherd.cli import main
from simulator.synthetic import SyntheticSpec, generate


def _trace_file(tmp_path: Path) -> tuple[Path, dict[int, int]]:
    trace = generate(
        SyntheticSpec(
            requests=10,
            rate=15.0,
            input_mean=700,
            output_mean=6,
            num_groups=2,
            prefix_tokens=512,
            max_input=1500,
            seed=3,
        )
    )
    lines: list[dict[str, Any]] = [
        {
            "timestamp": round(r.arrival_s * 1000),
            "input_length": r.input_length,
            "output_length": r.output_length,
            "hash_ids": list(r.hash_ids),
        }
        for r in trace.requests
    ]
    # One prompt longer than the tiny model's context: the server refuses it, the replay goes on.
    lines.append(
        {"timestamp": lines[-1]["timestamp"] + 1, "input_length": 3000, "output_length": 4}
    )
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path, {i: r.output_length for i, r in enumerate(trace.requests)}


def test_replay_measures_a_real_agent(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path, outputs = _trace_file(tmp_path)
    out = tmp_path / "out"
    with agent_process() as agent:
        code = main(["replay", str(path), "--url", agent.url, "--out", str(out), "--quiet"])
    assert code == 0
    table = capsys.readouterr()
    assert "| TTFT p50 (ms) |" in table.out and "1 x HTTP 400" in table.err
    summary = json.loads((out / "summary.json").read_text())["results"]["replay"]
    assert summary["completed"] == 10 and summary["failed"] == 1
    assert summary["errors"] == {"HTTP 400": 1}
    assert summary["output_tokens"] == sum(outputs.values())
    assert summary["ttft_ms_p50"] > 0 and summary["e2e_ms_p99"] >= summary["ttft_ms_p99"]
    assert summary["itl_ms_mean"] > 0 and summary["tpot_ms_mean"] > 0
    # Requests of one prefix group share their first 512-token block: the agent hits its cache.
    assert summary["prefix_hit_rate"] > 0
    with (out / "requests_replay.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 10  # the completed requests
    # A bare agent does not name itself in a header: the instance is the endpoint.
    assert {row["instance"] for row in rows} == {agent.url}
    assert (out / "ttft_cdf.png").stat().st_size > 0
    meta = json.loads((out / "summary.json").read_text())["meta"]
    assert 0.0 <= meta["send_lag_ms_max"] < meta["wall_s"] * 1000.0


def test_replay_unreachable_endpoint(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path, _ = _trace_file(tmp_path)
    url = f"http://127.0.0.1:{free_port()}"
    assert main(["replay", str(path), "--url", url, "--out", str(tmp_path / "o"), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvherd replay: error: cannot list models") and "Traceback" not in err
