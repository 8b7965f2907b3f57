"""Passive outlier ejection with half-open probing: which instances routing may use.

Contract:
- `OutlierDetector` is pure (explicit `now`). Each instance is ``healthy``, ``ejected`` or
  ``half_open``. `consecutive_failures` failures in a row (connect errors, timeouts, 5xx) eject it for
  ``base_ejection_s`` x 2^(times ejected before, capped at ``max_ejection_s``). Once that time passes it
  is half-open: `admits` lets exactly one request (or probe) through; success makes it healthy again
  and resets the back-off, failure ejects it again for longer.
- At most ``max_ejection_fraction`` of the instances (at least one) are out of rotation (ejected or
  half-open) at once, and never the last healthy one (Envoy's ``max_ejection_percent``): a failure
  past that bound is counted but ejects nothing, so a proxy-side or fleet-wide problem (overload, a
  network blip) cannot empty the fleet.
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
        max_ejection_fraction: float = 0.5,
    ) -> None:
        if consecutive_failures < 1:
            raise ValueError("consecutive_failures must be >= 1")
        if not 0 <= max_ejection_fraction <= 1:
            raise ValueError("max_ejection_fraction must be in [0, 1]")
        self.max_ejection_fraction = max_ejection_fraction
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
            if state is Health.HEALTHY and not self._may_eject(instance_id, now):
                return None
            duration = min(self.base_ejection_s * 2.0**record.ejections, self.max_ejection_s)
            record.state = Health.EJECTED
            record.ejected_until = now + duration
            record.ejections += 1
            record.failures = 0
            record.probe_in_flight = False
            return Health.EJECTED
        return None

    def _may_eject(self, instance_id: str, now: float) -> bool:
        """Would ejecting healthy `instance_id` stay within the ejection bound?"""
        out = sum(
            1
            for other in self._records
            if other != instance_id and self.state(other, now) is not Health.HEALTHY
        )
        total = len(self._records)
        if total - out - 1 < 1:  # never the last healthy instance
            return False
        return out + 1 <= max(1, int(self.max_ejection_fraction * total))
