"""One instance's load as the scheduler knows it: last report + the router's optimistic accounting.

Contract:
- `apply_report(report, now, taken_at)` replaces the reported figures (and says whether the view
  can have changed: a steady instance reports the same figures again and again). Fields the report leaves
  unknown (None) keep their previous value (a Prometheus scrape carries no request lists; an agent
  snapshot carries everything). `taken_at` is when the instance took the snapshot (default: `now`);
  reports travel, and whatever the router did after the snapshot is not in it.
- The router charges every dispatch at once (`dispatch`), moves it from "waiting" to "running" at
  its first token (`first_token`) and releases it at completion or abort (`finish`). Every such
  change is logged with its time; the effective load is the last report plus the changes made
  *after* its snapshot, so a change is counted by the report or by the log, never by both, and a
  burst between reports never lands on one instance that still looks idle. The log holds only
  changes since the last snapshot (bounded by `max_log`).
- Without any report, the load is the router's own accounting alone (a plain server that is
  neither scraped nor reporting still gets balanced).
- Router replicas: `peer` is what the other replicas last said they have in flight here
  (`peer_charges`); the view's own-accounting figures (in flight, pending prefill and its tokens,
  blocks) add it, so every replica guards and costs on the fleet's whole load; the reported
  figures already count what reached the engine.
- `view(now)` renders a read-only `InstanceView` for the policies. Pure: no clock, no I/O.
- P/D: `incoming` holds the requests paired to be handed to this instance after their first token
  elsewhere; they count in the view's `inflight` from the pairing on (so a burst of pairings
  spreads over the decode instances before any has moved), until the handoff commits (the request
  is then adopted here), falls back, or the request ends.
- Role (P/D disaggregation): the operator's `role` when given (``--instance URL,role=...``), else
  the role the instance reports, else ``mixed``. Batch slots likewise: the operator's
  ``max_num_seqs=``, else the reported ``max_num_seqs``, else unknown (0); `running_peak`, the most
  requests any report showed running, bounds them from below (learned from a plain vLLM). The
  view's `reported_waiting` is the reported queue (waiting less deferred: a pull in flight is not
  a queue) only when the previous report showed one too; a one-report blip is 0.
- LoRA: the view's `active_adapters` are the reported ones plus those of the router's dispatches
  in flight here (a burst for one adapter sees it held before the next scrape).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from operator import attrgetter

from policies.views import InstanceView
from scheduler.core.load_report import LoadReport
from scheduler.core.peer_charges import NO_CHARGE, Charge

# Every `LoadReport` field, in declaration order (one C call reads them all).
_REPORT_FIELDS = attrgetter(*LoadReport.__slots__)


@dataclass(slots=True)
class Dispatch:
    """A request the router sent to this instance and has not seen finish."""

    request_id: str
    dispatch_time: float
    prompt_tokens: int
    uncached_tokens: int  # prompt tokens not covered by the prefix hit at dispatch
    blocks: int  # KV blocks the request occupies (prompt blocks, grown by decode estimates)
    started: bool = False  # first token seen
    adapter: str | None = None  # the LoRA adapter it runs with


def _plus(reported: int | None, delta: int, own: int) -> int:
    """Reported figure plus the changes since, or the router's own count when never reported."""
    return own if reported is None else max(0, reported + delta)


class InstanceState:
    def __init__(
        self,
        instance_id: str,
        block_size: int,
        has_kv_events: bool = False,
        healthy: bool = True,
        max_log: int = 1 << 16,
        role: str | None = None,
        batch_slots: int = 0,
        tier_load_ratio: tuple[float, float] = (0.0, 0.0),
    ) -> None:
        self.instance_id = instance_id
        # Prefill-token equivalents per token loaded from CPU, STORAGE (0: the policy's default).
        self.tier_load_ratio = tier_load_ratio
        self.role = role  # the operator's override of the reported role
        self.batch_slots = batch_slots  # the operator's statement of max_num_seqs (0: as reported)
        self.incoming: set[str] = set()  # requests to be handed here after their prefill (P/D)
        self.block_size = block_size
        self.has_kv_events = has_kv_events
        self.healthy = healthy
        self.draining = False
        self.report: LoadReport = LoadReport()
        self.report_time: float | None = None
        self.running_peak = 0  # the most requests a report showed running
        self._queue = 0  # the queue the last report showed (waiting for room, not deferred)
        self.standing_queue = 0  # that queue when the report before showed one too, else 0
        self.inflight: dict[str, Dispatch] = {}
        self._adapters: dict[str, int] = {}  # LoRA adapter -> its dispatches in flight here
        # Router totals over all in-flight dispatches.
        self.pending_prefill = 0
        self.pending_prefill_tokens = 0
        self.inflight_blocks = 0
        self.peer: Charge = NO_CHARGE  # what other router replicas have in flight here
        # Changes since the last report's snapshot: (time, waiting, running, blocks, prefill tokens)
        # and their running sums.
        self._log: deque[tuple[float, int, int, int, int]] = deque(maxlen=max_log)
        self._delta_waiting = 0
        self._delta_running = 0
        self._delta_blocks = 0
        self._delta_prefill_tokens = 0
        self._log_overflowed = False  # the log dropped entries: recount the sums from it

    # -- reports -----------------------------------------------------------------------------
    def own_charge(self) -> Charge:
        """What this router replica itself has in flight here (never what peers said)."""
        return Charge(
            len(self.inflight),
            self.pending_prefill,
            self.pending_prefill_tokens,
            self.inflight_blocks,
        )

    def apply_report(self, report: LoadReport, now: float, taken_at: float | None = None) -> bool:
        """Take a report; False when the instance's view cannot have changed (the same figures
        as the previous report, and no logged change left the log)."""
        fields = _REPORT_FIELDS(report)
        previous = _REPORT_FIELDS(self.report)
        changed = fields != previous  # the usual steady report: equal, Nones included
        if changed and None in fields:  # keep what the previous report knew, this one does not
            merged = tuple(
                [old if new is None else new for new, old in zip(fields, previous, strict=True)]
            )
            if merged != fields:
                report = LoadReport(*merged)
                changed = merged != previous
        self.report = report
        self.report_time = now
        changed |= self._note_queue(report)
        cutoff = now if taken_at is None else taken_at
        log = self._log
        if self._log_overflowed:  # the deque dropped changes its running sums still hold
            while log and log[0][0] <= cutoff:
                log.popleft()
            self._delta_waiting = sum(entry[1] for entry in log)
            self._delta_running = sum(entry[2] for entry in log)
            self._delta_blocks = sum(entry[3] for entry in log)
            self._delta_prefill_tokens = sum(entry[4] for entry in log)
            self._log_overflowed = False
            return True
        if not log or log[0][0] > cutoff:
            return changed
        # Changes the snapshot already counts leave the log and its running sums.
        while log and log[0][0] <= cutoff:
            _, waiting, running, blocks, tokens = log.popleft()
            self._delta_waiting -= waiting
            self._delta_running -= running
            self._delta_blocks -= blocks
            self._delta_prefill_tokens -= tokens
        return True

    def _note_queue(self, report: LoadReport) -> bool:
        """Learn the running peak and the standing queue from a report; True if either moved."""
        peak, standing = self.running_peak, self.standing_queue
        if report.num_running is not None:
            self.running_peak = max(peak, report.num_running)
        if report.num_waiting is not None:
            queue = max(0, report.num_waiting - (report.num_deferred or 0))
            self.standing_queue = queue if self._queue > 0 else 0
            self._queue = queue
        return (peak, standing) != (self.running_peak, self.standing_queue)

    def _change(self, now: float, waiting: int, running: int, blocks: int, tokens: int) -> None:
        if len(self._log) == self._log.maxlen:
            self._log_overflowed = True
        self._log.append((now, waiting, running, blocks, tokens))
        self._delta_waiting += waiting
        self._delta_running += running
        self._delta_blocks += blocks
        self._delta_prefill_tokens += tokens

    # -- optimistic accounting ---------------------------------------------------------------
    def dispatch(
        self,
        request_id: str,
        prompt_tokens: int,
        uncached_tokens: int,
        now: float,
        adapter: str | None = None,
    ) -> None:
        if request_id in self.inflight:
            raise ValueError(f"request {request_id!r} is already in flight on {self.instance_id}")
        blocks = -(-prompt_tokens // self.block_size)
        self.inflight[request_id] = Dispatch(
            request_id, now, prompt_tokens, uncached_tokens, blocks, adapter=adapter
        )
        self._count_adapter(adapter, 1)
        self.pending_prefill += 1
        self.pending_prefill_tokens += uncached_tokens
        self.inflight_blocks += blocks
        self._change(now, 1, 0, blocks, uncached_tokens)

    def first_token(self, request_id: str, now: float) -> bool:
        """Prefill done: the request now decodes. False if unknown or already started."""
        dispatch = self.inflight.get(request_id)
        if dispatch is None or dispatch.started:
            return False
        dispatch.started = True
        self.pending_prefill -= 1
        self.pending_prefill_tokens -= dispatch.uncached_tokens
        self._change(now, -1, 1, 0, -dispatch.uncached_tokens)
        return True

    def finish(self, request_id: str, now: float) -> Dispatch | None:
        """Completed, aborted or migrated away: release its charges."""
        dispatch = self.inflight.pop(request_id, None)
        if dispatch is None:
            return None
        self._count_adapter(dispatch.adapter, -1)
        self.inflight_blocks -= dispatch.blocks
        if dispatch.started:
            self._change(now, 0, -1, -dispatch.blocks, 0)
        else:
            self.pending_prefill -= 1
            self.pending_prefill_tokens -= dispatch.uncached_tokens
            self._change(now, -1, 0, -dispatch.blocks, -dispatch.uncached_tokens)
        return dispatch

    def adopt(self, dispatch: Dispatch, now: float) -> None:
        """Take over a request migrated in (or kept across a re-join)."""
        self.inflight[dispatch.request_id] = dispatch
        self._count_adapter(dispatch.adapter, 1)
        self.inflight_blocks += dispatch.blocks
        if dispatch.started:
            self._change(now, 0, 1, dispatch.blocks, 0)
        else:
            self.pending_prefill += 1
            self.pending_prefill_tokens += dispatch.uncached_tokens
            self._change(now, 1, 0, dispatch.blocks, dispatch.uncached_tokens)

    def _count_adapter(self, adapter: str | None, change: int) -> None:
        if adapter is None:
            return
        left = self._adapters.get(adapter, 0) + change
        if left > 0:
            self._adapters[adapter] = left
        else:
            self._adapters.pop(adapter, None)

    # -- view --------------------------------------------------------------------------------
    def view(self, healthy_override: bool | None = None) -> InstanceView:
        rep = self.report
        peer = self.peer
        inflight = len(self.inflight) + peer.inflight
        pending_prefill = self.pending_prefill + peer.pending_prefill
        pending_tokens = self.pending_prefill_tokens + peer.pending_prefill_tokens
        inflight_blocks = self.inflight_blocks + peer.blocks
        num_running = _plus(rep.num_running, self._delta_running, inflight - pending_prefill)
        num_waiting = _plus(rep.num_waiting, self._delta_waiting, pending_prefill)
        waiting_tokens = _plus(
            rep.waiting_prefill_tokens, self._delta_prefill_tokens, pending_tokens
        )
        capacity = rep.num_total_blocks or 0
        if rep.num_free_blocks is not None:
            free = max(0, min(capacity or math.inf, rep.num_free_blocks - self._delta_blocks))
        elif capacity:
            free = max(0, capacity - inflight_blocks)
        else:
            free = 0
        free = int(free)
        kv_usage = (1.0 - free / capacity) if capacity else (rep.kv_usage or 0.0)
        head = rep.head_waiting_blocks
        if head is None or rep.num_waiting is None:
            pending = [d for d in self.inflight.values() if not d.started]
            head = min(pending, key=lambda d: d.dispatch_time).blocks if pending else 0
        elif num_waiting == 0:
            head = 0
        requests = num_running + num_waiting
        freeness = math.inf if requests == 0 else (free - head) / requests
        adapters = frozenset(rep.active_adapters or ())
        if self._adapters:
            adapters = adapters.union(self._adapters)
        return InstanceView(
            instance_id=self.instance_id,
            capacity=capacity,
            num_running=num_running,
            num_waiting=num_waiting,
            kv_usage=min(1.0, max(0.0, kv_usage)),
            free_blocks=free,
            cached_blocks=rep.num_cached_blocks or 0,
            freeness=freeness,
            inflight=inflight + len(self.incoming),
            pending_prefill=pending_prefill,
            pending_prefill_tokens=pending_tokens,
            inflight_blocks=inflight_blocks,
            waiting_prefill_tokens=waiting_tokens,
            head_waiting_blocks=head,
            num_preemptions=rep.num_preemptions or 0,
            batch_slots=self.batch_slots or rep.max_num_seqs or 0,
            reported_waiting=self.standing_queue,
            running_peak=self.running_peak,
            healthy=self.healthy if healthy_override is None else healthy_override,
            draining=self.draining,
            has_kv_events=self.has_kv_events,
            running=rep.running or (),
            role=self.role or rep.role or "mixed",
            cpu_load_ratio=self.tier_load_ratio[0],
            storage_load_ratio=self.tier_load_ratio[1],
            active_adapters=adapters,
            lora_slots=rep.lora_slots or 0,
        )
