"""The calibrated latency model: profile formats, the serving section, and `kvherd profile` clocks."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from simulator.latency import LatencyModelError, load_latency_model
from simulator.latency.calibrated import FEATURES, CalibratedModel


def _profile(**extra: Any) -> dict[str, Any]:
    return {
        "format": "kvherd-latency-profile/v2",
        "features": list(FEATURES),
        # const, prefill_sequences, prefill_tokens, prefill_attention_pairs, decode_batch,
        # decode_context_tokens
        "coefficients_s": [1e-3, 2e-4, 1e-5, 1e-8, 5e-5, 2e-7],
        "engine": {"block_size": 16, "num_blocks": 100},
        **extra,
    }


def test_prediction_is_the_linear_model_of_the_step() -> None:
    model = CalibratedModel(_profile())
    # Two prefill chunks (10 new after 0, 4 new after 16) and decodes at contexts 20 and 30.
    pairs = (10 * 11 // 2) + (4 * 16 + 4 * 5 // 2)
    expected = 1e-3 + 2 * 2e-4 + 14 * 1e-5 + pairs * 1e-8 + 2 * 5e-5 + 50 * 2e-7
    assert model.step_time([(10, 0), (4, 16)], [20, 30]) == pytest.approx(expected, rel=1e-12)
    assert model.kv_capacity_tokens == 1600


def test_serving_section_scales_compute_and_adds_step_and_sequence_costs() -> None:
    plain = CalibratedModel(_profile())
    serving = {"compute_scale": 1.5, "step_s": 0.002, "per_sequence_s": 0.0003}
    served = CalibratedModel(_profile(serving=serving))
    shape: tuple[list[tuple[int, int]], list[int]] = ([(64, 0)], [40, 41, 42])
    assert served.engine_step_time(*shape) == plain.step_time(*shape)
    expected = 1.5 * plain.step_time(*shape) + 0.002 + 4 * 0.0003
    assert served.step_time(*shape) == pytest.approx(expected, rel=1e-12)
    # Pure decode runs (the simulator's fast-forward) price the same serving cost per step.
    times = list(served.decode_step_times([40, 41], 3))
    assert times == [served.step_time((), [40 + j, 41 + j]) for j in range(3)]
    assert served.describe()["serving"] == serving
    # Without a compute scale the fleet computes as profiled.
    unscaled = CalibratedModel(_profile(serving={"step_s": 0.002}))
    assert unscaled.step_time(*shape) == pytest.approx(plain.step_time(*shape) + 0.002)


def test_first_format_profiles_still_load(tmp_path: Path) -> None:
    v1 = {
        "format": "kvherd-latency-profile/v1",
        "features": [f for f in FEATURES if f != "prefill_sequences"],
        "coefficients_s": [1e-3, 1e-5, 1e-8, 5e-5, 2e-7],
        "engine": {"block_size": 16, "num_blocks": 100},
    }
    path = tmp_path / "v1.json"
    path.write_text(json.dumps(v1))
    model = load_latency_model(f"calibrated:{path}")
    # No per-prefill-sequence term: two chunks cost their tokens and pairs only.
    assert model.step_time([(8, 0), (8, 0)], []) == pytest.approx(1e-3 + 16e-5 + 72e-8)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"format": "other"}, "not a kvherd latency profile"),
        ({"features": ["const", "gpu_temperature"]}, "must be among"),
        ({"coefficients_s": [1.0]}, "coefficients_s must be 6 numbers"),
        ({"coefficients_s": [1e-3, 0, 0, 0, "x", 0]}, "coefficient of decode_batch"),
        ({"serving": {"step_s": float("nan")}}, "serving.step_s"),
        ({"serving": [1, 2]}, "serving must be an object"),
        ({"serving": {"compute_scale": 0}}, "compute_scale must be positive"),
    ],
)
def test_bad_profiles_are_refused_clearly(change: dict[str, Any], message: str) -> None:
    with pytest.raises(LatencyModelError, match=message):
        CalibratedModel({**_profile(), **change})


def test_profile_thread_clock_records_its_settings(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    from kvherd.cli import main

    out = tmp_path / "tiny.json"
    args = ["profile", "--model", "tiny", "--out", str(out), "--device", "cpu"]
    small = ["--max-context", "64", "--max-batch", "4", "--repeats", "1"]
    assert main([*args, *small, "--torch-threads", "1", "--clock", "thread"]) == 0
    profile = json.loads(out.read_text())
    assert profile["format"] == "kvherd-latency-profile/v2"
    assert profile["torch_threads"] == 1 and profile["clock"] == "thread"
    assert profile["features"] == list(FEATURES)
    # Steps with several prefills were measured: the per-sequence term has data to fit.
    assert any(len(point["prefill"]) > 1 for point in profile["points"])
    model = load_latency_model(f"calibrated:{out}")
    for point in profile["points"]:
        prefill = [tuple(chunk) for chunk in point["prefill"]]
        assert model.step_time(prefill, point["decode"]) == pytest.approx(
            point["predicted_s"], rel=1e-9
        )


def test_profile_thread_clock_needs_one_torch_thread(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("torch")
    from kvherd.cli import main

    args = ["profile", "--out", str(tmp_path / "p.json"), "--device", "cpu", "--clock", "thread"]
    assert main([*args, "--torch-threads", "2"]) == 2
    err = capsys.readouterr().err
    assert "--clock thread needs the CPU device and --torch-threads 1" in err
    assert main([*args, "--torch-threads", "0"]) == 2
    assert not (tmp_path / "p.json").exists()
