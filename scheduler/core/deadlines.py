"""Per-instance deadlines for the request path: how long to wait for a first byte and between chunks.

Contract:
- `Deadlines` is pure (no clock of its own): the proxy reports each inter-chunk gap it sees on an
  instance's streams (`observe_gap`); the instance's step time is their exponentially weighted
  mean (the first gap of a stream, prefill, is not reported).
- `inter_chunk(id)` = ``slack`` x that step time, clamped to ``[inter_chunk_floor_s,
  inter_chunk_cap_s]``; the floor alone until a gap was seen.
- `first_byte(id, queued)` = ``slack`` x step time x (1 + `queued`, the requests ahead of it there),
  clamped to ``[first_byte_floor_s, first_byte_cap_s]``.
- A deadline that passes is evidence the instance is hung (the proxy continues or retries the
  request elsewhere); the proxy's own loop lag is never counted (`scheduler.loop_lag`).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class DeadlineSettings:
    first_byte_floor_s: float = 10.0
    first_byte_cap_s: float = 120.0
    inter_chunk_floor_s: float = 2.0
    inter_chunk_cap_s: float = 30.0
    slack: float = 20.0
    smoothing: float = 0.05  # weight of a new gap in the mean

    def __post_init__(self) -> None:
        if not 0 < self.first_byte_floor_s <= self.first_byte_cap_s:
            raise ValueError("first-byte deadline: need 0 < floor <= cap")
        if not 0 < self.inter_chunk_floor_s <= self.inter_chunk_cap_s:
            raise ValueError("inter-chunk deadline: need 0 < floor <= cap")
        if self.slack <= 0 or not 0 < self.smoothing <= 1:
            raise ValueError("slack must be > 0 and smoothing in (0, 1]")


class Deadlines:
    def __init__(self, settings: DeadlineSettings | None = None) -> None:
        self.settings = settings or DeadlineSettings()
        self._step: dict[str, float] = {}

    def observe_gap(self, instance_id: str, seconds: float) -> None:
        step = self._step.get(instance_id)
        if step is None:
            self._step[instance_id] = seconds
        else:
            self._step[instance_id] = step + self.settings.smoothing * (seconds - step)

    def step_time(self, instance_id: str) -> float | None:
        return self._step.get(instance_id)

    def inter_chunk(self, instance_id: str) -> float:
        s = self.settings
        step = self._step.get(instance_id)
        if step is None:
            return s.inter_chunk_floor_s
        return min(max(s.slack * step, s.inter_chunk_floor_s), s.inter_chunk_cap_s)

    def first_byte(self, instance_id: str, queued: int) -> float:
        s = self.settings
        step = self._step.get(instance_id)
        if step is None:
            return s.first_byte_floor_s
        expected = s.slack * step * (1 + max(0, queued))
        return min(max(expected, s.first_byte_floor_s), s.first_byte_cap_s)

    def forget(self, instance_id: str) -> None:
        self._step.pop(instance_id, None)
