"""Approximate prefix index: what each instance probably caches, from the router's own decisions.

Contract:
- For instances that publish no KV events (a plain vLLM/SGLang server without events), the router
  records the block chain of every request it routes there (`insert(instance_id, chain, now)`):
  the engine will have computed those blocks, and probably still caches them for a while.
- Each entry lives `ttl_s` seconds from its last insert (a re-insert refreshes it), and each
  instance keeps at most `max_blocks_per_instance` entries (least recently inserted evicted first),
  so the index is bounded in time and memory, as Dynamo's ApproxKvIndexer (TTL 120 s) and SGLang's
  router tree (periodic eviction to a max size) are.
- The same index serves as a short-lived "pending" view for event-publishing instances: a routed
  request's blocks count as cached there for a few seconds, until the engine's events confirm
  them, so a burst of requests sharing a prefix does not scatter before the first one is prefilled.
- Expiry (`expire(now)`, also run by `match`) takes the instances whose oldest entry is due from a
  heap, so a call with nothing due costs O(1), and drops at most `max_expire_per_call` entries per
  call: a backlog (a burst's entries all expiring together) is spread over the next calls instead of
  landing in one routing decision, and an entry may outlive its TTL until the backlog is worked off.
  Its block -> instances map (`BlockOwners`, the precise index's class) is split over
  `num_shards` dicts: it grows inside routing decisions, and one big dict would stall a decision
  for milliseconds each time it grows. `num_shards=1` keeps one plain dict instead: the same
  answers for 20-30% less work per block, for a caller that counts total time rather than the
  worst decision (the simulator).
  Pure: the caller supplies `now`.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import count, islice, repeat, takewhile

from scheduler.core.prefix_index import BlockOwners, InstanceSlots, match_chain


@dataclass(slots=True)
class _Entries:
    bit: int
    ttl_s: float
    expiry: dict[int, float] = field(default_factory=dict)  # insertion order == expiry order
    due: bool = False  # has an item in the index's due heap
    removed: bool = False


class ApproxIndex:
    def __init__(
        self,
        ttl_s: float = 120.0,
        max_blocks_per_instance: int = 1 << 16,
        max_expire_per_call: int = 4096,
        slots: InstanceSlots | None = None,
        num_shards: int = 64,
    ) -> None:
        if ttl_s <= 0 or max_blocks_per_instance <= 0 or max_expire_per_call <= 0:
            raise ValueError("ttl_s, max_blocks_per_instance, max_expire_per_call must be positive")
        self.default_ttl_s = ttl_s
        self.max_blocks_per_instance = max_blocks_per_instance
        self.max_expire_per_call = max_expire_per_call
        self.owners = BlockOwners(num_shards)
        self._own_slots = slots is None
        self.slots = InstanceSlots() if slots is None else slots
        self._instances: dict[str, _Entries] = {}
        # (a deadline no later than the instance's oldest entry, tie-break, its entries)
        self._due: list[tuple[float, int, _Entries]] = []
        self._tie = count()

    def add_instance(self, instance_id: str, ttl_s: float | None = None) -> None:
        """Register (or re-register, which clears) an instance with its own TTL."""
        self._forget(instance_id)
        bit = self.slots.bit(instance_id)
        self._instances[instance_id] = _Entries(bit, ttl_s or self.default_ttl_s)

    def set_ttl(self, instance_id: str, ttl_s: float | None) -> None:
        """The TTL of the instance's next inserts (None: the default); its entries keep theirs,
        and a shorter TTL's entries wait behind the older ones (expiry runs in insertion order)."""
        self._instances[instance_id].ttl_s = ttl_s or self.default_ttl_s

    def remove_instance(self, instance_id: str) -> None:
        if self._forget(instance_id) and self._own_slots:
            self.slots.release(instance_id)

    def _forget(self, instance_id: str) -> bool:
        entries = self._instances.pop(instance_id, None)
        if entries is None:
            return False
        entries.removed = True  # its heap item, if any, is skipped when it comes due
        self.owners.discard_many(list(entries.expiry), entries.bit)
        return True

    def __contains__(self, instance_id: object) -> bool:
        return instance_id in self._instances

    def num_blocks(self, instance_id: str) -> int:
        return len(self._instances[instance_id].expiry)

    def insert(self, instance_id: str, chain: Sequence[int], now: float) -> None:
        entries = self._instances[instance_id]
        expiry, deadline = entries.expiry, now + entries.ttl_s
        before = len(expiry)
        expiry.update(zip(chain, repeat(deadline)))
        grew = len(expiry) - before
        if grew == len(chain):  # the usual tail: every block is new here
            self.owners.add_many(chain, entries.bit)
        else:
            # New blocks were appended last; the held ones (or a block the chain repeats) keep
            # their place, but a re-insert refreshes it: the chain moves to the end, in order.
            self.owners.add_many(list(islice(reversed(expiry.keys()), grew)), entries.bit)
            ordered = dict.fromkeys(chain)
            deque(map(expiry.pop, ordered), maxlen=0)
            expiry.update(zip(ordered, repeat(deadline)))
        excess = len(expiry) - self.max_blocks_per_instance
        if excess > 0:
            self._drop_oldest(entries, list(islice(expiry, excess)))
        if not entries.due and expiry:
            self._queue(entries)

    def _queue(self, entries: _Entries) -> None:
        oldest = next(iter(entries.expiry.values()))
        heapq.heappush(self._due, (oldest, next(self._tie), entries))
        entries.due = True

    def _drop_oldest(self, entries: _Entries, oldest: list[int]) -> None:
        """Drop `oldest`, the leading run of the instance's entries."""
        if len(oldest) == len(entries.expiry):
            entries.expiry.clear()
        else:
            deque(map(entries.expiry.__delitem__, oldest), maxlen=0)
        self.owners.discard_many(oldest, entries.bit)

    def expire(self, now: float) -> None:
        """Drop entries whose TTL has passed, at most `max_expire_per_call` of them."""
        now = float(now)  # `now.__ge__` below compares floats only
        budget = self.max_expire_per_call
        due = self._due
        while due and due[0][0] <= now and budget:
            entries = heapq.heappop(due)[2]
            entries.due = False
            if entries.removed:
                continue
            # Deadlines are in insertion order: the expired entries are a leading run.
            expiry = entries.expiry
            if now >= next(reversed(expiry.values())):  # all due: the usual quiet instance
                passed = min(len(expiry), budget)
            else:
                passed = len(list(takewhile(now.__ge__, islice(expiry.values(), budget))))
            oldest = list(islice(expiry, passed))
            self._drop_oldest(entries, oldest)
            budget -= len(oldest)
            if expiry:
                self._queue(entries)

    def match(self, chain: Sequence[int], now: float) -> dict[str, int]:
        self.expire(now)
        return match_chain(chain, (self.owners,), self.slots)
