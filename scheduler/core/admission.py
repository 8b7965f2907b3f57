"""Admission by expected wait: refuse a request the fleet could not start within the allowed wait.

Contract:
- A request waits only where an engine queues it (`queued_at`): what is there beyond its batch
  slots (``InstanceView.batch_slots``, when known; the engine's count, or the proxy's requests in
  flight there when more) or, while its KV pool cannot take the queue's
  head, what it reports waiting. Slots unknown (vLLM without ``--max-num-seqs``): what it reports
  waiting (a queue seen in two reports in a row, less those deferred for a pull:
  `InstanceState`), unless it runs fewer than the most it was seen running (`running_peak`).
  A scrape that has not yet seen a request start is no queue, nor a long generation in a batch
  with free slots.
  `can_start(view)`: a new request would start at once there.
- `fleet_queue(views, saturated)`: over the dispatchable instances, the requests they queue and
  the batch slots free for new requests on those not saturated (``math.inf`` where unknown).
- `Admission` is pure (explicit `now`). The caller reports, at arrivals and completions,
  `observe(now, completed, ahead)`: the fleet's running count of finished requests and the
  requests waiting to start (the proxy's admission queue plus `queued_at` each instance).
- Service rate: completions per second of *busy* time (requests waiting through it), as decayed
  sums (time constant ``decay_s``); used once ``min_busy_s`` of busy time and a completion are
  behind it. Short of that, busy for ``s >= min_busy_s`` seconds since its last completion, the
  fleet completes at most one request per ``s``. `rate` is None while neither is known.
- `refusal(ahead, startable)`: None to admit (always when `startable`: some instance would start
  the request at once, and while the rate is unknown), else a `Refusal` with the expected wait
  ``ahead / rate``, the wait allowed (``limit_s``) and ``retry_after_s`` in ``[1, max]``.
- ``limit_s`` is ``max_queue_wait_s`` while the queue emptied within that long, else
  ``standing_queue_wait_s`` (controlled delay: Maurer, "Fail at Scale", ACM Queue 2015).
  `capacity_lost(now)`: an instance left; the queue its requests form on the survivors is a burst
  (the full wait from `now`), not a flood.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Iterable
from dataclasses import dataclass

from policies.views import InstanceView


def _kv_bound(view: InstanceView) -> bool:
    """The engine cannot admit its queue's head: its free KV blocks are fewer than it needs."""
    return view.reported_waiting > 0 and view.head_waiting_blocks > view.free_blocks


def _occupied(view: InstanceView) -> int:
    """Requests holding or wanting a slot: the engine's, or the proxy's in flight there when more
    (those still on their way through the instance's HTTP server wait too)."""
    return max(view.num_running + view.num_waiting, view.inflight)


def _below_peak(view: InstanceView) -> bool:
    """Slots unknown: the engine runs fewer than it was seen running at once (its slots are at
    least that many), and its KV pool is not what holds its queue: what waits there is starting."""
    return view.num_running < view.running_peak and not _kv_bound(view)


def queued_at(view: InstanceView) -> int:
    """Requests queued at one instance (module contract)."""
    slots = view.batch_slots
    if slots <= 0:
        return 0 if _below_peak(view) else view.reported_waiting
    # With its slots known, what the engine reported waiting counts only while its KV pool is
    # what holds the queue: a request that arrived between two steps waits for no one.
    beyond = _occupied(view) - slots
    return max(beyond, view.reported_waiting if _kv_bound(view) else 0, 0)


def can_start(view: InstanceView) -> bool:
    """A new request would start at once on this (dispatchable) instance."""
    slots = view.batch_slots
    if slots <= 0:
        return view.reported_waiting <= 0 or _below_peak(view)
    return _occupied(view) < slots and not _kv_bound(view)


def fleet_queue(views: Iterable[InstanceView], saturated: Collection[str]) -> tuple[int, float]:
    """(requests queued at the dispatchable instances, batch slots free there; module contract)."""
    queued, free = 0, 0.0
    for view in views:
        if not view.dispatchable:
            continue
        queued += queued_at(view)
        if view.instance_id not in saturated and can_start(view):
            slots = view.batch_slots
            free += slots - _occupied(view) if slots else math.inf
    return queued, free


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

    def capacity_lost(self, now: float) -> None:
        if self._queued_since is not None:
            self._queued_since = max(self._queued_since, now)

    @property
    def limit_s(self) -> float:
        """The wait allowed now: the full one, or the standing queue's (module contract)."""
        settings = self.settings
        since, last = self._queued_since, self._last
        if since is not None and last is not None and last - since >= settings.max_queue_wait_s:
            return settings.standing_queue_wait_s
        return settings.max_queue_wait_s

    def refusal(self, ahead: int, startable: bool = False) -> Refusal | None:
        if startable:
            return None
        wait = self.expected_wait(ahead)
        limit = self.limit_s
        if wait is None or wait <= limit:
            return None
        cap = self.settings.max_retry_after_s
        return Refusal(wait, limit, min(cap, max(1, math.ceil(wait - limit))))
