"""Precise prefix index: which instance caches which block, fed by KV events.

Contract:
- `BlockOwners` is the shared core of both indexes (one class, one dict or split over shards):
  kvherd block hash -> bitmask of instance slots (`InstanceSlots`), so `match(chain)` walks the
  request's chain once, AND-ing masks until no instance still matches, and returns
  ``{instance_id: leading blocks matched}`` (instances with 0 are absent). Cost is one dict
  lookup per matched block, independent of the number of instances.
- `PrefixIndex` applies vLLM-format KV event batches per instance:
  `BlockStored` (re-hashed with kvherd's own `block_hash_chain`, because an engine's hash function
  may differ; the per-instance map engine hash -> kvherd hash resolves later removals and parent
  links), `BlockRemoved`, `AllBlocksCleared`. With ``trust_engine_hashes`` (kvherd agents, which
  hash with the very same function, tenant salts included) the engine's hashes are used as they are.
- Sequence numbers: batches must arrive in order per instance. A batch below the next expected
  number is a duplicate (skipped); one above it is a gap: it is *not* applied, and the result says
  ``need_replay_from`` (the first missing number). After `clear_instance` (join, re-join, failed
  replay: a full resync) the next batch is accepted whatever its number.
- Hard memory bound: at most `max_blocks_per_instance` per instance and `max_blocks_total` overall;
  beyond that the instance's least recently stored entries are forgotten first (the index then
  under-reports a hit, never invents one).
- Tiers (`TIERS`: GPU, CPU, STORAGE, vLLM's ``medium`` names): the index keeps, per instance
  and block, the tier it lives on (one `BlockOwners` per tier, `tier_owners`); an event without a
  medium is GPU, an unknown medium name the lowest tier (a WARNING, once per name), never GPU. A
  lower-tier store that is a vLLM placeholder (OffloadingConnector without
  ``self_describing_kv_events``: no tokens, no parent, block size 0) moves blocks the instance is
  known to hold (on any tier) to that tier; unknown ones are counted and skipped.
  `match` / `owners` are the GPU tier; `match_tiers` adds, per instance, the blocks that continue
  its GPU match on the lower tiers (`lower_tier_counts`: each block on the highest one holding it).
- Block size per instance (`add_instance(..., block_size=)`, default the index's): instances of
  different models may hash blocks of different sizes in one index (a request's chain is hashed
  at its model's size and matched against its model's instances only).
- Events the index cannot place (unknown parent, a block size other than the instance's, unknown
  placeholder) are counted in `stats` and skipped; they never raise.
Pure: no I/O, no clock, no threads.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from itertools import accumulate, compress, count, islice, repeat
from operator import and_, is_not, ne, not_, or_

from kvherd.block_hash import HashAlgo, block_extra_keys, block_hash_chain, hash_block
from kvherd.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
    KVEventBatch,
    salt_and_extras,
)
from policies.views import TIERS

_log = logging.getLogger(__name__)

# vLLM's medium names (any case) and the aliases engines use, by tier level (0: GPU).
_LEVEL_OF: dict[str | None, int] = {None: 0, "cuda": 0, "disk": 2}
for _level, _medium in enumerate(TIERS):
    _LEVEL_OF[_medium] = _LEVEL_OF[_medium.lower()] = _level
_LOWEST = len(TIERS) - 1
_MAX_WARNED = 64  # unknown medium names warned about (a bound: names come off the wire)
# Blocks looked up by the first chunk of a match walk, and the most per chunk (see `match_groups`).
_FIRST_CHUNK = 16
_MAX_CHUNK = 512


class InstanceSlots:
    """Instance id <-> bit position; freed positions are reused, so masks stay short.

    One `InstanceSlots` may be shared by several indexes (the scheduler's precise and approximate
    indexes) so that their masks can be OR-ed in one walk; the sharer then releases slots itself.
    """

    def __init__(self) -> None:
        self._slot_of: dict[str, int] = {}
        self.id_of: list[str | None] = []
        self._free: list[int] = []

    def bit(self, instance_id: str) -> int:
        """The instance's bit, allocating a slot on first use."""
        slot = self._slot_of.get(instance_id)
        if slot is None:
            if self._free:
                slot = self._free.pop()
                self.id_of[slot] = instance_id
            else:
                slot = len(self.id_of)
                self.id_of.append(instance_id)
            self._slot_of[instance_id] = slot
        return 1 << slot

    def release(self, instance_id: str) -> None:
        """Free the slot; every index must already have cleared the instance's bits."""
        slot = self._slot_of.pop(instance_id, None)
        if slot is not None:
            self.id_of[slot] = None
            self._free.append(slot)


class BlockOwners:
    """kvherd block hash -> bitmask of the instances holding it, split over `num_shards` dicts by
    the hash's low bits.

    `add_many`/`discard_many` take a run of blocks at once (a routed chain names up to thousands)
    and run in C iterators, written once for any shard count: the approximate index's updates.
    The precise index keeps one shard, one plain dict, which its own store and removal loops
    update block by block with the instance's entries. Several shards: the approximate index
    grows inside routing decisions (every routed chain is recorded), and a CPython dict grows by
    rebuilding its whole table: one dict of ~170k entries (a few hundred routed 32k-token prompts)
    costs one decision several milliseconds. Split, each rebuild touches 1/`num_shards` of the
    entries; a lookup costs one extra C-level step per block.
    """

    def __init__(self, num_shards: int = 1) -> None:
        if num_shards <= 0 or num_shards & (num_shards - 1):
            raise ValueError("num_shards must be a power of two")
        self._low = num_shards - 1
        self.shards: list[dict[int, int]] = [{} for _ in range(num_shards)]
        # One shard: every block's dict is the one dict (`repeat` can be walked again and again).
        self._one = repeat(self.shards[0]) if num_shards == 1 else None

    def _shards_of(self, block_hashes: Sequence[int]) -> Iterable[dict[int, int]]:
        """Each block's dict, as an iterable that can be walked again."""
        if self._one is not None:
            return self._one
        return list(map(self.shards.__getitem__, map(and_, block_hashes, repeat(self._low))))

    def add_many(self, block_hashes: Sequence[int], bit: int) -> None:
        """Set `bit` for every block of `block_hashes` (distinct hashes)."""
        shards = self._shards_of(block_hashes)
        masks = map(or_, map(dict.get, shards, block_hashes, repeat(0)), repeat(bit))
        deque(map(dict.__setitem__, shards, block_hashes, masks), 0)

    def discard_many(self, block_hashes: Sequence[int], bit: int) -> None:
        """Clear `bit` for every block; blocks no instance holds any more are dropped."""
        shards = self._shards_of(block_hashes)
        # Pop first: in the usual run no other instance holds any of them, so none goes back.
        popped = list(map(dict.pop, shards, block_hashes, repeat(0)))
        if popped.count(bit) != len(popped):  # some are held elsewhere too (or nowhere)
            kept = list(map(and_, popped, repeat(~bit)))
            deque(
                map(dict.__setitem__, compress(shards, kept), compress(block_hashes, kept),
                    compress(kept, kept)),
                0,
            )  # fmt: skip

    def masks(self, chunk: Sequence[int]) -> list[int]:
        """Each block's mask (0: nobody holds it)."""
        return list(map(dict.get, self._shards_of(chunk), chunk, repeat(0)))

    def holds_none(self, chunk: Sequence[int]) -> bool:
        """True when no instance holds any block of `chunk`."""
        return not any(map(dict.__contains__, self._shards_of(chunk), chunk))

    def __len__(self) -> int:
        return sum(map(len, self.shards))


def match_groups(chain: Sequence[int], maps: Sequence[BlockOwners]) -> list[tuple[int, int]]:
    """The walk itself: ``[(instance bits, leading blocks matched), ...]`` by increasing depth, a
    block counting if any of `maps` holds it. Each bit appears in at most one group.

    The chain is walked in chunks whose lookups, OR-ing and running AND run inside C iterators
    (`map`, `accumulate`), not one bytecode loop per block: a deep match over thousands of blocks
    costs a few C-level passes. Chunks start small and double, so a walk that ends early (no
    instance still matching) looks up at most about twice the blocks it needed.
    """
    groups: list[tuple[int, int]] = []
    num = len(chain)
    first, rest = maps[0], maps[1:]
    alive = -1  # every bit: the AND of no mask; never recorded (depth 0 is "no match")
    start, size = 0, _FIRST_CHUNK
    while start < num:
        chunk = chain[start : start + size]
        masks = first.masks(chunk)
        for other in rest:
            # OR in the other map's masks only where it holds the block: the approximate index
            # covers a fraction of a chain, and an OR of two fleet-wide masks makes a new int.
            if other.holds_none(chunk):  # one pass of lookups, no list of masks
                continue
            extra = other.masks(chunk)
            for i in compress(count(), extra):
                masks[i] |= extra[i]
        head = masks[0]
        if masks[-1] == head and masks.count(head) == len(masks):
            # One mask over the whole chunk (a prefix the same instances hold, or nobody): only
            # its first block can lose bits.
            if start and alive & ~head:
                groups.append((alive & ~head, start))
            alive &= head
        else:
            # running[i]: bits still matching after the first `start + i` blocks.
            running = list(accumulate(masks, and_, initial=alive))
            for i in compress(count(), map(ne, running, islice(running, 1, None))):
                if start + i:  # bits lost at block `start + i` matched exactly that many blocks
                    groups.append((running[i] & ~running[i + 1], start + i))
            alive = running[-1]
        if not alive:
            return groups
        start += len(chunk)
        size = min(2 * size, _MAX_CHUNK)
    if start:
        groups.append((alive, num))
    return groups


def match_chain(
    chain: Sequence[int], maps: Sequence[BlockOwners], slots: InstanceSlots
) -> dict[str, int]:
    """Leading blocks of `chain` held per instance, a block counting if any map holds it."""
    result: dict[str, int] = {}
    for bits, depth in match_groups(chain, maps):
        _record(bits, depth, slots.id_of, result)
    return result


def _record(bits: int, depth: int, id_of: list[str | None], into: dict[str, int]) -> None:
    while bits:
        low = bits & -bits
        instance_id = id_of[low.bit_length() - 1]
        if instance_id is not None:
            into[instance_id] = depth
        bits ^= low


def lower_tier_counts(segment: Sequence[int], bit: int, lower: Sequence[BlockOwners]) -> list[int]:
    """Blocks of `segment` (a chain's continuation past an instance's GPU match, all held by
    `bit` on some tier) per lower tier, each on the highest of `lower` that holds it; the last tier
    also takes any block only a higher map holds (a GPU block past a miss: priced as the slowest)."""
    counts: list[int] = []
    rest = segment
    for owners in lower[:-1]:
        held = list(map(and_, owners.masks(rest), repeat(bit)))
        counts.append(len(held) - held.count(0))
        rest = list(compress(rest, map(not_, held)))
    counts.append(len(rest))
    return counts


@dataclass(frozen=True, slots=True)
class ApplyResult:
    """Outcome of one batch: applied, a duplicate, or a gap that needs a replay from a sequence."""

    applied: bool
    duplicate: bool = False
    need_replay_from: int | None = None


@dataclass(slots=True)
class _InstanceBlocks:
    bit: int
    trust_engine_hashes: bool
    block_size: int  # what its events' blocks must hold (its model's block size)
    # GPU tier: engine hash -> kvherd hash, in store order (oldest first): the LRU for the bound.
    entries: dict[int, int] = field(default_factory=dict)
    # kvherd hash -> extra engine hashes naming it (rare: distinct engine hashes, same tokens).
    dups: dict[int, int] = field(default_factory=dict)
    next_seq: int | None = None  # None: accept any sequence number (after a resync)
    # The lower tiers' `entries` and `dups`, CPU first.
    lower: list[tuple[dict[int, int], dict[int, int]]] = field(
        default_factory=lambda: [({}, {}) for _ in TIERS[1:]]
    )

    def tier(self, level: int) -> tuple[dict[int, int], dict[int, int]]:
        return (self.entries, self.dups) if not level else self.lower[level - 1]

    def num_blocks(self) -> int:
        return len(self.entries) + sum(len(entries) for entries, _ in self.lower)

    def kv_hash(self, engine_hash: int) -> int | None:
        """The kvherd hash an engine hash names on any tier (None: unknown)."""
        found = self.entries.get(engine_hash)
        if found is None:
            for entries, _ in self.lower:
                found = entries.get(engine_hash)
                if found is not None:
                    break
        return found


@dataclass(slots=True)
class IndexStats:
    batches: int = 0
    duplicates: int = 0
    gaps: int = 0
    stored: int = 0
    removed: int = 0
    cleared: int = 0
    evicted: int = 0
    unknown_parent: int = 0
    wrong_block_size: int = 0
    unknown_medium: int = 0  # events whose medium name is none of vLLM's (put on the lowest tier)
    unknown_placeholder: int = 0  # placeholder blocks the instance was not known to hold


class PrefixIndex:
    """Exact per-instance block sets from KV events (see the module docstring)."""

    def __init__(
        self,
        block_size: int,
        hash_algo: HashAlgo = "xxh3_64",
        max_blocks_per_instance: int = 1 << 20,
        max_blocks_total: int = 1 << 24,
        slots: InstanceSlots | None = None,
    ) -> None:
        if block_size <= 0 or max_blocks_per_instance <= 0 or max_blocks_total <= 0:
            raise ValueError("block_size and the memory bounds must be positive")
        self.block_size = block_size
        self.hash_algo: HashAlgo = hash_algo
        self.max_blocks_per_instance = max_blocks_per_instance
        self.max_blocks_total = max_blocks_total
        # One per tier, GPU first; one shard each: the store and removal loops update its dict.
        self.tier_owners = [BlockOwners() for _ in TIERS]
        self.owners = self.tier_owners[0]
        self._masks = self.owners.shards[0]
        self._warned: set[str] = set()
        self._own_slots = slots is None
        self.slots = InstanceSlots() if slots is None else slots
        self._instances: dict[str, _InstanceBlocks] = {}
        self._total = 0
        self.stats = IndexStats()

    # -- instances ---------------------------------------------------------------------------
    def add_instance(
        self,
        instance_id: str,
        trust_engine_hashes: bool = False,
        next_seq: int | None = None,
        block_size: int | None = None,
    ) -> None:
        """Register (or re-register, which clears) an instance whose blocks hold `block_size`
        tokens (None: the index's own).

        With `next_seq` None the next batch starts its view whatever its number (the replay may
        not reach back to 0); pass the first expected number when it is known (replay from 0).
        """
        size = self.block_size if block_size is None else block_size
        if size <= 0:
            raise ValueError("block_size must be positive")
        if instance_id in self._instances:
            self.clear_instance(instance_id)
            inst = self._instances[instance_id]
            inst.trust_engine_hashes = trust_engine_hashes
            inst.block_size = size
        else:
            inst = _InstanceBlocks(self.slots.bit(instance_id), trust_engine_hashes, size)
            self._instances[instance_id] = inst
        inst.next_seq = next_seq

    def remove_instance(self, instance_id: str) -> None:
        if instance_id in self._instances:
            self.clear_instance(instance_id)
            del self._instances[instance_id]
            if self._own_slots:
                self.slots.release(instance_id)

    def clear_instance(self, instance_id: str) -> None:
        """Forget everything the instance holds and accept its next batch whatever its number."""
        inst = self._instances[instance_id]
        for level in range(len(TIERS)):
            self._drop(inst, list(inst.tier(level)[0]), level)  # leaves no entry and no dup
        inst.next_seq = None

    def __contains__(self, instance_id: object) -> bool:
        return instance_id in self._instances

    def num_blocks(self, instance_id: str | None = None) -> int:
        """Entries indexed (every tier), for one instance or in all."""
        if instance_id is None:
            return self._total
        return self._instances[instance_id].num_blocks()

    def tier_counts(self, instance_id: str) -> dict[str, int]:
        """Entries indexed per tier (`TIERS` names) for one instance: a block held on two tiers
        (a host copy beside the GPU one, as vLLM's connectors keep) counts on each."""
        inst = self._instances[instance_id]
        return {medium: len(inst.tier(level)[0]) for level, medium in enumerate(TIERS)}

    def blocks(self, instance_id: str, medium: str = TIERS[0]) -> set[int]:
        """The kvherd hashes the index believes `instance_id` holds on the tier `medium`."""
        return set(self._instances[instance_id].tier(_LEVEL_OF[medium])[0].values())

    def has_lower_tiers(self) -> bool:
        """Whether any instance is known to hold a block below the GPU."""
        return any(map(len, self.tier_owners[1:]))

    def level(self, medium: str | None) -> int:
        """The tier an event's medium names (0: GPU); unknown names are the lowest, warned once."""
        found = _LEVEL_OF.get(medium)
        if found is not None:
            return found
        self.stats.unknown_medium += 1
        if len(self._warned) < _MAX_WARNED and medium not in self._warned:
            self._warned.add(str(medium))
            _log.warning(
                "KV events name an unknown medium %r: indexed as the lowest tier (%s)",
                medium,
                TIERS[_LOWEST],
            )
        return _LOWEST

    def next_seq(self, instance_id: str) -> int | None:
        return self._instances[instance_id].next_seq

    def trusts_engine_hashes(self, instance_id: str) -> bool:
        return self._instances[instance_id].trust_engine_hashes

    def block_size_of(self, instance_id: str) -> int:
        return self._instances[instance_id].block_size

    # -- events ------------------------------------------------------------------------------
    def apply_batch(self, instance_id: str, batch: KVEventBatch) -> ApplyResult:
        inst = self._instances.get(instance_id)
        if inst is None:
            raise KeyError(f"unknown instance {instance_id!r}")
        if inst.next_seq is not None:
            if batch.seq < inst.next_seq:
                self.stats.duplicates += 1
                return ApplyResult(applied=False, duplicate=True)
            if batch.seq > inst.next_seq:
                self.stats.gaps += 1
                return ApplyResult(applied=False, need_replay_from=inst.next_seq)
        self.stats.batches += 1
        self.apply_events(instance_id, batch.events)
        inst.next_seq = batch.seq + 1
        return ApplyResult(applied=True)

    def apply_events(self, instance_id: str, events: Iterable[KVEvent]) -> None:
        """Apply events in order, without sequence checks (in-process producers)."""
        inst = self._instances.get(instance_id)
        if inst is None:
            raise KeyError(f"instance {instance_id!r} is not registered with KV events")
        for event in events:
            if isinstance(event, BlockStored):
                self._stored(inst, event)
            elif isinstance(event, BlockRemoved):
                self._removed(inst, event)
            elif isinstance(event, AllBlocksCleared):
                self.stats.cleared += 1
                next_seq = inst.next_seq
                self.clear_instance(instance_id)
                inst.next_seq = next_seq

    def _stored(self, inst: _InstanceBlocks, event: BlockStored) -> None:
        medium = event.medium
        level = 0 if medium is None or medium == "GPU" else self.level(medium)
        size = inst.block_size
        if event.block_size != size:
            if level and not event.block_size and event.parent_block_hash is None:
                self._relocated(inst, event.block_hashes, level)  # (a placeholder has no tokens)
            else:
                self.stats.wrong_block_size += 1
            return
        engine_hashes = event.block_hashes
        if inst.trust_engine_hashes:  # an entry names itself (the simulator's whole stream)
            self._store(inst, engine_hashes, engine_hashes, level)
            return
        parent: int | None = None
        if event.parent_block_hash is not None:
            parent = inst.kv_hash(event.parent_block_hash)
            if parent is None:  # the parent was evicted or never seen: cannot chain
                self.stats.unknown_parent += 1
                return
        usable = len(event.token_ids) // size
        if usable < len(engine_hashes):
            engine_hashes = engine_hashes[:usable]
        tokens = event.token_ids[: len(engine_hashes) * size]
        if event.extra_keys is None or event.extra_keys.count(None) == len(event.extra_keys):
            kv_hashes = block_hash_chain(
                tokens, size, algo=self.hash_algo, parent_hash=parent, lora_name=event.lora_name
            )
        else:
            kv_hashes = self._keyed_chain(event, tokens, parent, size)
        self._store(inst, engine_hashes, kv_hashes, level)

    def _relocated(self, inst: _InstanceBlocks, engine_hashes: Sequence[int], level: int) -> None:
        """A placeholder store: the blocks it names that the instance holds are on `level` too."""
        kv_hashes = list(map(inst.kv_hash, engine_hashes))
        known = list(map(is_not, kv_hashes, repeat(None)))
        self.stats.unknown_placeholder += len(known) - known.count(True)
        self._store(
            inst,
            list(compress(engine_hashes, known)),
            list(compress(kv_hashes, known)),  # type: ignore[arg-type]
            level,
        )

    def _keyed_chain(
        self, event: BlockStored, tokens: list[int], parent: int | None, size: int
    ) -> list[int]:
        """kvherd hashes of an event's blocks folding in the extra keys vLLM reports per block:
        the salt on a prompt's first block and the LoRA name as `block_hash_chain` folds them (so
        a request hashed with the same salt and adapter matches), and any other key (multi-modal,
        prompt embeddings) after them, so that such a block never matches a text-only request."""
        assert event.extra_keys is not None
        if event.parent_block_hash is None and not any(event.extra_keys[1:]):
            salt, others = salt_and_extras(event.extra_keys[0], event.lora_name, True)
            if not others:  # the usual salted prompt: only its first block carries a key
                return block_hash_chain(
                    tokens, size, salt, self.hash_algo, lora_name=event.lora_name
                )
        chain: list[int] = []
        previous = parent
        for index in range(len(tokens) // size):
            first = index == 0 and event.parent_block_hash is None
            salt, others = salt_and_extras(event.extra_keys[index], event.lora_name, first)
            extra = block_extra_keys(first, salt, event.lora_name) or ()
            previous = hash_block(
                previous, tokens[index * size : (index + 1) * size], extra + others, self.hash_algo
            )
            chain.append(previous)
        return chain

    def _store(
        self,
        inst: _InstanceBlocks,
        engine_hashes: Sequence[int],
        kv_hashes: Sequence[int],
        level: int = 0,
    ) -> None:
        """The one store loop (trusted or re-hashed, one block or a prefill's thousands).

        One pass, four dict operations per block, the instance's entry and the block's mask
        updated together. Most of the simulator's events are single blocks (a decode filling
        one), where a C-iterator pass costs more to set up than the loop; on its long runs such
        passes are faster (measured: the index's share of a run 15% smaller, about 1% of the run)
        but would be a second store path to keep in step with this one. `level`: the tier.
        """
        entries, dups = inst.tier(level)
        owners, bit = self.tier_owners[level].shards[0], inst.bit
        before = len(entries)
        for engine_hash, kv_hash in zip(engine_hashes, kv_hashes, strict=True):
            if engine_hash in entries:  # re-stored: keep its kvherd hash, refresh its LRU position
                entries[engine_hash] = entries.pop(engine_hash)
                continue
            entries[engine_hash] = kv_hash
            mask = owners.get(kv_hash, 0)
            if mask & bit:  # another engine hash of this instance already names these tokens
                dups[kv_hash] = dups.get(kv_hash, 0) + 1  # (never with trusted hashes)
            else:
                owners[kv_hash] = mask | bit
        self._grew(inst, len(entries) - before)

    def _grew(self, inst: _InstanceBlocks, added: int) -> None:
        self._total += added
        self.stats.stored += added
        if self._total > self.max_blocks_total or inst.num_blocks() > self.max_blocks_per_instance:
            self._enforce_bounds(inst)

    def _removed(self, inst: _InstanceBlocks, event: BlockRemoved) -> None:
        medium = event.medium
        level = 0 if medium is None or medium == "GPU" else self.level(medium)
        self.stats.removed += self._drop(inst, event.block_hashes, level)

    def _drop(self, inst: _InstanceBlocks, engine_hashes: Iterable[int], level: int = 0) -> int:
        """The one removal loop (removed blocks, evictions, a clear): forget the instance's entries
        on tier `level` named by `engine_hashes` (unknown ones are skipped) and its claim on their
        blocks there, which a block named twice keeps until its last name goes. Returns the
        entries forgotten."""
        entries, dups = inst.tier(level)
        owners, keep = self.tier_owners[level].shards[0], ~inst.bit
        before = len(entries)
        for engine_hash in engine_hashes:
            kv_hash = entries.pop(engine_hash, None)
            if kv_hash is None:
                continue
            if dups:  # rare: only ever for re-hashed events
                extra = dups.get(kv_hash)
                if extra:  # another engine hash still names these tokens
                    if extra == 1:
                        del dups[kv_hash]
                    else:
                        dups[kv_hash] = extra - 1
                    continue
            mask = owners.get(kv_hash, 0) & keep
            if mask:
                owners[kv_hash] = mask
            else:
                owners.pop(kv_hash, None)
        dropped = before - len(entries)
        self._total -= dropped
        return dropped

    def _enforce_bounds(self, inst: _InstanceBlocks) -> None:
        excess = inst.num_blocks() - self.max_blocks_per_instance
        if excess > 0:
            self._evict_oldest(inst, excess)
        if self._total > self.max_blocks_total:
            # Take from the largest instance: the one whose share of the bound is most exceeded.
            largest = max(self._instances.values(), key=_InstanceBlocks.num_blocks)
            self._evict_oldest(largest, self._total - self.max_blocks_total)

    def _evict_oldest(self, inst: _InstanceBlocks, count: int) -> None:
        """Forget `count` entries, the lowest tier's oldest first (the least worth to a match)."""
        for level in range(len(TIERS) - 1, -1, -1):
            if count <= 0:
                return
            dropped = self._drop(inst, list(islice(inst.tier(level)[0], count)), level)
            self.stats.evicted += dropped
            count -= dropped

    # -- queries -----------------------------------------------------------------------------
    def match(self, chain: Sequence[int]) -> dict[str, int]:
        """Leading blocks of `chain` on each instance's GPU tier."""
        return match_chain(chain, (self.owners,), self.slots)

    def match_tiers(self, chain: Sequence[int]) -> dict[str, list[int]]:
        """Per instance, blocks per tier (`TIERS` order): its leading GPU blocks, then the
        blocks of the chain that continue them on any tier, split by `lower_tier_counts`."""
        gpu = self.match(chain)
        result = {instance_id: [depth, 0, 0] for instance_id, depth in gpu.items()}
        if not self.has_lower_tiers():
            return result
        for instance_id, depth in match_chain(chain, self.tier_owners, self.slots).items():
            start = gpu.get(instance_id, 0)
            if depth > start:
                bit = self._instances[instance_id].bit
                lower = lower_tier_counts(chain[start:depth], bit, self.tier_owners[1:])
                result[instance_id] = [start, *lower]
        return result
