"""The proxy's admission on the simulator's clock (`simulator.admission`): the same core refuses a
flood by expected wait, admits ordinary load, queues at the in-flight cap, and every request is
either served or refused; the recovery after a flood is read with the chaos suite's own rule."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from kvherd.cli import main
from policies import load_dispatch_policy
from scheduler.core.admission import AdmissionSettings
from scheduler.core.admission_queue import QueueSettings
from simulator.cluster import ClusterConfig, SimCluster
from simulator.instance import InstanceConfig
from simulator.latency import load_latency_model
from simulator.overload import Flood, flood_trace, recovered_s

LATENCY = "roofline:llama-2-7b:a100-80gb"


def _cluster(admission: AdmissionSettings | None, **config: object) -> SimCluster:
    cfg = ClusterConfig(
        num_instances=2,
        instance=InstanceConfig(
            num_blocks=4096, block_size=16, max_num_seqs=8, max_num_batched_tokens=2048
        ),
        admission=admission,
        **config,  # type: ignore[arg-type]
    )
    return SimCluster(cfg, load_latency_model(LATENCY), load_dispatch_policy("round_robin"))


def _recovery(cluster: SimCluster, flood: Flood) -> float | None:
    cols = cluster.metrics.columns()
    index = cols["index"].astype(int)
    latency = cols["last_token"] - cols["arrival"]
    before = latency[index < 30]  # the normal load before the flood
    baseline = float(np.median(before))
    probes = [
        (float(sent), float(lat), 200)
        for i, sent, lat in zip(index, cols["arrival"], latency, strict=True)
        if flood.probe(i)
    ]
    probes += [(a, 0.0, 429) for a in cluster.metrics.refused_arrivals if a >= flood.flood_end_s]
    return recovered_s(probes, flood.flood_end_s, max(2 * baseline, baseline + 0.25))


def test_a_flood_is_refused_and_service_recovers() -> None:
    flood = flood_trace(100.0)  # 1,000 req/s against a fleet that serves about 40
    cluster = _cluster(AdmissionSettings())
    cluster.run(flood.trace)
    stats = cluster.admission.stats  # type: ignore[union-attr]
    served = len(cluster.metrics.columns()["index"])
    refused = len(cluster.metrics.refused_arrivals)
    assert served + refused == len(flood.trace) and cluster.metrics.failed == 0
    assert refused == stats.refused["queue_wait"] > 0.8 * len(flood.trace)
    recovered = _recovery(cluster, flood)
    assert recovered is not None and recovered <= 2.0, recovered
    # Without admission the flood is all queued at the engines: no recovery in the window.
    unguarded = _cluster(None)
    unguarded.run(flood.trace)
    assert len(unguarded.metrics.refused_arrivals) == 0
    assert _recovery(unguarded, flood) is None


def test_ordinary_load_is_never_refused() -> None:
    # The normal load alone (a request every 0.1 s, far below capacity): nothing refused.
    flood = flood_trace(100.0, factor=1e-9, flood_s=0.0)
    cluster = _cluster(AdmissionSettings())
    cluster.run(flood.trace)
    assert len(cluster.metrics.refused_arrivals) == 0
    assert len(cluster.metrics.columns()["index"]) == len(flood.trace)


def test_the_in_flight_cap_queues_and_its_bounds_refuse() -> None:
    flood = flood_trace(100.0, flood_s=1.0)
    # Expected-wait shedding off (a wait no queue reaches): only the cap and the queue act.
    lenient = AdmissionSettings(max_queue_wait_s=1e9, standing_queue_wait_s=1e9)
    cluster = _cluster(
        lenient, admission_queue=QueueSettings(size=64, timeout_s=1.0), max_inflight_per_instance=4
    )
    cluster.run(flood.trace)
    stats = cluster.admission.stats  # type: ignore[union-attr]
    assert stats.queued > 0 and stats.refused.get("queue_full", 0) > 0
    assert max(stats.queue_waits_s) <= 1.0 + 1e-9
    served = len(cluster.metrics.columns()["index"])
    assert served + len(cluster.metrics.refused_arrivals) == len(flood.trace)
    assert cluster.admission.ledger.count("inst-0") == 0  # type: ignore[union-attr]


@pytest.mark.parametrize("seed", [0, 1])
def test_admission_runs_are_deterministic(seed: int) -> None:
    flood = flood_trace(100.0, flood_s=1.0)
    runs = []
    for _ in range(2):
        cluster = _cluster(AdmissionSettings(), seed=seed)
        cluster.run(flood.trace)
        runs.append((list(cluster.metrics.refused_arrivals), cluster.metrics.summary()))
    assert runs[0][0] == runs[1][0]
    assert str(runs[0][1]) == str(runs[1][1])


def test_the_cli_reports_refusals_and_queue_waits(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    flood = flood_trace(100.0, flood_s=1.0, after_s=2.0)
    path = tmp_path / "flood.jsonl"
    path.write_text(
        "".join(
            json.dumps(
                {
                    "timestamp": round(r.arrival_s * 1000, 3),
                    "input_length": r.input_length,
                    "output_length": r.output_length,
                    "hash_ids": list(r.hash_ids),
                }
            )
            + "\n"
            for r in flood.trace.requests
        )
    )
    args = ["sim", str(path), "--instances", "2", "--policy", "round_robin", "--quiet"]
    args += ["--latency-model", LATENCY, "--max-num-seqs", "8", "--no-plots"]
    assert main([*args, "--admission", "--out", str(tmp_path / "on")]) == 0
    table = capsys.readouterr().out
    assert "| refused (429) |" in table and "| refused: expected wait |" in table
    on = json.loads((tmp_path / "on" / "summary.json").read_text())
    result = next(iter(on["results"].values()))
    assert result["refused"] == result["refused_queue_wait"] > 0
    assert result["completed"] + result["refused"] == len(flood.trace)
    assert main([*args, "--out", str(tmp_path / "off")]) == 0
    assert "refused" not in capsys.readouterr().out
    with pytest.raises(SystemExit) as usage:  # the flags are kvherd serve's, checked alike
        main([*args, "--admission", "--max-queue-wait", "0", "--out", str(tmp_path / "x")])
    assert usage.value.code == 2
