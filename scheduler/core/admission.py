"""Admission by expected wait: refuse a request the fleet could not start within the allowed wait.

Contract:
- `Admission` is pure (explicit `now`). The caller reports what it sees, at arrivals and
  completions: `observe(now, completed, ahead)`, where `completed` is the fleet's running count of
  requests it finished (monotonic) and `ahead` the requests waiting to start: the proxy's
  admission queue plus `waiting_at` each instance.
- `waiting_at(view)`: what the instance reports queued, or what the proxy has in flight there
  beyond what it runs (queued in its HTTP server or engine), whichever is more.
- Service rate: completions per second of *busy* time, as exponentially decayed sums
  (time constant ``decay_s``): an interval counts only when requests were waiting through it,
  because only then do completions measure what the fleet can serve rather than what clients
  asked for. The measured rate (completions over busy time) is used once ``min_busy_s`` of busy
  time and at least one (decayed) completion are behind it. Short of that, the fleet is bounded by
  what it did not do: busy for ``s`` >= ``min_busy_s`` seconds since its last completion, it
  completes at most about one request per ``s`` seconds, and `rate` is that bound (so a cold
  fleet serving long requests, or a stalled one, refuses by how long it has gone without a
  completion, neither admitting without limit nor refusing everything; a fleet between two
  completions less than ``min_busy_s`` apart is not judged by that gap). `rate` is None while
  neither is known: before ``min_busy_s`` of busy time, or at a completion before the measured
  rate is used.
- `refusal(ahead)`: None to admit, else a `Refusal` with the expected wait ``ahead / rate``
  (seconds), the wait allowed (``limit_s``) and ``retry_after_s``, an integer of seconds in
  ``[1, max_retry_after_s]``: when enough of the queue ahead will have been served for the wait to
  be back within bounds. Requests are refused only while the expected wait exceeds the allowed
  one; with an unknown rate nothing is refused here (the caller's count bound on its queue still
  holds).
- The allowed wait (`limit_s`) is ``max_queue_wait_s`` while the queue has been empty (an
  observation with ``ahead == 0``) within the last ``max_queue_wait_s`` seconds, and
  ``standing_queue_wait_s`` once it has not (controlled delay, as in Maurer, "Fail at Scale",
  ACM Queue 2015, after CoDel): a burst may queue for the full wait, a flood keeps only a short
  standing queue, so service is back soon after the flood ends.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from policies.views import InstanceView


def waiting_at(view: InstanceView) -> int:
    """Requests at one instance that wait to start, as admission counts them (module contract)."""
    return max(0, view.num_waiting, view.inflight - view.num_running)


@dataclass(slots=True)
class AdmissionSettings:
    max_queue_wait_s: float = 1.0
    standing_queue_wait_s: float = 0.25  # allowed once the queue stood that long (contract)
    decay_s: float = 3.0  # how fast old completions stop counting towards the rate
    min_busy_s: float = 0.2  # busy time needed before the rate is trusted
    max_retry_after_s: int = 60

    def __post_init__(self) -> None:
        if self.max_queue_wait_s <= 0 or self.decay_s <= 0 or self.min_busy_s < 0:
            raise ValueError("max_queue_wait_s and decay_s must be > 0, min_busy_s >= 0")
        if not 0 < self.standing_queue_wait_s <= self.max_queue_wait_s:
            raise ValueError("standing_queue_wait_s must be in (0, max_queue_wait_s]")
        if self.max_retry_after_s < 1:
            raise ValueError("max_retry_after_s must be >= 1")


@dataclass(frozen=True, slots=True)
class Refusal:
    expected_wait_s: float
    limit_s: float
    retry_after_s: int


class Admission:
    """The fleet's service rate and the expected-wait admission rule (see the module contract)."""

    __slots__ = (
        "_ahead",
        "_busy",
        "_completed",
        "_done",
        "_last",
        "_queued_since",
        "_stalled",
        "settings",
    )

    def __init__(self, settings: AdmissionSettings | None = None) -> None:
        self.settings = settings or AdmissionSettings()
        self._last: float | None = None  # time of the last observation
        self._ahead = 0  # requests waiting at the last observation
        self._done = 0  # the fleet's completion count at the last observation
        self._completed = 0.0  # decayed completions over busy time
        self._busy = 0.0  # decayed busy seconds
        self._stalled = 0.0  # busy seconds since the last completion
        self._queued_since: float | None = None  # the current non-empty stretch's first sight

    def observe(self, now: float, completed: int, ahead: int) -> None:
        last = self._last
        if last is not None and now > last:
            finished = max(0, completed - self._done)
            if self._ahead > 0:
                # Requests waited from the interval's start (observations come at every arrival
                # and completion, so intervals are short under load): its completions are
                # the fleet's capacity, not the clients' demand.
                decay = math.exp(-(now - last) / self.settings.decay_s)
                self._completed = self._completed * decay + finished
                self._busy = self._busy * decay + (now - last)
                self._stalled = 0.0 if finished else self._stalled + (now - last)
            elif finished:
                self._stalled = 0.0
        if last is None or now >= last:
            self._last = now
        if ahead <= 0:
            self._queued_since = None
        elif self._queued_since is None:
            self._queued_since = now
        self._done = completed
        self._ahead = ahead

    @property
    def rate(self) -> float | None:
        """Requests the fleet completes per second while busy (measured, or bounded by the busy
        time since its last completion); None before any busy time."""
        if self._busy >= self.settings.min_busy_s and self._completed >= 1:
            return self._completed / self._busy
        if self._stalled >= self.settings.min_busy_s and self._stalled > 0:
            return 1 / self._stalled
        return None

    def expected_wait(self, ahead: int) -> float | None:
        """Seconds a request arriving behind `ahead` waiting ones would wait; None if unknown."""
        if ahead <= 0:
            return 0.0
        rate = self.rate
        if rate is None:
            return None
        return ahead / rate

    @property
    def limit_s(self) -> float:
        """The wait allowed now: the full one, or the standing queue's (module contract)."""
        settings = self.settings
        since, last = self._queued_since, self._last
        if since is not None and last is not None and last - since >= settings.max_queue_wait_s:
            return settings.standing_queue_wait_s
        return settings.max_queue_wait_s

    def refusal(self, ahead: int) -> Refusal | None:
        wait = self.expected_wait(ahead)
        limit = self.limit_s
        if wait is None or wait <= limit:
            return None
        cap = self.settings.max_retry_after_s
        return Refusal(wait, limit, min(cap, max(1, math.ceil(wait - limit))))
