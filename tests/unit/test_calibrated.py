"""The profile file: the calibrated latency model (formats, the serving section), the host section
(`HostModel`, `kvherd sim --profile`), and `kvherd profile` clocks."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from typing import Any

import pytest

from kvherd.profile_format import HOST_KNOBS
from simulator.host_model import HostModel, HostModelError
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


_HOST = HostModel(
    request_overhead_s=0.0021,
    request_overhead_per_busy_s=0.0004,
    request_overhead_idle=((0.03, -0.001), (0.5, 0.004)),
    request_overhead_spread=(-0.002, 0.0, 0.001, 0.006),
    step_slowdown_per_busy=0.12,
)


def test_host_section_round_trips_through_the_profile_file(tmp_path: Path) -> None:
    # The file's keys are the model's knobs, one list in `kvherd.profile_format`.
    knobs = tuple(f.name for f in dataclasses.fields(HostModel) if f.init)
    assert knobs == HOST_KNOBS
    path = tmp_path / "fleet.json"
    path.write_text(json.dumps(_profile(host=_HOST.profile_section())))
    assert HostModel.from_file(path) == _HOST
    # The latency model reads the same file and ignores the section.
    assert load_latency_model(f"calibrated:{path}").step_time([], [10]) == pytest.approx(
        CalibratedModel(_profile()).step_time([], [10])
    )
    # A profile without one (`kvherd profile` writes none) is a host that adds nothing; a knob
    # left out is zero.
    assert HostModel.from_profile(_profile()) == HostModel()
    partial = HostModel.from_profile(_profile(host={"request_overhead_s": 0.003}))
    assert partial == HostModel(request_overhead_s=0.003)
    assert not partial.times_steps_by_fleet and _HOST.times_steps_by_fleet


def test_host_model_applies_its_knobs() -> None:
    # 2.1 ms + 0.4 ms per other busy instance + the idle curve (flat past its ends) + the draw.
    def overhead(draw: float, busy: int, idle: float) -> float:
        return _HOST.request_overhead(draw, lambda: busy, lambda: idle)

    assert overhead(0.0, 0, 0.0) == pytest.approx(0.0021 - 0.001)
    assert overhead(0.0005, 3, 0.265) == pytest.approx(0.0021 + 0.0005 + 3 * 0.0004 + 0.0015)
    assert overhead(0.0, 0, 60.0) == pytest.approx(0.0021 + 0.004)
    # Fleet facts a knob does not need are never read.
    unread = HostModel(request_overhead_s=0.001)

    def fail() -> Any:
        raise AssertionError("read a fleet fact no knob needs")

    assert unread.request_overhead(0.0, fail, fail) == 0.001
    assert unread.step_stretch(fail) == 1.0
    assert _HOST.step_stretch(lambda: 2) == pytest.approx(1.24)
    # Draws: seeded, within the quantiles, none without a spread.
    draws = _HOST.path_draws(500, seed=3)
    assert draws == _HOST.path_draws(500, seed=3) != _HOST.path_draws(500, seed=4)
    assert all(-0.002 <= d <= 0.006 for d in draws) and len(draws) == 500
    assert HostModel().path_draws(500, seed=3) == []


@pytest.mark.parametrize(
    ("host", "message"),
    [
        ([1], "host must be an object"),
        ({"request_overhead": 0.1}, "unknown keys ['request_overhead']"),
        ({"request_overhead_s": -0.001}, "host.request_overhead_s must be a non-negative number"),
        ({"step_slowdown_per_busy": True}, "host.step_slowdown_per_busy must be a number"),
        ({"request_overhead_idle": [[0.5, 1], [0.1, 2]]}, "strictly ascending"),
        ({"request_overhead_idle": [[0.5]]}, "must be (idle s, extra s) points"),
        ({"request_overhead_idle": 0.5}, "host.request_overhead_idle must be a list"),
        ({"request_overhead_spread": [0.002]}, "at least two quantiles, ascending"),
    ],
)
def test_bad_host_sections_are_refused_naming_file_and_key(host: Any, message: str) -> None:
    with pytest.raises(HostModelError, match=f"^fleet.json: .*{re.escape(message)}"):
        HostModel.from_profile(_profile(host=host), "fleet.json")


def _sim(tmp_path: Path, name: str, *flags: str) -> dict[str, Any]:
    from kvherd.cli import main

    trace = "synthetic:requests=80,rate=40,input_mean=600,output_mean=24,num_groups=4,seed=1"
    args = ["sim", trace, "--instances", "3", "--policy", "round_robin,kvherd", "--quiet"]
    assert main([*args, *flags, "--no-plots", "--out", str(tmp_path / name)]) == 0
    report: dict[str, Any] = json.loads((tmp_path / name / "summary.json").read_text())
    return report


def test_sim_takes_the_host_from_the_profile_and_flags_override_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "fleet.json"
    path.write_text(json.dumps(_profile(host=_HOST.profile_section())))
    flags = [
        "--request-overhead-ms=2.1",
        "--request-overhead-per-busy-ms=0.4",
        "--request-overhead-idle=0.03:-1,0.5:4",
        "--request-overhead-spread=-2,0,1,6",
        "--step-slowdown-per-busy=0.12",
    ]
    by_flags = _sim(tmp_path, "flags", *flags)
    by_file = _sim(tmp_path, "file", "--profile", str(path))
    assert by_file["meta"]["host"] == _HOST.profile_section()
    assert by_file["meta"]["host_profile"] == str(path)
    assert by_file["results"] == by_flags["results"]  # one host, however it was given
    plain = _sim(tmp_path, "plain")
    assert plain["meta"]["host"] == HostModel().profile_section()
    assert plain["results"]["kvherd"]["ttft_ms_mean"] < by_file["results"]["kvherd"]["ttft_ms_mean"]
    # A flag overrides its knob only; an empty list flag clears the file's.
    mixed = _sim(tmp_path, "mixed", "--profile", str(path), "--request-overhead-ms=5")
    assert mixed["meta"]["host"] == {**_HOST.profile_section(), "request_overhead_s": 0.005}
    cleared = _sim(tmp_path, "cleared", "--profile", str(path), "--request-overhead-spread=")
    assert cleared["meta"]["host"]["request_overhead_spread"] == []
    assert cleared["meta"]["host"]["request_overhead_s"] == 0.0021
    zeroed = ["--step-slowdown-per-busy=0", "--request-overhead-per-busy-ms=0"]
    everything = [
        "--request-overhead-ms=0",
        "--request-overhead-idle=",
        "--request-overhead-spread=",
        *zeroed,
    ]
    assert (
        _sim(tmp_path, "zeroed", "--profile", str(path), *everything)["results"] == plain["results"]
    )
    capsys.readouterr()


def test_sim_refuses_a_bad_host_naming_the_flag_or_the_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from kvherd.cli import main

    good = tmp_path / "good.jsonl"
    good.write_text('{"timestamp": 0, "input_length": 5, "output_length": 1}\n')
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(_profile(host={"request_overhead_s": -1})))
    cases = [
        (["--profile", str(tmp_path / "none.json")], f"profile {tmp_path / 'none.json'} not found"),
        (["--profile", str(bad)], f"{bad}: host.request_overhead_s must be a non-negative"),
        # A bad file is refused even where a flag would replace its knob.
        (["--profile", str(bad), "--request-overhead-ms=1"], "host.request_overhead_s must be"),
        (["--request-overhead-spread=3,1"], "--request-overhead-spread must be at least two"),
        (["--request-overhead-idle=0.5:1,0.5:2"], "--request-overhead-idle must have idle times"),
    ]
    for extra, needle in cases:
        code = main(["sim", str(good), *extra, "--out", str(tmp_path / "o"), "--quiet"])
        err = capsys.readouterr().err
        assert code == 2 and needle in err and "Traceback" not in err, err
        assert err.startswith("kvherd sim: error: ")
