"""Passive outlier ejection with half-open probing: which instances routing may use.

Contract:
- `OutlierDetector` is pure (explicit `now`). Each instance is ``healthy``, ``ejected`` or
  ``half_open``. `consecutive_failures` failures in a row (connect errors, timeouts, 5xx) eject it for
  ``base_ejection_s`` x 2^(times ejected before, capped at ``max_ejection_s``). Once that time passes it
  is half-open: `admits` lets exactly one request (or probe) through; success makes it healthy again
  and resets the back-off, failure ejects it again for longer.
- Every state change is returned to the caller (so the proxy can count ejections and tell the
  scheduler core which instances are dispatchable); `healthy(id)` is what routing uses.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class Health(StrEnum):
    HEALTHY = "healthy"
    EJECTED = "ejected"
    HALF_OPEN = "half_open"


@dataclass(slots=True)
class _Record:
    state: Health = Health.HEALTHY
    failures: int = 0  # consecutive
    ejections: int = 0  # since the last full recovery; drives the back-off
    ejected_until: float = 0.0
    probe_in_flight: bool = False


class OutlierDetector:
    """Consecutive-failure ejection with exponential back-off and half-open probing."""

    def __init__(
        self,
        consecutive_failures: int = 3,
        base_ejection_s: float = 5.0,
        max_ejection_s: float = 120.0,
    ) -> None:
        if consecutive_failures < 1:
            raise ValueError("consecutive_failures must be >= 1")
        self.consecutive_failures = consecutive_failures
        self.base_ejection_s = base_ejection_s
        self.max_ejection_s = max_ejection_s
        self._records: dict[str, _Record] = {}

    def add(self, instance_id: str) -> None:
        self._records.setdefault(instance_id, _Record())

    def remove(self, instance_id: str) -> None:
        self._records.pop(instance_id, None)

    def state(self, instance_id: str, now: float) -> Health:
        record = self._records.get(instance_id)
        if record is None:
            return Health.EJECTED
        if record.state is Health.EJECTED and now >= record.ejected_until:
            record.state = Health.HALF_OPEN
            record.probe_in_flight = False
        return record.state

    def healthy(self, instance_id: str, now: float) -> bool:
        """May new requests be routed here (half-open instances only through `admits`)?"""
        return self.state(instance_id, now) is Health.HEALTHY

    def admits(self, instance_id: str, now: float) -> bool:
        """Claim the single trial slot of a half-open instance (True for healthy ones)."""
        state = self.state(instance_id, now)
        if state is Health.HEALTHY:
            return True
        record = self._records[instance_id]
        if state is Health.HALF_OPEN and not record.probe_in_flight:
            record.probe_in_flight = True
            return True
        return False

    def record_success(self, instance_id: str, now: float) -> Health | None:
        """Returns the new state when this success changed it."""
        record = self._records.get(instance_id)
        if record is None:
            return None
        self.state(instance_id, now)
        record.failures = 0
        if record.state is not Health.HEALTHY:
            if record.state is Health.EJECTED:
                return None  # a late success from before the ejection: wait for the timer
            record.state = Health.HEALTHY
            record.ejections = 0
            record.probe_in_flight = False
            return Health.HEALTHY
        return None

    def record_failure(self, instance_id: str, now: float) -> Health | None:
        """Returns ``Health.EJECTED`` when this failure ejected the instance."""
        record = self._records.get(instance_id)
        if record is None:
            return None
        state = self.state(instance_id, now)
        if state is Health.EJECTED:
            return None
        record.failures += 1
        if state is Health.HALF_OPEN or record.failures >= self.consecutive_failures:
            duration = min(self.base_ejection_s * 2.0**record.ejections, self.max_ejection_s)
            record.state = Health.EJECTED
            record.ejected_until = now + duration
            record.ejections += 1
            record.failures = 0
            record.probe_in_flight = False
            return Health.EJECTED
        return None
