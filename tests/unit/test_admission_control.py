"""The admission steps both clocks drive: a tenant within its share is admitted even when the rule
would refuse, a free slot admits and is marked taken, and the queue's bounds and Retry-After hold."""

from __future__ import annotations

from scheduler.core.admission import AdmissionSettings, Refusal
from scheduler.core.admission_control import AdmissionControl, Admitted
from scheduler.core.admission_queue import QueueSettings
from scheduler.core.inflight import InflightLedger


def loaded_control(cap: int = 2) -> AdmissionControl[str]:
    """A fleet of one instance that finished 10 requests/s for 5 s with 50 waiting."""
    ledger = InflightLedger(cap)
    control: AdmissionControl[str] = AdmissionControl(
        AdmissionSettings(max_queue_wait_s=1.0, standing_queue_wait_s=1.0),
        QueueSettings(size=2, timeout_s=3.0),
        ledger,
    )
    for step in range(500):
        now = step * 0.01
        ledger.attach("i", f"r{step}")
        if step % 10 == 0:
            ledger.release(f"r{step}")
        control.observe(now, 50)
    return control


def test_refuses_a_flooder_and_admits_a_tenant_within_its_share() -> None:
    control = loaded_control()
    for _ in range(3):  # the flooder holds work in the fleet
        control.shares.admitted("flood")
    refused = control.decide(5.0, 50, 0, "flood", 0, 1)
    assert isinstance(refused, Refusal)
    assert refused.expected_wait_s > refused.limit_s and refused.retry_after_s >= 1
    quiet = control.decide(5.0, 50, 0, "quiet", 0, 1)
    assert quiet == Admitted(startable=False)
    control.finished("quiet")
    assert control.shares.active("quiet") == 0


def test_a_free_slot_admits_at_once() -> None:
    control = loaded_control(cap=1000)
    control.shares.admitted("flood")
    assert control.decide(5.0, 50, 1, "flood", 0, 1) == Admitted(startable=True)


def test_queue_bound_deadline_and_retry_after() -> None:
    control = loaded_control()
    assert control.join(5.0, "a", None, 0) and control.join(5.0, "b", None, 0)
    assert not control.join(5.0, "c", None, 0)  # size 2
    assert control.deadline("a") == 8.0
    assert control.wake(5.1) == "a"
    assert control.expire(8.5) == ["b"]
    assert 1 <= control.retry_after(8.5, 50) <= control.rule.settings.max_retry_after_s
    assert control.retry_after(8.5, 0) == 1
