"""Lower KV tiers under the GPU pool (host DRAM, disk): which block hash sits in which slot, and the
copies that move blocks between tiers.

Contract:
- `TierStore` holds the lower tiers in order (`TierConfig`: vLLM's medium name, ``"CPU"`` or
  ``"STORAGE"``, and a capacity in slots of one block each). A block hash lives in one place only
  (the GPU pool or one lower tier), except while a load reads it: a block the GPU pool evicts moves
  down (`demote`), a block loaded back up leaves its tier once the GPU pool caches it (`release`).
- `demote`: the block goes to the first tier; when that tier is full its least recently used
  unpinned block moves one tier down first, and the last tier's victim is dropped. A tier whose
  slots are all pinned refuses the block (it is dropped instead: evicted, as without tiers).
- Every move is a `BlockCopy` appended to the caller's `copies` list and announced on the caller's
  `events` list (vLLM's events with ``medium``: the store on the lower tier before the removal from
  the upper one), in the order they must run: a copy always precedes the one that reuses its source.
- `discard` drops the unpinned copy of a hash the GPU pool caches anew (computed again, not loaded).
- `snapshot(medium)` lists a tier's entries (`SlotEntry`: slot, hash, parent, token ids) least
  recently used first, pinned ones last; `restore(medium, entries)` fills an empty tier from such a
  list (a warm restart: the disk tier's manifest), checking it (slots in range and distinct, hashes
  distinct and on no other tier, one block of tokens each; else `ValueError`, nothing restored),
  and announces each block as stored on that tier, a parent before its children.
- `locate` finds a hash's tier and slot; `pin` holds a slot for a load in flight (a pinned slot is
  never evicted nor reused) and takes it out of the LRU order; `release` unpins it, and drops it
  when asked to or puts it back in the LRU order as the most recently used.
- Pure: no I/O, no clock. The engine's torch side runs the copies; the simulator prices them.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from dataclasses import dataclass
from typing import NamedTuple, cast

from kvherd.block_hash import BlockHash
from kvherd.kv_events import MEDIUM_GPU, BlockRemoved, BlockStored, KVEvent


@dataclass(frozen=True, slots=True)
class TierConfig:
    medium: str  # vLLM's medium name: "CPU" (host DRAM) or "STORAGE" (disk)
    num_blocks: int


@dataclass(frozen=True, slots=True)
class BlockCopy:
    """Copy one block's KV from (`src_medium`, `src`) to (`dst_medium`, `dst`): a GPU block id or
    a lower tier's slot."""

    src_medium: str
    src: int
    dst_medium: str
    dst: int


class TierHit(NamedTuple):
    level: int  # index of the tier in `TierStore.tiers`
    slot: int
    block_hash: BlockHash


@dataclass(slots=True)
class TierCounters:
    """What moved through one tier, in blocks (read by metrics)."""

    stored: int = 0  # blocks that moved into the tier
    hits: int = 0  # blocks loaded back from the tier into the GPU pool
    evicted: int = 0  # blocks that left the tier downwards or were dropped


class SlotEntry(NamedTuple):
    """One occupied slot of a tier, as `snapshot` lists it and `restore` takes it."""

    slot: int
    block_hash: BlockHash
    parent: BlockHash | None
    tokens: bytes  # the block's token ids, packed as uint32


class _Entry(NamedTuple):
    block_hash: BlockHash
    parent: BlockHash | None
    tokens: bytes  # the block's token ids, packed as uint32 (as the block manager verifies them)


class Tier:
    """One lower tier: slots, the hash -> slot map, LRU order of the unpinned entries, pins."""

    def __init__(self, config: TierConfig) -> None:
        if config.num_blocks <= 0:
            raise ValueError(f"tier {config.medium} needs a positive number of blocks")
        if config.medium == MEDIUM_GPU:
            raise ValueError("a lower tier cannot be the GPU")
        self.medium = config.medium
        self.num_blocks = config.num_blocks
        self.slots: dict[BlockHash, int] = {}
        self.entries: list[_Entry | None] = [None] * config.num_blocks
        self.lru: OrderedDict[BlockHash, None] = OrderedDict()  # unpinned entries, oldest first
        self.pins: dict[BlockHash, int] = {}
        self.free: list[int] = list(range(config.num_blocks - 1, -1, -1))  # pop() gives slot 0
        self.counters = TierCounters()

    def __len__(self) -> int:
        return len(self.slots)


class TierStore:
    def __init__(self, configs: list[TierConfig], block_size: int) -> None:
        if not configs:
            raise ValueError("a tier store needs at least one tier")
        media = [c.medium for c in configs]
        if len(set(media)) != len(media):
            raise ValueError(f"tier media must differ, got {media}")
        self.tiers = [Tier(c) for c in configs]
        self.block_size = block_size

    def locate(self, block_hash: BlockHash) -> TierHit | None:
        for level, tier in enumerate(self.tiers):
            slot = tier.slots.get(block_hash)
            if slot is not None:
                return TierHit(level, slot, block_hash)
        return None

    def tokens(self, hit: TierHit) -> bytes:
        entry = self.tiers[hit.level].entries[hit.slot]
        assert entry is not None
        return entry.tokens

    def __contains__(self, block_hash: object) -> bool:
        return any(block_hash in tier.slots for tier in self.tiers)

    def demote(
        self,
        block_hash: BlockHash,
        parent: BlockHash | None,
        tokens: bytes,
        gpu_block: int,
        copies: list[BlockCopy],
        events: list[KVEvent],
    ) -> bool:
        """Move a block the GPU pool evicts into the first tier; False when it is dropped.

        A hash a tier holds already (a load of it is in flight) costs no copy: that copy stays."""
        if block_hash in self:
            return True
        return self._put(
            0, _Entry(block_hash, parent, tokens), MEDIUM_GPU, gpu_block, copies, events
        )

    def _put(
        self,
        level: int,
        entry: _Entry,
        src_medium: str,
        src: int,
        copies: list[BlockCopy],
        events: list[KVEvent],
    ) -> bool:
        tier = self.tiers[level]
        if tier.free:
            slot = tier.free.pop()
        elif tier.lru:
            victim_hash, _ = tier.lru.popitem(last=False)
            slot = tier.slots.pop(victim_hash)
            victim = tier.entries[slot]
            assert victim is not None
            tier.counters.evicted += 1
            if level + 1 < len(self.tiers):
                # Down first: its copy reads the slot before the new block overwrites it.
                self._put(level + 1, victim, tier.medium, slot, copies, events)
            events.append(BlockRemoved([victim_hash], tier.medium))
        else:
            return False  # every slot is pinned by a load in flight
        tier.slots[entry.block_hash] = slot
        tier.entries[slot] = entry
        tier.lru[entry.block_hash] = None
        tier.counters.stored += 1
        copies.append(BlockCopy(src_medium, src, tier.medium, slot))
        events.append(self._stored(entry, tier.medium))
        return True

    def _stored(self, entry: _Entry, medium: str) -> BlockStored:
        tokens = array("I")
        tokens.frombytes(entry.tokens)
        return BlockStored([entry.block_hash], entry.parent, tokens, self.block_size, medium=medium)

    def pin(self, hit: TierHit) -> None:
        tier = self.tiers[hit.level]
        count = tier.pins.get(hit.block_hash, 0)
        if not count:
            del tier.lru[hit.block_hash]
        tier.pins[hit.block_hash] = count + 1

    def release(self, hit: TierHit, drop: bool, events: list[KVEvent]) -> None:
        """Unpin a slot `pin` held; once no load holds it, drop it (announced) if `drop`, else
        it is the tier's most recently used entry again."""
        tier = self.tiers[hit.level]
        count = tier.pins[hit.block_hash] - 1
        if count:
            tier.pins[hit.block_hash] = count
            return
        del tier.pins[hit.block_hash]
        if drop:
            self._drop(tier, hit.block_hash, hit.slot, events)
        else:
            tier.lru[hit.block_hash] = None

    def discard(self, block_hash: BlockHash, events: list[KVEvent]) -> None:
        """Drop the unpinned copy of a hash the GPU pool now caches (announced), if any."""
        for tier in self.tiers:
            slot = tier.slots.get(block_hash)
            if slot is not None:
                if block_hash not in tier.pins:
                    self._drop(tier, block_hash, slot, events)
                return

    def _drop(self, tier: Tier, block_hash: BlockHash, slot: int, events: list[KVEvent]) -> None:
        del tier.slots[block_hash]
        tier.lru.pop(block_hash, None)
        tier.entries[slot] = None
        tier.free.append(slot)
        events.append(BlockRemoved([block_hash], tier.medium))

    def clear(self) -> None:
        """Forget every entry (the prefix cache was reset; only while nothing is pinned)."""
        for tier in self.tiers:
            assert not tier.pins, "cannot clear a tier while a load reads it"
            tier.slots.clear()
            tier.lru.clear()
            tier.entries = [None] * tier.num_blocks
            tier.free = list(range(tier.num_blocks - 1, -1, -1))

    def _tier(self, medium: str) -> Tier:
        for tier in self.tiers:
            if tier.medium == medium:
                return tier
        raise ValueError(f"no {medium} tier")

    def snapshot(self, medium: str) -> list[SlotEntry]:
        """The tier's entries, least recently used first, then the pinned ones."""
        tier = self._tier(medium)
        listed = [*tier.lru, *tier.pins]
        return [
            SlotEntry(tier.slots[h], *cast(_Entry, tier.entries[tier.slots[h]])) for h in listed
        ]

    def restore(self, medium: str, entries: list[SlotEntry], events: list[KVEvent]) -> None:
        """Fill the empty `medium` tier with `entries` (least recently used first)."""
        tier = self._tier(medium)
        if tier.slots:
            raise ValueError(f"the {medium} tier is not empty")
        slots = {e.slot for e in entries}
        hashes = {e.block_hash for e in entries}
        if len(slots) != len(entries) or len(hashes) != len(entries):
            raise ValueError("a slot or a block hash is listed twice")
        if not all(0 <= slot < tier.num_blocks for slot in slots):
            raise ValueError(f"a slot lies outside the tier's {tier.num_blocks}")
        if any(len(e.tokens) != 4 * self.block_size for e in entries):
            raise ValueError(f"an entry does not hold {self.block_size} token ids")
        if any(h in other.slots for other in self.tiers for h in hashes):
            raise ValueError("a block hash already lives on a tier")
        for slot, block_hash, parent, tokens in entries:
            tier.slots[block_hash] = slot
            tier.entries[slot] = _Entry(block_hash, parent, tokens)
            tier.lru[block_hash] = None
        tier.free = sorted(set(range(tier.num_blocks)) - slots, reverse=True)
        # Parents first: a prefix index chains a block only onto a parent it knows.
        by_hash = {e.block_hash: e for e in entries}
        announced: set[BlockHash] = set()
        for entry in entries:
            chain = []
            at: SlotEntry | None = entry
            while at is not None and at.block_hash not in announced:
                chain.append(at)
                announced.add(at.block_hash)
                at = by_hash.get(at.parent) if at.parent is not None else None
            for item in reversed(chain):
                events.append(
                    self._stored(_Entry(item.block_hash, item.parent, item.tokens), medium)
                )

    def block_hashes(self) -> dict[str, list[BlockHash]]:
        """Every hash each tier holds, by medium (what its KV events announced)."""
        return {tier.medium: list(tier.slots) for tier in self.tiers}

    def check_integrity(self) -> None:
        seen: set[BlockHash] = set()
        for tier in self.tiers:
            assert not seen & tier.slots.keys(), f"{tier.medium}: a hash lives on two tiers"
            seen |= tier.slots.keys()
            used = set(tier.slots.values())
            assert len(used) == len(tier.slots), f"{tier.medium}: two hashes share a slot"
            assert not used & set(tier.free), f"{tier.medium}: a used slot is free"
            assert len(used) + len(tier.free) == tier.num_blocks, f"{tier.medium}: slots lost"
            assert set(tier.lru).isdisjoint(tier.pins), f"{tier.medium}: pinned entry in LRU"
            assert set(tier.lru) | set(tier.pins) == set(tier.slots), f"{tier.medium}: LRU lost"
            for block_hash, slot in tier.slots.items():
                entry = tier.entries[slot]
                assert entry is not None and entry.block_hash == block_hash, (
                    f"{tier.medium}: slot {slot} does not hold {block_hash}"
                )
                assert len(entry.tokens) == 4 * self.block_size
            assert sum(e is not None for e in tier.entries) == len(tier.slots)
