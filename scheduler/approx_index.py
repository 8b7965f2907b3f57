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
- Expiry is applied at most every `sweep_interval_s` of the caller's clock (`now`); entries may be
  up to that much older than their TTL. Pure: the caller supplies `now`.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import filterfalse, repeat
from operator import or_

from scheduler.prefix_index import BlockOwners, InstanceSlots, match_chain


@dataclass(slots=True)
class _Entries:
    bit: int
    ttl_s: float
    expiry: dict[int, float] = field(default_factory=dict)  # insertion order == expiry order


class ApproxIndex:
    def __init__(
        self,
        ttl_s: float = 120.0,
        max_blocks_per_instance: int = 1 << 16,
        sweep_interval_s: float = 1.0,
        slots: InstanceSlots | None = None,
    ) -> None:
        if ttl_s <= 0 or max_blocks_per_instance <= 0:
            raise ValueError("ttl_s and max_blocks_per_instance must be positive")
        self.default_ttl_s = ttl_s
        self.max_blocks_per_instance = max_blocks_per_instance
        self.sweep_interval_s = sweep_interval_s
        self.owners = BlockOwners()
        self._own_slots = slots is None
        self.slots = InstanceSlots() if slots is None else slots
        self._instances: dict[str, _Entries] = {}
        self._last_sweep = float("-inf")

    def add_instance(self, instance_id: str, ttl_s: float | None = None) -> None:
        """Register (or re-register, which clears) an instance with its own TTL."""
        self._forget(instance_id)
        bit = self.slots.bit(instance_id)
        self._instances[instance_id] = _Entries(bit, ttl_s or self.default_ttl_s)

    def remove_instance(self, instance_id: str) -> None:
        if self._forget(instance_id) and self._own_slots:
            self.slots.release(instance_id)

    def _forget(self, instance_id: str) -> bool:
        entries = self._instances.pop(instance_id, None)
        if entries is None:
            return False
        for block_hash in entries.expiry:
            self.owners.discard(block_hash, entries.bit)
        return True

    def __contains__(self, instance_id: object) -> bool:
        return instance_id in self._instances

    def num_blocks(self, instance_id: str) -> int:
        return len(self._instances[instance_id].expiry)

    def insert(self, instance_id: str, chain: Sequence[int], now: float) -> None:
        entries = self._instances[instance_id]
        expiry, bit, deadline = entries.expiry, entries.bit, now + entries.ttl_s
        fresh = dict.fromkeys(chain, deadline)
        if len(fresh) == len(chain):
            # Distinct hashes (a real chain): the same as the per-block loop below, in C
            # iterators. Entries already held move to the end (re-insert refreshes their place
            # in expiry order); new ones get the instance's bit.
            added = list(filterfalse(expiry.__contains__, fresh))
            if len(added) < len(fresh):
                deque(map(expiry.__delitem__, filter(expiry.__contains__, fresh)), maxlen=0)
            owners = self.owners.owners
            bits = map(or_, map(owners.get, added, repeat(0)), repeat(bit, len(added)))
            owners.update(zip(added, bits, strict=True))
            expiry.update(fresh)
        else:
            for block_hash in chain:
                if expiry.pop(block_hash, None) is None:
                    self.owners.add(block_hash, bit)
                expiry[block_hash] = deadline
        while len(expiry) > self.max_blocks_per_instance:
            oldest = next(iter(expiry))
            del expiry[oldest]
            self.owners.discard(oldest, bit)

    def expire(self, now: float) -> None:
        """Drop entries whose TTL has passed (at most once per sweep interval)."""
        if now - self._last_sweep < self.sweep_interval_s:
            return
        self._last_sweep = now
        for entries in self._instances.values():
            expiry = entries.expiry
            while expiry:
                oldest, deadline = next(iter(expiry.items()))
                if deadline > now:
                    break
                del expiry[oldest]
                self.owners.discard(oldest, entries.bit)

    def match(self, chain: Sequence[int], now: float) -> dict[str, int]:
        self.expire(now)
        return match_chain(chain, (self.owners.owners,), self.slots)
