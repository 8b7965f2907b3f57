"""Cache truth: does each engine hit what the router's KV-event index says it caches?

Contract:
- `expect(key, instance_id, claimed_tokens, block_size)` at dispatch: the prompt tokens the event
  index claimed cached on the chosen instance (`Routed.claimed_blocks`); `observe(key, model,
  cached_tokens)` when the engine's answer reports its own ``cached_tokens``; `forget(key)` when
  the request ends without one. Each dispatch is checked at most once.
- A check's missing tokens: claimed less reported less one block (an engine recomputes at least a
  prompt's last token, so a full hit reads a block short), never below 0. An instance's divergence
  is missing over claimed across its last `window` checks that claimed anything.
- An instance turns *diverging* when its divergence over at least `min_checks` checks exceeds
  `diverge_ratio`, and agrees again when, over `min_checks` fresh checks, it is at most
  `agree_ratio` (its window restarts at each turn). `observe` returns the `Turn`; `check` also
  applies it to a `ClusterState` (the instance is matched by the approximate index until it
  agrees), for the driver to log.
- `totals` per (instance, model): checks, claimed and missing tokens, for metrics.
Pure: no clock, no I/O; the proxy and the simulator drive the same object.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from scheduler.core.cluster_state import ClusterState


@dataclass(frozen=True, slots=True)
class TruthSettings:
    window: int = 32
    min_checks: int = 8
    diverge_ratio: float = 0.3
    agree_ratio: float = 0.1

    def __post_init__(self) -> None:
        if self.window < 1 or not 1 <= self.min_checks <= self.window:
            raise ValueError("cache truth needs 1 <= min_checks <= window")
        if not 0.0 <= self.agree_ratio < self.diverge_ratio <= 1.0:
            raise ValueError("cache truth needs 0 <= agree_ratio < diverge_ratio <= 1")


@dataclass(frozen=True, slots=True)
class Turn:
    """An instance's index stopped (diverging=True) or started again to match its engine."""

    instance_id: str
    diverging: bool
    divergence: float  # over the checks that decided the turn
    checks: int
    claimed_tokens: int
    missing_tokens: int


@dataclass(slots=True)
class Totals:
    checks: int = 0
    claimed_tokens: int = 0
    missing_tokens: int = 0


@dataclass(slots=True)
class _Expected:
    instance_id: str
    claimed_tokens: int
    block_size: int


@dataclass(slots=True)
class _Window:
    checks: deque[tuple[int, int]]  # (claimed, missing) of its last checks that claimed anything
    diverging: bool = False

    def sums(self) -> tuple[int, int]:
        claimed = missing = 0
        for c, m in self.checks:
            claimed += c
            missing += m
        return claimed, missing


@dataclass
class CacheTruth:
    settings: TruthSettings = field(default_factory=TruthSettings)
    totals: dict[tuple[str, str], Totals] = field(default_factory=dict)
    _expected: dict[str, _Expected] = field(default_factory=dict)
    _windows: dict[str, _Window] = field(default_factory=dict)

    def expect(self, key: str, instance_id: str, claimed_tokens: int, block_size: int) -> None:
        self._expected[key] = _Expected(instance_id, max(claimed_tokens, 0), block_size)

    def forget(self, key: str) -> None:
        self._expected.pop(key, None)

    def observe(self, key: str, model: str, cached_tokens: int) -> Turn | None:
        expected = self._expected.pop(key, None)
        if expected is None:
            return None
        claimed = expected.claimed_tokens
        missing = max(0, claimed - max(cached_tokens, 0) - expected.block_size)
        totals = self.totals.setdefault((expected.instance_id, model), Totals())
        totals.checks += 1
        totals.claimed_tokens += claimed
        totals.missing_tokens += missing
        if claimed == 0:
            return None
        window = self._windows.get(expected.instance_id)
        if window is None:
            window = _Window(deque(maxlen=self.settings.window))
            self._windows[expected.instance_id] = window
        window.checks.append((claimed, missing))
        if len(window.checks) < self.settings.min_checks:
            return None
        claimed_sum, missing_sum = window.sums()
        ratio = missing_sum / claimed_sum
        if window.diverging:
            turns = ratio <= self.settings.agree_ratio
        else:
            turns = ratio > self.settings.diverge_ratio
        if not turns:
            return None
        window.diverging = not window.diverging
        checks = len(window.checks)
        window.checks.clear()
        return Turn(expected.instance_id, window.diverging, ratio, checks, claimed_sum, missing_sum)

    def check(self, cluster: ClusterState, key: str, model: str, cached_tokens: int) -> Turn | None:
        """`observe`, and route a turned instance by its events or by the approximate index."""
        turn = self.observe(key, model, cached_tokens)
        if turn is not None and turn.instance_id in cluster:
            cluster.set_index_trusted(turn.instance_id, not turn.diverging)
            cluster.touch(turn.instance_id)
        return turn

    def missing_tokens(self) -> int:
        """Claimed cached tokens the engines recomputed, over every check."""
        return sum(t.missing_tokens for t in self.totals.values())

    def divergence(self, instance_id: str) -> float:
        """Missing over claimed across the instance's current window (0 with no checks)."""
        window = self._windows.get(instance_id)
        if window is None:
            return 0.0
        claimed, missing = window.sums()
        return missing / claimed if claimed else 0.0

    def diverging(self, instance_id: str) -> bool:
        window = self._windows.get(instance_id)
        return window is not None and window.diverging

    def checked_instances(self) -> list[str]:
        """The instances with a window (some check claimed blocks there)."""
        return list(self._windows)

    def remove_instance(self, instance_id: str) -> None:
        """An instance left: its window goes (a re-join starts trusted); its totals stay."""
        self._windows.pop(instance_id, None)
        for key in [k for k, e in self._expected.items() if e.instance_id == instance_id]:
            del self._expected[key]
