"""P/D disaggregation in the simulator: each paired request's handoff to its decode instance opens
as it is admitted on its prefill instance and commits after its first token, through the fleet's
own live-migration session.

Contract:
- Pairing is production's: the `Router` with a P/D policy (`policies.base.PDPolicy`) routes each
  arrival, and `Routed.decode_id` names the decode instance (None: no handoff, e.g. conditional
  disaggregation ran it where it decodes). `expect(request_id, prefill, decode)` records one.
- `on_admitted(request_id)`: the prefill instance's engine took the request; its handoff joins
  that instance's queue: up to `MAX_HANDOFFS_OUT` handoffs out of one instance run at once, the
  rest wait in order of admission, as in the agents (`instance_agent.pd_handoff`); one whose
  turn comes after its first token finds it held. Out of a prefill-only instance the request is
  held (suspended) from its first token, so it never decodes there (`migration.core.handoff`;
  the cluster asks the engine for the hold at admission).
- `on_first_token(request_id, now)`: the prefill instance sampled the first token (so TTFT is
  recorded there and pays no transfer); `first_token_at(request_id)` keeps its time until the
  handoff ends (a held request stops decoding then, so its handoff's downtime starts there).
- A handoff is the `MigrationOrder(request, prefill, decode, "pd_handoff")` given to `start`: the
  cluster's migration driver, i.e. the agents' `SourceSession`/`DestinationSession` opened before
  the prefill (stage 0 reserves the prompt's blocks on the decode instance, sharing the ones it
  caches; live stages copy a chunked prefill's full blocks while it computes; the stop-and-copy
  at the first token sends the rest; the commit of `Request.to_state()`). `on_done(request_id,
  reason)` ends it: reason None (committed) counts ``ok``; otherwise the request decodes on its
  prefill instance and counts ``fallback`` by the abort reason (``dst_refused``: no room there).
- `on_finished(request_id)`: a request that ends before its handoff started (still waiting for
  its turn) counts ``fallback`` ``finished_first``, as the agents report it (the cluster reports
  a handoff whose session found its request finished the same way).
- Every expected handoff ends exactly once as ``ok`` or ``fallback`` (`ok + sum(fallback)` equals
  the handoffs expected, once the run is over).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from migration.core.handoff import MAX_HANDOFFS_OUT
from policies.views import MigrationOrder

HANDOFF_REASON = "pd_handoff"
FINISHED_FIRST = "finished_first"


@dataclass(slots=True)
class HandoffStats:
    expected: int = 0
    ok: int = 0
    fallback: dict[str, int] = field(default_factory=dict)

    @property
    def num_fallback(self) -> int:
        return sum(self.fallback.values())


class SimHandoffs:
    """The fleet's handoffs: pairings waiting for a first token, per-instance queues, outcomes."""

    def __init__(
        self, start: Callable[[MigrationOrder], None], max_out: int = MAX_HANDOFFS_OUT
    ) -> None:
        self._start = start
        self._max_out = max_out
        self._paired: dict[str, tuple[str, str]] = {}  # request id -> (prefill, decode)
        self._queues: dict[str, deque[str]] = {}  # prefill instance -> requests waiting a turn
        self._active: dict[str, set[str]] = {}  # prefill instance -> the requests handed off now
        self._first_token_at: dict[str, float] = {}  # paired request id -> its first token's time
        self.stats = HandoffStats()

    def paired(self, request_id: str) -> tuple[str, str] | None:
        """(prefill, decode) of a request whose handoff has not ended."""
        return self._paired.get(request_id)

    def expect(self, request_id: str, prefill: str, decode: str) -> None:
        self._paired[request_id] = (prefill, decode)
        self.stats.expected += 1

    def first_token_at(self, request_id: str) -> float | None:
        """When a request whose handoff has not ended got its first token (None: not yet)."""
        return self._first_token_at.get(request_id)

    def on_admitted(self, request_id: str) -> None:
        pair = self._paired.get(request_id)
        if pair is None:
            return
        prefill = pair[0]
        self._queues.setdefault(prefill, deque()).append(request_id)
        self._next(prefill)

    def on_first_token(self, request_id: str, now: float) -> None:
        if request_id in self._paired:
            self._first_token_at[request_id] = now

    def on_finished(self, request_id: str) -> None:
        """The request ended; if its handoff never started, it finished first."""
        pair = self._paired.get(request_id)
        if pair is None or request_id in self._active.get(pair[0], ()):
            return  # no handoff, or one in flight (its session sees the end and aborts)
        del self._paired[request_id]
        self._first_token_at.pop(request_id, None)
        queue = self._queues.get(pair[0])
        if queue is not None and request_id in queue:
            queue.remove(request_id)
        self._count_fallback(FINISHED_FIRST)

    def on_done(self, request_id: str, reason: str | None) -> None:
        prefill, _ = self._paired.pop(request_id)
        self._first_token_at.pop(request_id, None)
        self._active[prefill].discard(request_id)
        if reason is None:
            self.stats.ok += 1
        else:
            self._count_fallback(reason)
        self._next(prefill)

    def _next(self, prefill: str) -> None:
        queue = self._queues.get(prefill)
        active = self._active.setdefault(prefill, set())
        while queue and len(active) < self._max_out:
            request_id = queue.popleft()
            active.add(request_id)
            decode = self._paired[request_id][1]
            self._start(MigrationOrder(request_id, prefill, decode, HANDOFF_REASON))

    def _count_fallback(self, reason: str) -> None:
        self.stats.fallback[reason] = self.stats.fallback.get(reason, 0) + 1
