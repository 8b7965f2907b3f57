"""Admission by expected wait: a request waits only where an engine queues it, the service rate is
measured while requests wait, and a request is refused exactly when no instance would start it at
once and the queue ahead of it would take longer than the allowed wait to start."""

from __future__ import annotations

import math

import pytest

from policies.views import InstanceView
from scheduler.core.admission import Admission, AdmissionSettings, can_start, queued_at


def busy_fleet(rate: float, seconds: float, ahead: int = 50, step: float = 0.01) -> Admission:
    """An `Admission` that watched a fleet finish `rate` requests/s with `ahead` waiting (the
    standing queue's bound off: these tests are about the rate)."""
    admission = Admission(AdmissionSettings(max_queue_wait_s=2.0, standing_queue_wait_s=2.0))
    now, completed, owed = 0.0, 0, 0.0
    while now < seconds:
        admission.observe(now, completed, ahead)
        now += step
        owed += rate * step
        completed += int(owed)
        owed -= int(owed)
    admission.observe(now, completed, ahead)
    return admission


def test_rate_unknown_until_busy_and_nothing_refused_then() -> None:
    admission = Admission()
    assert admission.rate is None
    assert admission.refusal(10_000) is None
    # Completions while nothing waits are demand, not capacity: still unknown.
    for i in range(100):
        admission.observe(i * 0.1, i, 0)
    assert admission.rate is None
    assert admission.refusal(10_000) is None


def test_busy_rate_is_measured() -> None:
    admission = busy_fleet(rate=40.0, seconds=5.0)
    assert admission.rate == pytest.approx(40.0, rel=0.05)
    assert admission.expected_wait(80) == pytest.approx(2.0, rel=0.05)
    assert admission.expected_wait(0) == 0.0


def test_refuses_beyond_the_wait_with_retry_after() -> None:
    admission = busy_fleet(rate=40.0, seconds=5.0)
    assert admission.refusal(60) is None  # 1.5 s of queue
    refused = admission.refusal(400)  # 10 s of queue: retry once 8 s of it are served
    assert refused is not None
    assert refused.expected_wait_s == pytest.approx(10.0, rel=0.05)
    assert refused.retry_after_s == math.ceil(refused.expected_wait_s - 2.0)
    just_over = admission.refusal(84)
    assert just_over is not None and just_over.retry_after_s == 1


def test_idle_time_does_not_dilute_the_rate() -> None:
    admission = busy_fleet(rate=40.0, seconds=5.0)
    measured = admission.rate
    # A long idle stretch with a trickle of completions: the measured capacity stands.
    admission.observe(5.0, 200, 0)
    admission.observe(65.0, 230, 0)
    admission.observe(66.0, 231, 3)
    assert admission.rate == pytest.approx(measured)


def test_the_rate_follows_a_slower_fleet() -> None:
    admission = busy_fleet(rate=40.0, seconds=5.0)
    now, completed = 5.0, 200
    for _ in range(1500):  # 15 s at 10 requests/s (an instance was lost)
        now += 0.01
        completed += 1 if round(now * 100) % 10 == 0 else 0
        admission.observe(now, completed, 50)
    assert admission.rate == pytest.approx(10.0, rel=0.15)


def test_a_stalled_fleet_refuses_with_the_longest_retry_after() -> None:
    admission = busy_fleet(rate=40.0, seconds=1.0)
    for i in range(1, 300):  # 30 s without a completion while requests wait
        admission.observe(1.0 + i * 0.1, 40, 10)
    refused = admission.refusal(10)
    assert refused is not None
    assert refused.retry_after_s == admission.settings.max_retry_after_s


def test_a_standing_queue_is_allowed_less_wait_than_a_burst() -> None:
    """Controlled delay: the full wait while the queue emptied within the last max_queue_wait_s
    seconds, the standing queue's once it has not (a flood), the full wait again once it empties."""
    admission = Admission(AdmissionSettings(max_queue_wait_s=1.0, standing_queue_wait_s=0.25))
    admission.observe(0.0, 0, 0)
    now, completed = 0.0, 0
    while now < 0.6:  # a burst: 20 waiting (0.5 s at 40/s), for 0.6 s
        now += 0.025
        completed += 1
        admission.observe(now, completed, 20)
    assert admission.rate == pytest.approx(40.0, rel=0.05)
    assert admission.limit_s == 1.0 and admission.refusal(20) is None
    while now < 1.1:  # it stands: a flood, not a burst
        now += 0.025
        completed += 1
        admission.observe(now, completed, 20)
    assert admission.limit_s == 0.25
    refused = admission.refusal(20)
    assert refused is not None and refused.limit_s == 0.25 and refused.retry_after_s == 1
    assert admission.refusal(8) is None  # 0.2 s of queue may stand
    admission.observe(now + 0.1, completed + 4, 0)  # drained
    assert admission.limit_s == 1.0 and admission.refusal(20) is None
    admission.observe(now + 0.2, completed + 8, 20)  # a new burst starts with the full wait
    assert admission.refusal(20) is None


def test_settings_are_checked() -> None:
    with pytest.raises(ValueError):
        AdmissionSettings(max_queue_wait_s=0)
    with pytest.raises(ValueError):
        AdmissionSettings(max_queue_wait_s=1.0, standing_queue_wait_s=2.0)
    with pytest.raises(ValueError):
        AdmissionSettings(standing_queue_wait_s=0)
    with pytest.raises(ValueError):
        AdmissionSettings(max_retry_after_s=0)


def cold_fleet_busy(seconds: float, ahead: int, step: float = 0.01) -> Admission:
    """A fresh `Admission` that saw `ahead` requests wait `seconds` with no completion yet (the
    standing queue's bound off)."""
    admission = Admission(AdmissionSettings(max_queue_wait_s=1.0, standing_queue_wait_s=1.0))
    for i in range(round(seconds / step) + 1):
        admission.observe(i * step, 0, ahead)
    return admission


def test_a_cold_flood_is_refused_before_the_rate_is_measured() -> None:
    # 0.25 s of busy time and no completion: the fleet completes at most about one request per
    # 0.25 s, so 100 waiting would take about 25 s to start.
    admission = cold_fleet_busy(0.25, ahead=100)
    assert admission.rate == pytest.approx(4.0)
    refused = admission.refusal(100)
    assert refused is not None
    assert refused.expected_wait_s == pytest.approx(25.0)
    assert refused.retry_after_s == 24
    assert admission.refusal(4) is None  # about 1 s


def test_a_burst_on_a_cold_fast_fleet_is_not_judged_by_its_first_milliseconds() -> None:
    # 40 requests arrive at once at a fleet that completes thousands per second: 30 ms before
    # the first completion (less than min_busy_s) says nothing of its rate, so none is refused
    # (judged as one request per 30 ms, 40 would have been a 1.2 s wait).
    admission = cold_fleet_busy(0.03, ahead=40, step=0.001)
    assert admission.rate is None
    assert admission.refusal(40) is None


def test_a_cold_fleet_of_long_requests_refuses_by_its_time_without_a_completion() -> None:
    # Long requests: busy 1 s before the first completion. The wait is bounded by that second
    # per request ahead, not unbounded (a Retry-After of a minute for a fleet about to finish).
    admission = cold_fleet_busy(1.0, ahead=3)
    refused = admission.refusal(3)
    assert refused is not None
    assert refused.expected_wait_s == pytest.approx(3.0)
    assert refused.retry_after_s == 2
    assert admission.refusal(1) is None
    # The first completions arrive (4 in about a second of busy time): the measured rate takes
    # over, and 3 waiting are within the allowed wait.
    admission.observe(1.02, 4, 3)
    assert admission.rate is not None and 4.0 < admission.rate < 5.0
    assert admission.refusal(3) is None


def test_a_request_waits_only_where_an_engine_queues_it() -> None:
    # What the engine reported waiting, or what is there beyond its batch slots.
    assert queued_at(InstanceView("a", num_running=8, num_waiting=3, reported_waiting=3)) == 3
    slots = InstanceView("a", num_running=8, num_waiting=4, batch_slots=8)
    assert queued_at(slots) == 4 and not can_start(slots)
    # Dispatched since the last report and not yet seen running (a scrape's lag, or a
    # non-streamed request whose first token the proxy never sees): no queue while slots are free.
    lagging = InstanceView("a", num_running=2, num_waiting=6, inflight=8, batch_slots=16)
    assert queued_at(lagging) == 0 and can_start(lagging)
    # On their way through the instance's HTTP server (the proxy has more in flight there than
    # the engine counts): beyond the slots, they wait too.
    in_transit = InstanceView("a", num_running=8, inflight=12, batch_slots=8)
    assert queued_at(in_transit) == 4 and not can_start(in_transit)
    # Slots unknown (vLLM does not report max_num_seqs): only what the engine says it queues.
    unknown = InstanceView("a", num_running=3, num_waiting=9, inflight=12)
    assert queued_at(unknown) == 0 and can_start(unknown)
    # A KV pool that is full queues below the batch slots: the engine's own count says so.
    kv_full = InstanceView(
        "a", num_running=5, num_waiting=2, reported_waiting=2, batch_slots=64,
        free_blocks=3, head_waiting_blocks=8,
    )  # fmt: skip
    assert queued_at(kv_full) == 2 and not can_start(kv_full)
    # Reported waiting with slots and blocks free: requests that arrived between two engine
    # steps, which wait for no one.
    between_steps = InstanceView(
        "a", num_running=5, num_waiting=2, reported_waiting=2, batch_slots=64,
        free_blocks=900, head_waiting_blocks=4,
    )  # fmt: skip
    assert queued_at(between_steps) == 0 and can_start(between_steps)
    # Long generations with free slots are no queue, however long since the last completion.
    decoding = InstanceView("a", num_running=60, inflight=60, batch_slots=64)
    assert queued_at(decoding) == 0 and can_start(decoding)


def test_slots_unknown_a_request_waits_only_where_the_engine_runs_its_most() -> None:
    # vLLM started without --max-num-seqs (the ordinary case): the most it was seen running bounds
    # its slots from below; waiting while it runs fewer is a request between two steps.
    below = InstanceView("a", num_running=8, num_waiting=1, reported_waiting=1, running_peak=12)
    assert queued_at(below) == 0 and can_start(below)
    at_peak = InstanceView("a", num_running=12, num_waiting=3, reported_waiting=3, running_peak=12)
    assert queued_at(at_peak) == 3 and not can_start(at_peak)
    # Its KV pool holding the queue is a queue below the peak too.
    kv_full = InstanceView(
        "a", num_running=8, num_waiting=2, reported_waiting=2, running_peak=12,
        free_blocks=1, head_waiting_blocks=8,
    )  # fmt: skip
    assert queued_at(kv_full) == 2 and not can_start(kv_full)


def test_nothing_is_refused_while_some_instance_would_start_it() -> None:
    admission = busy_fleet(rate=40.0, seconds=5.0)
    assert admission.refusal(400) is not None
    assert admission.refusal(400, startable=True) is None
    stalled = cold_fleet_busy(5.0, ahead=3)  # 5 s busy without a completion
    assert stalled.refusal(3) is not None
    assert stalled.refusal(3, startable=True) is None


def test_the_queue_left_by_a_lost_instance_is_a_burst() -> None:
    admission = Admission(AdmissionSettings(max_queue_wait_s=1.0, standing_queue_wait_s=0.25))
    now, completed = 0.0, 0
    while now < 1.5:  # a queue that stood 1.5 s: only the standing queue's wait
        now += 0.025
        completed += 1
        admission.observe(now, completed, 20)
    assert admission.limit_s == 0.25
    admission.capacity_lost(now)  # an instance died: its requests queue on the survivors
    assert admission.limit_s == 1.0
    admission.observe(now + 1.1, completed + 40, 20)  # still standing a second later: a flood
    assert admission.limit_s == 0.25
