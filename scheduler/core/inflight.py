"""The fleet's in-flight ledger: which requests are in flight on which instance, and its cap.

Contract:
- Pure, no clock. `attach(instance_id, key)` when a request is dispatched; `release(key)` exactly
  once when it finished or failed, wherever it runs by then (counted in `completed`, the running
  count admission measures the service rate by); `move(key, dst)` when a live migration commits.
- Saturation cap: an instance with ``cap`` requests in flight is in `saturated` (kept in step by
  every change); the dispatcher skips it and requests wait in the admission queue instead.
- An instance that leaves the fleet keeps its entries until its requests fail over (each is
  released then); one re-added under the same id finds them still counted.
- `count(instance_id)`: its requests in flight (`total`: on all); `instance_of(key)`: where `key`
  runs, if in flight.
"""

from __future__ import annotations


class InflightLedger:
    __slots__ = ("_keys", "_where", "cap", "completed", "saturated")

    def __init__(self, cap: int) -> None:
        if cap < 1:
            raise ValueError("the in-flight cap per instance must be >= 1")
        self.cap = cap
        self.completed = 0
        self.saturated: set[str] = set()
        self._where: dict[str, str] = {}  # key -> instance
        self._keys: dict[str, set[str]] = {}  # instance -> keys

    def count(self, instance_id: str) -> int:
        keys = self._keys.get(instance_id)
        return 0 if keys is None else len(keys)

    @property
    def total(self) -> int:
        """Requests in flight, on every instance."""
        return len(self._where)

    def instance_of(self, key: str) -> str | None:
        return self._where.get(key)

    def attach(self, instance_id: str, key: str) -> None:
        if key in self._where:
            raise ValueError(f"request {key!r} is already in flight")
        self._where[key] = instance_id
        keys = self._keys.setdefault(instance_id, set())
        keys.add(key)
        if len(keys) >= self.cap:
            self.saturated.add(instance_id)

    def _detach(self, key: str) -> str | None:
        instance_id = self._where.pop(key, None)
        if instance_id is None:
            return None
        keys = self._keys[instance_id]
        keys.discard(key)
        if len(keys) < self.cap:
            self.saturated.discard(instance_id)
        if not keys:
            del self._keys[instance_id]
        return instance_id

    def release(self, key: str) -> str | None:
        """`key` finished or failed: the instance it was on (None if it was not in flight)."""
        instance_id = self._detach(key)
        if instance_id is not None:
            self.completed += 1
        return instance_id

    def move(self, key: str, dst: str) -> str | None:
        """A committed migration: `key` now runs on `dst`; the instance it left (or None)."""
        src = self._where.get(key)
        if src is None or src == dst:
            return None
        self._detach(key)
        self.attach(dst, key)
        return src
