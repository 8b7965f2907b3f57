"""The admission queue (`scheduler.core.admission_queue`): FIFO for one tenant and one class,
weighted fair share between tenants (idle share lent), classes in order, aging's bound, and the
wait ahead that the expected-wait refusal reads per tenant."""

from __future__ import annotations

import itertools

import pytest

from scheduler.core.admission_queue import AdmissionQueue, QueueSettings


def _drain(queue: AdmissionQueue[str], now: float = 0.0) -> list[str]:
    return list(iter(lambda: queue.wake(now), None))


def test_one_tenant_is_first_come_first_served_within_its_bounds() -> None:
    queue: AdmissionQueue[str] = AdmissionQueue(QueueSettings(size=3, timeout_s=1.0))
    assert all(queue.join(0.1 * i, f"r{i}") for i in range(3))
    assert not queue.join(0.5, "r3")  # full
    assert queue.deadline("r0") == pytest.approx(1.0)
    queue.leave("r1")
    queue.leave("r1")  # gone: a no-op
    assert queue.expire(1.05) == ["r0"]
    assert _drain(queue) == ["r2"] and len(queue) == 0 and queue.wake(0) is None


def test_backlogged_tenants_share_by_weight_and_an_idle_one_lends_its_share() -> None:
    weights = {"a": 2.0, "b": 1.0}
    queue: AdmissionQueue[str] = AdmissionQueue(weight=lambda t: weights.get(t or "", 1.0))
    for i in range(30):
        queue.join(0, f"a{i}", "a")
        queue.join(0, f"b{i}", "b")
    first = _drain(queue)[:30]
    assert sum(r.startswith("a") for r in first) == 20  # 2:1 while both wait
    # Alone, a tenant takes every turn, in its own order.
    for i in range(5):
        queue.join(1, f"b{i}", "b")
    assert _drain(queue) == [f"b{i}" for i in range(5)]


def test_a_quiet_tenant_goes_next_behind_a_flood_and_sees_little_ahead() -> None:
    queue: AdmissionQueue[str] = AdmissionQueue()
    for i in range(100):
        queue.join(0, f"f{i}", "flood")
    assert queue.ahead("flood") == 100
    assert queue.ahead("quiet") == 1  # the flooder's next turn, no more
    queue.join(0, "q0", "quiet")
    assert [queue.wake(0), queue.wake(0)] == ["f0", "q0"]  # the tie goes to the earlier
    assert _drain(queue) == [f"f{i}" for i in range(1, 100)]
    # Refusing by `ahead`: the flooder's wait grows with its own backlog, not the quiet's.
    for i in range(50):
        queue.join(0, f"f{i}", "flood")
    queue.join(0, "q1", "quiet")
    assert queue.ahead("flood") == 51 and queue.ahead("quiet") == 3


def test_classes_go_in_order_and_aging_bounds_a_low_class_wait() -> None:
    queue: AdmissionQueue[str] = AdmissionQueue(QueueSettings(aging_s=2.0))
    queue.join(0.0, "low", priority=5)
    for i in range(3):
        queue.join(0.5, f"high{i}", priority=-1)
    queue.join(0.5, "mid", priority=0)
    assert queue.ahead(priority=0) == 4 and queue.ahead(priority=10) == 5
    assert queue.wake(1.0) == "high0"
    assert queue.wake(2.0) == "low"  # waited its 2 s: ahead of every class
    assert _drain(queue, 2.0) == ["high1", "high2", "mid"]


def test_a_woken_item_that_joins_again_keeps_its_age() -> None:
    queue: AdmissionQueue[str] = AdmissionQueue(QueueSettings(aging_s=1.0))
    queue.join(0.0, "low", priority=1)
    queue.join(0.0, "high")
    assert queue.wake(0.2) == "high"
    queue.join(0.3, "high2")
    assert queue.wake(0.4) == "high2"
    woken = queue.wake(0.5)
    assert woken == "low"
    queue.join(0.6, "high3")
    queue.join(0.6, "low", priority=1, since=0.0)  # found no room: back, but aged from 0.0
    assert queue.wake(1.0) == "low"


def test_many_tenants_each_get_a_turn_in_every_round() -> None:
    queue: AdmissionQueue[str] = AdmissionQueue()
    tenants = [f"t{i}" for i in range(5)]
    for i, tenant in itertools.product(range(4), tenants):
        queue.join(0, f"{tenant}-{i}", tenant)
    order = _drain(queue)
    for r in range(4):
        assert {name.split("-")[0] for name in order[5 * r : 5 * r + 5]} == set(tenants)
