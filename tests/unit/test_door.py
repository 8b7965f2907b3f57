"""The door's pure core: when a key starts and stops shedding, and what it still lets through."""

from __future__ import annotations

import pytest

from scheduler.core.door import Door, DoorSettings, Shed

KEY = ("tenant", 0)
WAIT = Shed("queue_wait", 2)


def flooded(door: Door, now: float = 0.0, refusals: int = 8) -> None:
    for i in range(refusals):
        door.outcome(now + i * 0.001, KEY, WAIT)


def test_a_key_sheds_once_admission_refuses_most_of_its_recent_requests() -> None:
    door = Door(DoorSettings(min_refusals=4, enter_share=0.5))
    for i in range(10):
        door.outcome(i * 0.01, KEY, None)  # admitted
    assert door.check(0.1, KEY) is None
    for i in range(3):
        door.outcome(0.1 + i * 0.001, KEY, WAIT)
    assert not door.shedding(KEY)  # 3 refusals beside 10 admissions: not most
    flooded(door, 0.2, 12)
    assert door.shedding(KEY)
    # Other keys are untouched: admission tells them apart too.
    assert door.check(0.3, ("other", 0)) is None and door.check(0.3, ("tenant", 1)) is None


def test_a_shedding_key_answers_the_last_refusal_and_lets_probes_through() -> None:
    settings = DoorSettings(probe_s=0.05, burst=1.0, headroom=0.0)
    door = Door(settings)
    flooded(door)
    now = 0.01
    assert door.check(now, KEY) == WAIT  # no credit yet
    # One probe per probe_s (no admitted rate to add): over one second, about 20 pass.
    passed = 0
    for i in range(1, 1001):
        if door.check(now + i * 0.001, KEY) is None:
            passed += 1
    assert 18 <= passed <= 21


def test_the_admitted_rate_passes_with_headroom() -> None:
    settings = DoorSettings(window_s=1.0, headroom=0.5, probe_s=10.0, burst=4.0)
    door = Door(settings)
    # A second of flood: admission admitted 20 a second and refused 40.
    for i in range(60):
        door.outcome(i / 60, KEY, None if i % 3 == 0 else WAIT)
    assert door.shedding(KEY)
    t, passed, sent = 1.0, 0, 0
    while t < 1.5:
        t += 0.005  # 200 arrivals a second
        sent += 1
        if door.check(t, KEY) is None:
            passed += 1
    # About the admitted rate times 1.5 (30 a second) passes: not nothing, not the flood.
    assert 10 <= passed <= 20, passed
    assert passed < sent / 4


def test_shedding_stops_once_refusals_fall_under_the_exit_share() -> None:
    door = Door(DoorSettings(window_s=1.0, exit_share=0.1))
    flooded(door)
    assert door.shedding(KEY)
    # The flood ends: what passes is admitted, and the refusals decay away.
    for i in range(50):
        door.outcome(1.0 + i * 0.1, KEY, None)
    assert not door.shedding(KEY) and door.check(6.0, KEY) is None


def test_a_full_queue_sheds_every_key() -> None:
    door = Door()
    assert door.check(0.0, ("anyone", 3), queue_full=True) == Shed("queue_full", 1)
    door.outcome(0.0, KEY, Shed("queue_full", 5))
    assert door.check(0.1, KEY, queue_full=True) == Shed("queue_full", 5)


def test_the_number_of_keys_is_bounded() -> None:
    door = Door(DoorSettings(max_keys=2))
    for name in ("a", "b", "c"):
        door.outcome(0.0, (name, 0), WAIT)
    assert len(door._keys) == 2 and ("a", 0) not in door._keys


@pytest.mark.parametrize(
    "kwargs",
    [{"window_s": 0.0}, {"probe_s": 0.0}, {"headroom": -1.0}, {"burst": 0.5},
     {"exit_share": 0.6, "enter_share": 0.5}, {"max_keys": 0}],
)  # fmt: skip
def test_bad_settings_are_refused(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        DoorSettings(**kwargs)  # type: ignore[arg-type]
