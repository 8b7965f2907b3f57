"""The saturation batch size: found where measured decode throughput stops growing, unknown until
throughput was seen to flatten, and following the machine's speed as it changes."""

from __future__ import annotations

import pytest

from instance_agent.saturation import DecodeThroughput, SaturationSettings


def steps(curve: DecodeThroughput, seconds_for: dict[int, float], n: int = 40) -> None:
    for _ in range(n):
        for batch, seconds in seconds_for.items():
            curve.record(batch, seconds)


def cpu_like(batch: int) -> float:
    """Step seconds of an engine with 2 ms of fixed cost and 0.25 ms per sequence: throughput
    grows to 4,000 sequences/s and is at 80% of that from a batch of 32 on."""
    return 0.002 + 0.00025 * batch


def test_unknown_until_throughput_is_seen_to_flatten() -> None:
    curve = DecodeThroughput()
    assert curve.saturation_seqs() is None
    steps(curve, {1: cpu_like(1)})
    assert curve.saturation_seqs() is None  # one bucket: no curve yet
    steps(curve, {b: cpu_like(b) for b in (2, 4, 8)})
    assert curve.saturation_seqs() is None  # still growing as far as it was seen
    steps(curve, {b: cpu_like(b) for b in (16, 32, 64)})
    assert curve.saturation_seqs() == 32
    throughput = curve.throughput()
    assert sorted(throughput) == [1, 2, 4, 8, 16, 32, 64]
    assert throughput[32] == pytest.approx(32 / cpu_like(32))


def test_a_bucket_needs_enough_steps_and_reports_its_mean_batch() -> None:
    curve = DecodeThroughput(SaturationSettings(min_steps=20))
    steps(curve, {4: 0.004}, n=40)  # 1,000/s
    steps(curve, {40: 0.040, 50: 0.050}, n=9)  # 1,000/s too, but only 18 steps in [32, 63]
    assert curve.saturation_seqs() is None
    steps(curve, {40: 0.040, 50: 0.050}, n=2)
    assert curve.saturation_seqs() == 4
    curve = DecodeThroughput()
    steps(curve, {6: 0.012})  # bucket [4, 7] at 500/s: its batch (6), not its lower bound
    steps(curve, {64: 0.128})  # 500/s
    steps(curve, {1: 0.004})  # 250/s
    assert curve.saturation_seqs() == 6


def test_follows_a_change_of_speed() -> None:
    """Decayed sums: a machine that slows at large batches moves the saturation point down, and
    back when it recovers."""
    curve = DecodeThroughput()
    steps(curve, {b: cpu_like(b) for b in (1, 2, 4, 8, 16, 32, 64)})
    assert curve.saturation_seqs() == 32
    # Contended: past 8 sequences, steps take as long per sequence as at 8.
    steps(curve, {b: cpu_like(8) * b / 8 for b in (16, 32, 64)}, n=600)
    assert curve.saturation_seqs() == 8
    steps(curve, {b: cpu_like(b) for b in (16, 32, 64)}, n=600)
    assert curve.saturation_seqs() == 32


def test_ignores_what_is_not_a_decode_step() -> None:
    curve = DecodeThroughput()
    curve.record(0, 0.01)  # a step with prefill in it (the engine reports batch 0)
    curve.record(4, 0.0)
    curve.record(4, float("nan"))
    assert curve.throughput() == {}


def test_settings_are_checked() -> None:
    with pytest.raises(ValueError):
        SaturationSettings(fraction=0)
    with pytest.raises(ValueError):
        SaturationSettings(memory=0)
