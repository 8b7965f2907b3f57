"""Traffic ramped onto an instance that joins a serving fleet (slow start, as Envoy's and HAProxy's).

Contract:
- `SlowStart(settings)`: `joined(instance_id, now)` starts an instance's ramp (a scale-out; the
  fleet's first instances never ramp); `left(instance_id)` forgets it. ``window_s`` 0: off.
- `share(instance_id, now)`: the fraction of its batch slots it may fill, ``floor`` at its join
  rising linearly to 1 over ``window_s``; 1 once the window has passed or for one not ramping.
- `held(now, requests, slots)`: the ramping instances whose requests (running and waiting, by
  `requests(id)`) reach their ramped limit, ``max(1, floor(share x slots(id)))`` (``slots`` 0,
  unknown: ``default_slots``); the router leaves them out of a new request's candidates while
  another candidate has a free batch slot (under overload a newcomer takes what it can). Ramps
  that ended are dropped as they are met.
Pure: times are arguments; the router, and so the proxy and the simulator, run the same object.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class SlowStartSettings:
    window_s: float = 0.0  # how long a new instance's share ramps (0: no ramp)
    floor: float = 0.25  # its share of batch slots when it joins
    default_slots: int = 16  # batch slots assumed where an engine does not state its own

    def __post_init__(self) -> None:
        if self.window_s < 0 or not 0.0 < self.floor <= 1.0 or self.default_slots < 1:
            raise ValueError("slow start needs window_s >= 0, 0 < floor <= 1, default_slots >= 1")


@dataclass
class SlowStart:
    settings: SlowStartSettings = field(default_factory=SlowStartSettings)
    _since: dict[str, float] = field(default_factory=dict)  # ramping instance -> its join

    @property
    def ramping(self) -> bool:
        return bool(self._since)

    def joined(self, instance_id: str, now: float) -> None:
        if self.settings.window_s > 0:
            self._since[instance_id] = now

    def left(self, instance_id: str) -> None:
        self._since.pop(instance_id, None)

    def share(self, instance_id: str, now: float) -> float:
        since = self._since.get(instance_id)
        if since is None:
            return 1.0
        done = (now - since) / self.settings.window_s
        if done >= 1.0:
            return 1.0
        floor = self.settings.floor
        return floor + (1.0 - floor) * max(0.0, done)

    def held(
        self, now: float, requests: Callable[[str], int], slots: Callable[[str], int]
    ) -> set[str]:
        out: set[str] = set()
        for instance_id in list(self._since):
            share = self.share(instance_id, now)
            if share >= 1.0:
                del self._since[instance_id]
                continue
            stated = slots(instance_id) or self.settings.default_slots
            if requests(instance_id) >= max(1, math.floor(share * stated + 1e-9)):
                out.add(instance_id)
        return out
