"""The fleet as the global scheduler knows it: registry, load, prefix indexes, policy views.

Contract:
- Registry: `add_instance` (join, or re-join: the instance's KV view is cleared and a
  `ResyncRequest` says to replay its events from the start / load a snapshot), `remove_instance`,
  `set_healthy`, `set_draining`. Unhealthy and draining instances stay visible to policies
  (migration needs them) but are never dispatchable.
- Load: `apply_report` takes a `LoadReport` (agent snapshot or Prometheus scrape); the router's
  optimistic charges live in each `InstanceState`.
- Prefix knowledge: `apply_kv_batch` / `clear_kv_view` feed the precise `PrefixIndex` (the names
  match the KV event subscriber's sink protocol); a gap is remembered and reported by
  `replay_needed`. Instances without events are matched through the `ApproxIndex` built from
  routing decisions; event-publishing instances also get a short-lived approximate entry for the
  uncached tail of each routed request until their events arrive. Both indexes share one slot
  map, and `match_array(chain, now)` walks them together: a block counts if either holds it
  (one walk, one answer in view order; `match` and the view's mapping are derived from it).
  `match_lower_array` gives the view its lower-tier rows (`ClusterView.prefix_match_tiers`): a
  second walk over every tier, only while some instance holds a block below the GPU.
- `approx_shards` splits the approximate index's map (default 64) so that its growth never stalls
  one decision for long; 1 keeps one dict, 20-30% less work per block, for a caller that
  counts total time rather than the slowest decision (the simulator). Answers are the same.
- `view(now)` returns the `ClusterView` for one decision. Instance views and numpy columns are
  kept up to date incrementally (only instances that changed are re-rendered), so building a view
  of 1,024 instances costs microseconds. `view(now, only=ids)` shows just those instances (the
  ones serving the request's model): its positions are cached per set until membership changes.
- Block size: each instance has its own (`add_instance(..., block_size=)`, default the cluster's
  `block_size`; `set_block_size` changes it and clears its precise view, to be replayed): the
  size its KV events are indexed at and its prompts charged in, so one cluster holds instances of
  models with different block sizes (a request's chain is hashed at its model's size).
- Distrust (`set_index_trusted(id, False)`, when `scheduler.core.cache_truth` finds the engine
  not hitting what its events say): the instance is matched like one without events (approximate
  index only, full chains at its full TTL) until trusted again; `claimed_depth` still answers
  from its events, so the check can see it agree.
- `disaggregated`: some instance's role is ``prefill`` or ``decode`` (the router then pairs each
  request with a P/D policy).
Pure: every time is an argument; no I/O, no threads.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass
from operator import attrgetter

import numpy as np

from kvherd.block_hash import HashAlgo
from kvherd.kv_events import KVEvent, KVEventBatch
from policies.views import COLUMNS, ClusterView, InstanceView, RequestView
from scheduler.core.approx_index import ApproxIndex
from scheduler.core.instance_state import InstanceState
from scheduler.core.load_report import LoadReport
from scheduler.core.peer_charges import Charge
from scheduler.core.prefix_index import (
    ApplyResult,
    InstanceSlots,
    PrefixIndex,
    lower_tier_counts,
    match_chain,
    match_groups,
)
from scheduler.core.ttft_model import TtftModel

# An `InstanceView`'s figures in `COLUMNS` order.
_COLUMN_FIELDS = attrgetter(*COLUMNS)


@dataclass(frozen=True, slots=True)
class ResyncRequest:
    """Rebuild this instance's KV view: replay its events from `replay_from` (or load a snapshot)."""

    instance_id: str
    replay_from: int = 0


class ClusterState:
    def __init__(
        self,
        block_size: int = 16,
        hash_algo: HashAlgo = "xxh3_64",
        approx_ttl_s: float = 120.0,
        pending_ttl_s: float = 5.0,
        max_blocks_per_instance: int = 1 << 20,
        max_blocks_total: int = 1 << 24,
        approx_max_blocks_per_instance: int = 1 << 16,
        approx_shards: int = 64,
    ) -> None:
        self.block_size = block_size
        self.ttft = TtftModel()  # each instance's TTFT, learned from the first tokens routed there
        self.hash_algo: HashAlgo = hash_algo
        self.pending_ttl_s = pending_ttl_s
        # One slot map for both indexes, so a match walks their masks OR-ed together.
        self.slots = InstanceSlots()
        self.prefix_index = PrefixIndex(
            block_size, hash_algo, max_blocks_per_instance, max_blocks_total, self.slots
        )
        self.approx_index = ApproxIndex(
            approx_ttl_s, approx_max_blocks_per_instance, slots=self.slots, num_shards=approx_shards
        )
        self.instances: dict[str, InstanceState] = {}
        self._replay: dict[str, int] = {}
        self._untrusted: set[str] = set()  # event instances matched by the approximate index
        # Views in registration order, their positions and numpy columns (kept incrementally).
        self._order: list[str] = []
        self._position: dict[str, int] = {}
        self._views: list[InstanceView] = []
        # One row per `COLUMNS` name, one column per instance, and read-only views of its rows
        # that every `ClusterView` shares (a view is valid for one decision, so it needs no copy).
        self._table = np.zeros((len(COLUMNS), 0))
        self._columns = self._bind_columns()
        self._dirty: set[str] = set()
        self._phase_only: set[str] = set()  # instances whose role is not "mixed" (`_refresh`)
        self._slot_pos: np.ndarray | None = None
        self._subsets: dict[frozenset[str], tuple[np.ndarray, dict[str, int]]] = {}
        self._hosts: dict[str, str] = {}  # instance -> the machine it runs on, where known

    # -- registry ----------------------------------------------------------------------------
    def add_instance(
        self,
        instance_id: str,
        *,
        has_kv_events: bool = False,
        trust_engine_hashes: bool = False,
        healthy: bool = True,
        now: float = 0.0,
        role: str | None = None,
        batch_slots: int = 0,
        tier_load_ratio: tuple[float, float] = (0.0, 0.0),
        block_size: int | None = None,
        host: str | None = None,
    ) -> ResyncRequest | None:
        """Register (or re-register) an instance (`role`, `batch_slots`: the operator's P/D role
        and max_num_seqs, else the reported ones; `tier_load_ratio`: what a token loaded from its
        CPU and STORAGE tiers costs in prefill tokens, `InstanceView.cpu_load_ratio`;
        `block_size`: its blocks' tokens, None: the cluster's; `host`: the machine it runs on,
        whose other instances share its CPU, `ClusterView.host_requests`). Returns a resync
        request when it has events."""
        if not instance_id:
            raise ValueError("instance_id must be non-empty")
        size = self.block_size if block_size is None else block_size
        previous = self.instances.get(instance_id)
        state = InstanceState(
            instance_id,
            size,
            has_kv_events,
            healthy,
            role=role,
            batch_slots=batch_slots,
            tier_load_ratio=tier_load_ratio,
        )
        if previous is not None:  # a re-join keeps the router's in-flight accounting
            for dispatch in previous.inflight.values():
                state.adopt(dispatch, now)
            state.incoming = previous.incoming
        self.instances[instance_id] = state
        if host:
            self._hosts[instance_id] = host
        else:
            self._hosts.pop(instance_id, None)
        ttl = None if not has_kv_events else self.pending_ttl_s
        self.approx_index.add_instance(instance_id, ttl)
        if previous is None:
            self._position[instance_id] = len(self._order)
            self._order.append(instance_id)
            self._views.append(state.view())
            self._table = np.append(self._table, np.zeros((len(COLUMNS), 1)), axis=1)
            self._columns = self._bind_columns()
            self._subsets.clear()
        self._dirty.add(instance_id)
        self._slot_pos = None
        self._replay.pop(instance_id, None)
        self._untrusted.discard(instance_id)
        if has_kv_events:
            self.prefix_index.add_instance(instance_id, trust_engine_hashes, block_size=size)
            return ResyncRequest(instance_id, 0)
        self.prefix_index.remove_instance(instance_id)
        return None

    def set_block_size(self, instance_id: str, block_size: int) -> ResyncRequest | None:
        """The instance's blocks hold `block_size` tokens from now on; its precise view is
        cleared (a resync request says to replay its events from the start)."""
        state = self.instances[instance_id]
        state.block_size = block_size
        self._dirty.add(instance_id)
        self._replay.pop(instance_id, None)
        if instance_id not in self.prefix_index:
            return None
        trust = self.prefix_index.trusts_engine_hashes(instance_id)
        self.prefix_index.add_instance(instance_id, trust, block_size=block_size)
        return ResyncRequest(instance_id, 0)

    def remove_instance(self, instance_id: str) -> list[str]:
        """Forget the instance; returns the ids of requests the router still had in flight there."""
        state = self.instances.pop(instance_id, None)
        if state is None:
            return []
        self.prefix_index.remove_instance(instance_id)
        self.approx_index.remove_instance(instance_id)
        self.slots.release(instance_id)
        self._slot_pos = None
        self._replay.pop(instance_id, None)
        self._untrusted.discard(instance_id)
        self.ttft.remove_instance(instance_id)
        self._hosts.pop(instance_id, None)
        self._dirty.discard(instance_id)
        position = self._position.pop(instance_id)
        del self._order[position]
        del self._views[position]
        self._table = np.delete(self._table, position, axis=1)
        self._columns = self._bind_columns()
        self._subsets.clear()
        for later in self._order[position:]:
            self._position[later] -= 1
        self._phase_only.discard(instance_id)
        return list(state.inflight)

    def __contains__(self, instance_id: object) -> bool:
        return instance_id in self.instances

    def get(self, instance_id: str) -> InstanceState:
        """The instance's mutable state; call `touch` after changing it directly."""
        return self.instances[instance_id]

    def touch(self, instance_id: str) -> None:
        """Mark an instance's view stale (after any change to its state)."""
        self._dirty.add(instance_id)

    def set_peer_charge(self, instance_id: str, charge: Charge) -> None:
        """What other router replicas have in flight on `instance_id` (`peer_charges`)."""
        state = self.instances[instance_id]
        if state.peer != charge:
            state.peer = charge
            self._dirty.add(instance_id)

    def set_healthy(self, instance_id: str, healthy: bool) -> None:
        self.instances[instance_id].healthy = healthy
        self._dirty.add(instance_id)

    def set_draining(self, instance_id: str, draining: bool) -> None:
        self.instances[instance_id].draining = draining
        self._dirty.add(instance_id)

    # -- load --------------------------------------------------------------------------------
    def apply_report(
        self, instance_id: str, report: LoadReport, now: float, taken_at: float | None = None
    ) -> None:
        """A load report received at `now`, snapshotted by the instance at `taken_at`."""
        if self.instances[instance_id].apply_report(report, now, taken_at):
            self._dirty.add(instance_id)

    # -- KV events (the subscriber's sink protocol) ------------------------------------------
    def apply_kv_batch(self, instance_id: str, batch: KVEventBatch) -> None:
        """Apply one batch; a gap is remembered (see `replay_needed`), never raised."""
        result = self.apply_kv_batch_result(instance_id, batch)
        if result.need_replay_from is not None:
            self._replay[instance_id] = result.need_replay_from
        elif result.applied:
            self._replay.pop(instance_id, None)

    def apply_kv_batch_result(self, instance_id: str, batch: KVEventBatch) -> ApplyResult:
        if instance_id not in self.prefix_index:
            raise KeyError(f"instance {instance_id!r} is not registered with KV events")
        return self.prefix_index.apply_batch(instance_id, batch)

    def apply_kv_events(self, instance_id: str, events: Sequence[KVEvent]) -> None:
        """In-process delivery without sequence numbers (the simulator's engines): apply in order.

        KeyError if the instance is not registered with KV events."""
        self.prefix_index.apply_events(instance_id, events)

    def replay_needed(self, instance_id: str) -> int | None:
        """First missing sequence number after a gap, until a batch applies again."""
        return self._replay.get(instance_id)

    def clear_kv_view(self, instance_id: str) -> None:
        """Full resync: forget the instance's blocks; its next batch starts the view afresh."""
        if instance_id in self.prefix_index:
            self.prefix_index.clear_instance(instance_id)
        self._replay.pop(instance_id, None)

    # -- queries -----------------------------------------------------------------------------
    def match(self, chain: Sequence[int], now: float) -> dict[str, int]:
        """Leading blocks of `chain` cached per instance, a block counting if either index has it
        (`match_array` as a mapping; instances with 0 are absent)."""
        depths = self.match_array(chain, now)
        order = self._order
        return {order[i]: int(depths[i]) for i in np.flatnonzero(depths).tolist()}

    def note_routed(
        self, instance_id: str, chain: Sequence[int], now: float, matched: int = 0
    ) -> None:
        """Record a routed request's chain in the approximate index.

        For an event-publishing instance the first `matched` blocks are already in the precise
        index, so only the tail it is about to compute is recorded (as a short-lived entry).
        """
        state = self.instances[instance_id]
        trusted = state.has_kv_events and instance_id not in self._untrusted
        tail = chain[matched:] if trusted else chain
        if tail:
            self.approx_index.insert(instance_id, tail, now)

    def set_index_trusted(self, instance_id: str, trusted: bool) -> None:
        """Match an event-publishing instance by its events (True) or, while its engine does not
        hit what they say, by the approximate index alone (False)."""
        state = self.instances[instance_id]
        if not state.has_kv_events or trusted == (instance_id not in self._untrusted):
            return
        if trusted:
            self._untrusted.discard(instance_id)
            self.approx_index.set_ttl(instance_id, self.pending_ttl_s)
        else:
            self._untrusted.add(instance_id)
            self.approx_index.set_ttl(instance_id, None)

    def index_trusted(self, instance_id: str) -> bool:
        return instance_id not in self._untrusted

    def claimed_depth(self, chain: Sequence[int], instance_id: str) -> int | None:
        """The leading blocks of `chain` that `instance_id`'s events say it holds on any tier
        (trusted or not); None for an instance without events."""
        state = self.instances.get(instance_id)
        if state is None or not state.has_kv_events:
            return None
        return match_chain(chain, self.prefix_index.tier_owners, self.slots).get(instance_id, 0)

    def _bind_columns(self) -> dict[str, np.ndarray]:
        rows = list(self._table)
        for row in rows:
            row.flags.writeable = False  # a policy must not write into the core's table
        return dict(zip(COLUMNS, rows, strict=True))

    @property
    def disaggregated(self) -> bool:
        """Some instance only prefills or only decodes (P/D disaggregation is on)."""
        self._refresh()
        return bool(self._phase_only)

    def _refresh(self) -> None:
        for instance_id in self._dirty:
            state = self.instances.get(instance_id)
            if state is None:
                continue
            view = state.view()
            position = self._position[instance_id]
            self._views[position] = view
            self._table[:, position] = _COLUMN_FIELDS(view)
            if view.role == "mixed":
                self._phase_only.discard(instance_id)
            else:
                self._phase_only.add(instance_id)
        self._dirty.clear()

    def view(
        self, now: float, exclude: Collection[str] = (), only: frozenset[str] | None = None
    ) -> ClusterView:
        """The `ClusterView` for one decision; `exclude`d instances are shown as not healthy;
        `only` (None: all) the instances the view shows."""
        self._refresh()
        if only is not None:
            return self._subset_view(now, exclude, only)
        views: Sequence[InstanceView] = self._views
        columns = self._columns
        if exclude:
            views = list(views)
            columns = dict(columns)
            dispatchable = columns["dispatchable"] = columns["dispatchable"].copy()
            for instance_id in exclude:
                position = self._position.get(instance_id)
                if position is not None:
                    views[position] = self.instances[instance_id].view(healthy_override=False)
                    dispatchable[position] = 0.0

        def array_matcher(request: RequestView) -> np.ndarray:
            return self.match_array(request.block_hashes, now)

        def tier_matcher(request: RequestView, gpu: np.ndarray) -> np.ndarray:
            return self.match_lower_array(request.block_hashes, gpu)

        # One form of the match, the array; the view derives the mapping from it for the policies
        # that ask for one. Lower tiers are matched only while some instance holds a block there.
        tiers = tier_matcher if self.prefix_index.has_lower_tiers() else None
        return ClusterView(
            views, now, None, columns, self._position, array_matcher, tiers, self._confirmed,
            self.ttft.predict, self._indexed_blocks, self._hosts,
        )  # fmt: skip

    def _subset_view(
        self, now: float, exclude: Collection[str], only: frozenset[str]
    ) -> ClusterView:
        """`view` over the instances in `only` (in registration order)."""
        cached = self._subsets.get(only)
        if cached is None:
            if len(self._subsets) > 256:  # sets of a model index no longer current
                self._subsets.clear()
            kept = sorted(self._position[i] for i in only if i in self._position)
            positions = np.array(kept, dtype=np.intp)
            cached = positions, {self._order[p]: k for k, p in enumerate(kept)}
            self._subsets[only] = cached
        positions, index = cached
        views = [self._views[p] for p in positions.tolist()]
        columns = {name: column[positions] for name, column in self._columns.items()}
        for instance_id in exclude:
            k = index.get(instance_id)
            if k is not None:
                views[k] = self.instances[instance_id].view(healthy_override=False)
                columns["dispatchable"][k] = 0.0
        full: dict[str, np.ndarray] = {}  # the whole fleet's GPU match, for the lower tiers

        def array_matcher(request: RequestView) -> np.ndarray:
            depths = full[request.request_id] = self.match_array(request.block_hashes, now)
            return depths[positions]

        def tier_matcher(request: RequestView, gpu: np.ndarray) -> np.ndarray:
            depths = full.get(request.request_id)
            if depths is None:
                depths = self.match_array(request.block_hashes, now)
            return self.match_lower_array(request.block_hashes, depths)[:, positions]

        tiers = tier_matcher if self.prefix_index.has_lower_tiers() else None
        return ClusterView(
            views, now, None, columns, index, array_matcher, tiers, self._confirmed,
            self.ttft.predict, self._indexed_blocks, self._hosts,
        )  # fmt: skip

    def _slot_position(self) -> np.ndarray:
        """Slot -> position in view order (-1 for a free slot), rebuilt after membership changes."""
        if self._slot_pos is None or len(self._slot_pos) != len(self.slots.id_of):
            table = np.full(len(self.slots.id_of), -1, dtype=np.int64)
            for slot, instance_id in enumerate(self.slots.id_of):
                if instance_id is not None and instance_id in self._position:
                    table[slot] = self._position[instance_id]
            self._slot_pos = table
        return self._slot_pos

    def match_lower_array(self, chain: Sequence[int], gpu: np.ndarray) -> np.ndarray:
        """Per lower tier and instance (view order), the blocks of `chain` continuing the
        instance's GPU match `gpu` (`match_array`, just computed) on the lower tiers."""
        index = self.prefix_index
        out = np.zeros((len(index.tier_owners) - 1, len(self._order)))
        if not index.has_lower_tiers():
            return out
        lower = index.tier_owners[1:]
        maps = (*index.tier_owners[:1], self.approx_index.owners, *lower)
        id_of, position = self.slots.id_of, self._position
        for bits, depth in match_groups(chain, maps):
            while bits:
                low = bits & -bits
                bits ^= low
                instance_id = id_of[low.bit_length() - 1]
                if instance_id is None:
                    continue
                at = position[instance_id]
                start = int(gpu[at])
                if depth > start:
                    out[:, at] = lower_tier_counts(chain[start:depth], low, lower)
        for instance_id in self._untrusted:  # its tiers are known from its events alone
            out[:, position[instance_id]] = 0.0
        return out

    def _indexed_blocks(self, instance_id: str) -> int:
        index = self.prefix_index
        return index.num_blocks(instance_id) if instance_id in index else 0

    def _confirmed(self, request: RequestView, instance_id: str) -> int | None:
        """The view's `confirmed_depth`: the leading blocks of the request the precise index
        holds for `instance_id` on any tier; None for an instance without KV events (only routing
        decisions say what it holds)."""
        state = self.instances.get(instance_id)
        if state is None or not state.has_kv_events or instance_id in self._untrusted:
            return None
        depths = match_chain(request.block_hashes, self.prefix_index.tier_owners, self.slots)
        return depths.get(instance_id, 0)

    def match_array(self, chain: Sequence[int], now: float) -> np.ndarray:
        """`match` as a float64 array in view order (registration order)."""
        self.approx_index.expire(now)
        out = self._match_indexes(chain)
        if self._untrusted:  # matched by the approximate index alone
            approx = match_chain(chain, (self.approx_index.owners,), self.slots)
            for instance_id in self._untrusted:
                out[self._position[instance_id]] = approx.get(instance_id, 0)
        return out

    def _match_indexes(self, chain: Sequence[int]) -> np.ndarray:
        maps = (self.prefix_index.owners, self.approx_index.owners)
        out = np.zeros(len(self._order))
        groups = match_groups(chain, maps)
        if not groups:
            return out
        id_of, position = self.slots.id_of, self._position
        if sum(bits.bit_count() for bits, _ in groups) <= 64:
            for bits, depth in groups:
                while bits:
                    low = bits & -bits
                    instance_id = id_of[low.bit_length() - 1]
                    if instance_id is not None:
                        out[position[instance_id]] = depth
                    bits ^= low
            return out
        # Many matching instances: one (groups x slots) bit matrix; groups are disjoint, so
        # depths @ matrix gives each slot its depth.
        width = (len(id_of) + 7) // 8
        raw = b"".join(bits.to_bytes(width, "little") for bits, _ in groups)
        matrix = np.unpackbits(
            np.frombuffer(raw, dtype=np.uint8).reshape(len(groups), width),
            axis=1,
            bitorder="little",
        )
        by_slot = np.array([depth for _, depth in groups], dtype=np.float64) @ matrix
        slot_pos = self._slot_position()
        hit = np.flatnonzero(by_slot[: len(slot_pos)])
        hit = hit[slot_pos[hit] >= 0]
        out[slot_pos[hit]] = by_slot[hit]
        return out
