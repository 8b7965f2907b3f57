"""The door: refuse at the request head what admission is refusing anyway, before it costs more.

Contract:
- Pure (explicit `now`, seconds); one state per key (a tenant and priority class: what admission
  tells apart), at most `DoorSettings.max_keys` of them (the oldest forgotten first).
- `outcome(now, key, refusal)`: what admission decided for a request the door let through:
  admitted (None), or refused (`Shed`: its code and ``Retry-After``). Both are decayed sums
  (time constant ``window_s``).
- A key sheds once at least ``min_refusals`` of its recent outcomes were refusals and they were
  at least ``enter_share`` of them; it stops once they fall under ``exit_share`` (hysteresis:
  while shedding, what passes is mostly what admission admits).
- `check(now, key, queue_full)`: None to let the request through to admission, else the `Shed`
  to answer (the key's last refusal). ``queue_full`` (the admission queue at its bound) sheds
  every key. A shedding key still lets through its recent admitted rate times ``1 + headroom``
  plus one request every ``probe_s`` (a token bucket of at most ``burst``), so admission keeps
  measuring the fleet and the door sees the flood end: arrivals under that rate all pass.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

Key = tuple[str | None, int]  # (tenant, priority class)


@dataclass(frozen=True, slots=True)
class DoorSettings:
    window_s: float = 1.0
    enter_share: float = 0.5
    exit_share: float = 0.1
    min_refusals: float = 4.0
    headroom: float = 0.5
    probe_s: float = 0.05
    burst: float = 4.0
    max_keys: int = 4096

    def __post_init__(self) -> None:
        if self.window_s <= 0 or self.probe_s <= 0 or self.headroom < 0 or self.burst < 1:
            raise ValueError("window_s and probe_s must be > 0, headroom >= 0, burst >= 1")
        if not 0 <= self.exit_share <= self.enter_share <= 1:
            raise ValueError("need 0 <= exit_share <= enter_share <= 1")
        if self.max_keys < 1:
            raise ValueError("max_keys must be >= 1")


@dataclass(frozen=True, slots=True)
class Shed:
    code: str  # the admission refusal's (``queue_wait``, ``queue_full``, ``queue_timeout``)
    retry_after_s: int


@dataclass(slots=True)
class _KeyState:
    updated: float
    admitted: float = 0.0  # decayed counts
    refused: float = 0.0
    shedding: bool = False
    credit: float = 0.0  # requests a shedding key may still let through
    credited: float = 0.0  # when `credit` was last topped up
    last: Shed | None = None

    def decay(self, now: float, window_s: float) -> None:
        if now > self.updated:
            factor = math.exp(-(now - self.updated) / window_s)
            self.admitted *= factor
            self.refused *= factor


class Door:
    """Per-key shedding state (see the module contract)."""

    __slots__ = ("_keys", "settings")

    def __init__(self, settings: DoorSettings | None = None) -> None:
        self.settings = settings or DoorSettings()
        self._keys: dict[Key, _KeyState] = {}

    def shedding(self, key: Key) -> bool:
        state = self._keys.get(key)
        return state is not None and state.shedding

    def outcome(self, now: float, key: Key, refusal: Shed | None) -> None:
        settings = self.settings
        state = self._keys.get(key)
        if state is None:
            if refusal is None:
                return  # admitted and unknown: nothing to remember
            state = self._new(key, now)
        state.decay(now, settings.window_s)
        state.updated = max(state.updated, now)
        if refusal is None:
            state.admitted += 1
        else:
            state.refused += 1
            state.last = refusal
        share = state.refused / (state.admitted + state.refused)
        if state.shedding:
            state.shedding = share >= settings.exit_share
        elif state.refused >= settings.min_refusals and share >= settings.enter_share:
            state.shedding = True
            state.credit, state.credited = 0.0, now

    def check(self, now: float, key: Key, queue_full: bool = False) -> Shed | None:
        state = self._keys.get(key)
        if queue_full:
            last = None if state is None else state.last
            return last if last is not None and last.code == "queue_full" else Shed("queue_full", 1)
        if state is None or not state.shedding or state.last is None:
            return None
        settings = self.settings
        elapsed = now - state.credited
        if elapsed > 0:
            # The admitted rate, from the decayed count (a rate r holds it near r * window_s).
            rate = state.admitted / settings.window_s * (1 + settings.headroom)
            state.credit = min(
                settings.burst, state.credit + elapsed * (rate + 1 / settings.probe_s)
            )
            state.credited = now
        if state.credit >= 1:
            state.credit -= 1
            return None
        return state.last

    def _new(self, key: Key, now: float) -> _KeyState:
        keys = self._keys
        if len(keys) >= self.settings.max_keys:
            del keys[next(iter(keys))]
        state = keys[key] = _KeyState(now)
        return state
