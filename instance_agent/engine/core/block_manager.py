"""Paged KV block manager: a fixed pool of blocks, reference counts, and the prefix cache.

Contract:
- The pool has `num_blocks` blocks of `block_size` token slots. Every block is at any moment in exactly
  one of three states: owned (ref count > 0, listed in one or more owners' block tables), free and
  uncached, or free and cached (evictable). `check_integrity()` asserts exactly that, plus the
  consistency of the hash -> block map.
- An owner is a request id (or a migration reservation id); `block_ids(owner)` is its block table.
- Prefix cache: a full, computed block is registered under its chained block hash
  (`cache_full_blocks`). `get_computed_blocks` returns the longest run of leading cached blocks of a
  request, verifying each block's token ids on a hit, and never covers the request's last token (the
  engine must compute at least one position to sample from).
- Eviction is lazy: freed cached blocks stay reusable until a fresh block is needed, then the least
  recently used one is evicted. Blocks are freed tail-first so a prefix's tail is evicted before its head.
  (The LRU list is itself lazily pruned: a block revived by a prefix hit leaves a stale entry behind,
  skipped when it reaches the head; the order of the live entries is exactly the LRU order.)
- Every change to the set of cached blocks is reported as a KV event (`BlockStored`, `BlockRemoved`,
  `AllBlocksCleared`), collected until `take_events()`; replaying the events yields exactly the
  cached-block set.
- The watermark keeps a fraction of the pool free when admitting new work, so running requests can grow
  without immediate preemption.
- Allocation is all-or-nothing: a failed `allocate_slots` or `reserve_blocks` changes nothing.
- Every event this pool emits about its own blocks says ``medium="GPU"`` (vLLM's name for the
  engine's pool, whatever the device), and a store names the request's LoRA adapter (vLLM's
  ``lora_name``).
- Tiers (optional `TierStore`, prefix caching only): an evicted block moves down to the lower tiers
  instead of vanishing (`tiers` module: events, LRU per tier); the copies that move it are queued
  until `take_offloads`, and the driver must run them, in order, before it writes any block it got
  from this pool since (a forward pass, a migration's KV). `lower_tier_hits` finds the blocks of a
  request's prefix that continue its GPU hits on a lower tier, `start_load` gives the request its
  GPU blocks and pins those slots (returning the copies that fill the blocks), and `finish_load`
  ends it: loaded (the blocks join the GPU prefix cache, their lower copies go), or not (pins
  released; a failed copy also drops those lower entries, so the prompt is recomputed).
  `restore_tier` fills an empty lower tier before any request (a warm restart), announced as
  stores on that tier.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Iterable, Iterator, Mapping, Sequence
from functools import partial
from itertools import islice, takewhile
from operator import indexOf, is_not, or_
from typing import Literal, cast

from instance_agent.engine.core.request import Request
from instance_agent.engine.core.tiers import BlockCopy, SlotEntry, TierHit, TierStore
from kvherd.block_hash import BlockHash
from kvherd.kv_events import MEDIUM_GPU, AllBlocksCleared, BlockRemoved, BlockStored, KVEvent

LoadOutcome = Literal["loaded", "failed", "abandoned"]  # how a load started by `start_load` ended

_is_hit = partial(is_not, None)  # `takewhile` predicate over `dict.get` results: the key is there


def _leading_hits(cached: dict[BlockHash, int], block_hashes: Iterable[BlockHash]) -> list[int]:
    """Block ids under the leading `block_hashes` that `cached` holds, up to the first miss."""
    return cast("list[int]", list(takewhile(_is_hit, map(cached.get, block_hashes))))


class BlockManager:
    """The pool, the prefix cache and the block tables.

    Per-block state lives in columns indexed by block id (ref count, hash, token ids, stale LRU
    entries) rather than one object per block or maps keyed by block id: a simulated fleet moves
    millions of blocks through allocate, cache, evict and free, and a list slot is cheaper to
    set and read than a dict entry, a deque append cheaper than an OrderedDict node (evicting,
    freeing and allocating a prompt's blocks cost 25-45% less each than with those maps). Only
    the prefix cache (hash -> block) is a map, since it is looked up by hash.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        watermark: float = 0.01,
        tiers: TierStore | None = None,
    ) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError("num_blocks and block_size must be positive")
        if tiers is not None and (not enable_prefix_caching or tiers.block_size != block_size):
            raise ValueError("tiers need prefix caching and the pool's block size")
        if not 0.0 <= watermark < 1.0:
            raise ValueError("watermark must be in [0, 1)")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.watermark_blocks = int(watermark * num_blocks)
        self._ref: list[int] = [0] * num_blocks  # owners holding each block
        # Indexed by block id, None when the block is not cached: its chained hash, and its token
        # ids for verifying hits, packed as uint32 bytes, as the block hash reads them: one flat
        # object per block, cheap to create (a slice of the run's packed tokens) and compare.
        # (Slices written into one shared bytearray, or an anonymous map with a slot per block,
        # cost 1.3-3x more per block than that: more than they save evicting, which frees none.)
        self._block_hash: list[BlockHash | None] = [None] * num_blocks
        self._block_tokens: list[bytes | None] = [None] * num_blocks
        self._free_uncached: deque[int] = deque(range(num_blocks))
        # Evictable (free, cached) blocks in LRU order, oldest first, pruned lazily: a revived
        # block's entry stays, counted in `_lru_stale` (stale entries of a block are its oldest
        # ones), and is dropped when it reaches the head or the list is compacted. A deque
        # append/popleft writes one pointer into a dense array; an OrderedDict entry is a dict
        # entry plus a linked node per block.
        self._lru: deque[int] = deque()
        self._lru_stale: list[int] = [0] * num_blocks
        self._num_stale = 0
        self._num_evictable = 0
        self._cached: dict[BlockHash, int] = {}  # block hash -> block id
        self._owner_blocks: dict[str, list[int]] = {}
        # Owner -> block table, live, for reading only (typed as a Mapping): the batch scheduler
        # reads table lengths on its per-step paths without a method call per request. The map
        # itself, not a MappingProxyType over it: a proxy's `get` dispatches to the dict's by
        # name, several times the cost of a plain dict lookup on those paths.
        self.block_tables: Mapping[str, list[int]] = self._owner_blocks
        # Leading blocks of each owner's table that `cache_full_blocks` has already handled, so a
        # decode step costs O(new blocks), not O(context) (vLLM's num_cached_block).
        self._owner_num_handled: dict[str, int] = {}
        self._events: list[KVEvent] = []
        self.tiers = tiers
        # Each cached block's parent hash (a lower-tier event names it; `cached_prefixes` walks
        # chains by it), and with tiers the copies evictions queued and the tier slots each load
        # in flight holds, by owner.
        self._block_parent: list[BlockHash | None] = [None] * num_blocks
        self._offloads: list[BlockCopy] = []
        self._loads: dict[str, list[TierHit]] = {}
        self.num_evictions = 0  # blocks evicted from the prefix cache (moved down or dropped)

    # -- sizes -------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now (uncached free plus evictable cached)."""
        return len(self._free_uncached) + self._num_evictable

    @property
    def num_cached_blocks(self) -> int:
        """Blocks registered in the prefix cache, in use or evictable."""
        return len(self._cached)

    def pool_counts(self) -> tuple[int, int]:
        """(`num_free_blocks`, `num_cached_blocks`) in one call (load reports, per decode step)."""
        return len(self._free_uncached) + self._num_evictable, len(self._cached)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def block_ids(self, owner_id: str) -> list[int]:
        return self._owner_blocks.get(owner_id, [])

    def owners(self) -> list[str]:
        return list(self._owner_blocks)

    def cached_block_hashes(self) -> list[BlockHash]:
        """Hashes of every block in the prefix cache (what this instance's KV events announced)."""
        return list(self._cached)

    def cached_prefixes(self, max_blocks: int) -> list[tuple[list[BlockHash], bytes]]:
        """The cached prefixes, most recently used first, covering at most `max_blocks` distinct
        blocks: each one is a chain from a first block to a block no cached block continues,
        as (hashes, its tokens packed as uint32 bytes). Chains may share their leading blocks;
        one whose head was evicted is left out (no request can hit it)."""
        cached, parents, ref = self._cached, self._block_parent, self._ref
        continued = {parents[block_id] for block_id in cached.values()}
        in_use = [block_id for block_id in cached.values() if ref[block_id]]
        recent = [block_id for block_id in reversed(self._lru) if not ref[block_id]]
        taken: set[int] = set()
        prefixes: list[tuple[list[BlockHash], bytes]] = []
        for leaf in dict.fromkeys(in_use + recent):  # newest LRU entry first, once each
            leaf_hash = self._block_hash[leaf]
            if leaf_hash is None or leaf_hash in continued:
                continue
            chain, parent = [leaf], parents[leaf]
            while parent is not None and (block_id := cached.get(parent)) is not None:
                chain.append(block_id)
                parent = parents[block_id]
            if parent is not None:
                continue
            chain.reverse()
            if len(taken.union(chain)) > max_blocks:
                break
            taken.update(chain)
            hashes = cast("list[BlockHash]", [self._block_hash[b] for b in chain])
            tokens = cast("list[bytes]", [self._block_tokens[b] for b in chain])
            prefixes.append((hashes, b"".join(tokens)))
        return prefixes

    # -- prefix cache ------------------------------------------------------------------------
    def get_computed_blocks(self, request: Request) -> tuple[list[int], int]:
        """Leading cached blocks of `request` and how many tokens they cover."""
        if not self.enable_prefix_caching:
            return [], 0
        bs = self.block_size
        tokens = request.token_ids
        max_blocks = (len(tokens) - 1) // bs
        hits = _leading_hits(self._cached, islice(request.block_hashes, max_blocks))
        if hits:
            stored = self._block_tokens
            wanted = tokens[: len(hits) * bs].tobytes()
            # One comparison for the whole run; only a hash collision needs the per-block walk.
            if b"".join(map(stored.__getitem__, hits)) != wanted:  # type: ignore[arg-type]
                stride = 4 * bs
                for index, block_id in enumerate(hits):
                    if stored[block_id] != wanted[index * stride : (index + 1) * stride]:
                        del hits[index:]  # a hash collision: never serve another prompt's KV
                        break
        return hits, len(hits) * bs

    def lookup_cached_prefix(self, block_hashes: Sequence[BlockHash]) -> list[int]:
        """Block ids of the leading `block_hashes` present in the cache (hash match only)."""
        return _leading_hits(self._cached, block_hashes)

    def cache_full_blocks(self, request: Request) -> None:
        """Register the request's computed full blocks in the prefix cache (emits BlockStored)."""
        if not self.enable_prefix_caching:
            return
        rid = request.request_id
        first = self._owner_num_handled.get(rid, 0)
        num_full = request.num_computed_tokens // self.block_size
        if num_full <= first:  # the common decode step: no block completed
            return
        table = self._owner_blocks.get(rid)
        if not table:
            return
        hashes = request.block_hashes
        if num_full == first + 1 and num_full <= len(hashes) and num_full <= len(table):
            # A decode step completed one block (if it is cached already, nothing to do).
            self._owner_num_handled[rid] = num_full
            self._store_block(request, first, table[first])
            return
        num_full = min(num_full, len(hashes), len(table))
        if num_full <= first:
            return
        self._owner_num_handled[rid] = num_full
        ids = table[first:num_full]
        run_hashes = hashes[first:num_full]
        block_hash = self._block_hash
        if (
            [block_hash[b] for b in ids].count(None) == len(ids)
            and self._cached.keys().isdisjoint(run_hashes)
            and self._store_run(request, first, ids, run_hashes)
        ):
            return  # the common case: every block is new, one run, one event
        # Some blocks are cached already: prefix hits at the head of the table, or the same
        # prefix computed twice concurrently (the first copy stays cached). The blocks in between
        # are stored run by run, one event per run.
        count = len(ids)
        if len(set(ids)) != count or len(set(run_hashes)) != count:
            self._cache_block_by_block(request, first, ids, run_hashes)
            return
        # With no repeats, storing one block cannot change another's verdict: decide all at once.
        skip = list(
            map(
                or_,
                map(_is_hit, map(block_hash.__getitem__, ids)),
                map(self._cached.__contains__, run_hashes),
            )
        )
        start = 0
        while True:
            try:
                start = skip.index(False, start)
            except ValueError:
                return
            try:
                end = skip.index(True, start)
            except ValueError:
                end = count
            self._store_run(request, first + start, ids[start:end], run_hashes[start:end])
            start = end

    def _store_block(self, request: Request, index: int, block_id: int) -> bool:
        """Cache one block at table position `index` if new (`_store_run` of one, cheaper)."""
        block_hash = request.block_hashes[index]
        if self._block_hash[block_id] is not None or block_hash in self._cached:
            return False
        self._cached[block_hash] = block_id
        self._block_hash[block_id] = block_hash
        bs = self.block_size
        begin = index * bs
        tokens = request.token_ids
        block_tokens = tokens[begin : begin + bs]
        self._block_tokens[block_id] = block_tokens.tobytes()
        self._block_parent[block_id] = request.block_hashes[index - 1] if index > 0 else None
        self._events.append(
            BlockStored(
                block_hashes=[block_hash],
                parent_block_hash=request.block_hashes[index - 1] if index > 0 else None,
                token_ids=block_tokens,
                block_size=bs,
                medium=MEDIUM_GPU,
                lora_name=request.lora_name,
            )
        )
        if self.tiers is not None:
            self._stored_with_tiers(request, index, [block_id])
        return True

    def _store_run(
        self, request: Request, start: int, ids: list[int], hashes: list[BlockHash]
    ) -> bool:
        """Cache `ids` (table positions from `start`, none cached yet) under `hashes`, one event.

        Returns False, changing nothing, when a hash or a block repeats inside the run (the
        block-by-block path then decides which copy stays cached).
        """
        cached = self._cached
        num_cached = len(cached)
        cached.update(zip(hashes, ids, strict=True))
        count = len(ids)
        if len(cached) != num_cached + count or len(set(ids)) != count:
            for h in hashes:
                cached.pop(h, None)
            return False
        bs = self.block_size
        tokens = request.token_ids
        begin = start * bs
        packed = tokens[begin : begin + count * bs].tobytes()
        stride = 4 * bs
        stored = self._block_tokens
        block_hash = self._block_hash
        parents = self._block_parent
        parent = request.block_hashes[start - 1] if start > 0 else None
        for block_id, h, offset in zip(ids, hashes, range(0, len(packed), stride), strict=True):
            block_hash[block_id] = h
            stored[block_id] = packed[offset : offset + stride]
            parents[block_id] = parent
            parent = h
        self._emit_stored(request, start, hashes)
        if self.tiers is not None:
            self._stored_with_tiers(request, start, ids)
        return True

    def _stored_with_tiers(self, request: Request, start: int, ids: list[int]) -> None:
        """Blocks at table positions from `start` joined the GPU cache: drop a lower tier's copy
        of them (a hash lives in one place; a pinned copy goes when its load ends)."""
        tiers = cast("TierStore", self.tiers)
        hashes = request.block_hashes
        for index in range(start, start + len(ids)):
            tiers.discard(hashes[index], self._events)

    def _cache_block_by_block(
        self, request: Request, first: int, ids: list[int], hashes: list[BlockHash]
    ) -> None:
        """The sequential rule, for runs that repeat a hash or a block (a 64-bit collision)."""
        bs = self.block_size
        tokens = request.token_ids
        block_hash = self._block_hash
        cached = self._cached
        run_start = -1
        run_hashes: list[BlockHash] = []
        for index, (block_id, h) in enumerate(zip(ids, hashes, strict=True), first):
            if block_hash[block_id] is not None or h in cached:
                self._emit_stored(request, run_start, run_hashes)
                run_hashes = []
                continue
            cached[h] = block_id
            block_hash[block_id] = h
            self._block_tokens[block_id] = tokens[index * bs : (index + 1) * bs].tobytes()
            self._block_parent[block_id] = request.block_hashes[index - 1] if index else None
            if self.tiers is not None:
                self._stored_with_tiers(request, index, [block_id])
            if not run_hashes:
                run_start = index
            run_hashes.append(h)
        self._emit_stored(request, run_start, run_hashes)

    def _emit_stored(self, request: Request, start: int, hashes: list[BlockHash]) -> None:
        """One BlockStored for a run of blocks from table position `start` (the list is kept)."""
        if not hashes:
            return
        bs = self.block_size
        self._events.append(
            BlockStored(
                block_hashes=hashes,
                parent_block_hash=request.block_hashes[start - 1] if start > 0 else None,
                token_ids=request.token_ids[start * bs : (start + len(hashes)) * bs],
                block_size=bs,
                medium=MEDIUM_GPU,
                lora_name=request.lora_name,
            )
        )

    def reset_prefix_cache(self) -> bool:
        """Drop every cached block; only possible while no block is owned (vLLM's rule)."""
        if self._owner_blocks:
            return False
        self._block_hash = [None] * self.num_blocks
        self._block_tokens = [None] * self.num_blocks
        self._cached.clear()
        self._lru.clear()
        self._lru_stale = [0] * self.num_blocks
        self._num_stale = 0
        self._num_evictable = 0
        self._free_uncached = deque(range(self.num_blocks))
        if self.tiers is not None:  # (no load is in flight: a loading request owns blocks)
            self.tiers.clear()
        self._events.append(AllBlocksCleared())
        return True

    # -- allocation --------------------------------------------------------------------------
    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        computed_blocks: Sequence[int] = (),
        respect_watermark: bool = False,
    ) -> bool:
        """Make the request's block table cover its computed tokens plus `num_new_tokens`.

        `computed_blocks` are prefix-cache hits (from `get_computed_blocks`) to append first; they count
        as computed tokens. Returns False, changing nothing, if the pool cannot supply the blocks.
        """
        table = self._owner_blocks.get(request.request_id)
        num_new_blocks = self._num_new_blocks(request, num_new_tokens, computed_blocks, table)
        if num_new_blocks <= 0 and not computed_blocks:
            return True  # the common decode step: the last block still has room
        if not self._fits(num_new_blocks, computed_blocks, respect_watermark):
            return False
        if table is None:
            table = self._owner_blocks[request.request_id] = []
        if computed_blocks:
            if not table:  # hits head the table: cached already, nothing for cache_full_blocks
                self._owner_num_handled[request.request_id] = len(computed_blocks)
            self._acquire(computed_blocks, table)
        if num_new_blocks > 0:
            table += self._take_free_blocks(num_new_blocks)
        return True

    def can_allocate(
        self,
        request: Request,
        num_new_tokens: int,
        computed_blocks: Sequence[int] = (),
        respect_watermark: bool = False,
    ) -> bool:
        """Whether `allocate_slots` with these arguments would succeed now (changes nothing)."""
        table = self._owner_blocks.get(request.request_id)
        num_new_blocks = self._num_new_blocks(request, num_new_tokens, computed_blocks, table)
        if num_new_blocks <= 0 and not computed_blocks:
            return True
        return self._fits(num_new_blocks, computed_blocks, respect_watermark)

    def _num_new_blocks(
        self,
        request: Request,
        num_new_tokens: int,
        computed_blocks: Sequence[int],
        table: list[int] | None,
    ) -> int:
        bs = self.block_size
        num_hits = len(computed_blocks)
        num_tokens = request.num_computed_tokens + num_hits * bs + num_new_tokens
        return -(-num_tokens // bs) - (len(table) if table is not None else 0) - num_hits

    def _fits(
        self, num_new_blocks: int, computed_blocks: Sequence[int], respect_watermark: bool
    ) -> bool:
        # A hit on an evictable block takes it off the free list too.
        ref = self._ref
        num_revived = [ref[b] for b in computed_blocks].count(0) if computed_blocks else 0
        free = len(self._free_uncached) + self._num_evictable
        if respect_watermark:
            free -= self.watermark_blocks
        return max(num_new_blocks, 0) + num_revived <= free

    def num_free_before_evicting(self, block_hashes: Iterable[BlockHash], limit: int) -> int:
        """Fresh blocks that can be handed out (uncached ones first, then LRU evictions, as
        allocation takes them) before a block cached under one of `block_hashes` is evicted,
        counted up to `limit`: how much allocation a cached prefix survives. (Eviction order is
        this class's alone: the simulator's decode fast-forward bounds a run by this.)"""
        count = len(self._free_uncached)
        if count >= limit:
            return count
        num_evictable = self._num_evictable
        # Blocks under those hashes that sit in the LRU list (cached, no owner); the first of
        # them bounds the count.
        ref = self._ref
        targets = {
            block_id
            for block_id in map(self._cached.get, block_hashes)
            if block_id is not None and not ref[block_id]
        }
        if not targets:
            return min(count + num_evictable, limit)
        order = self._lru_order() if self._num_stale else iter(self._lru)
        try:
            position = indexOf(map(targets.__contains__, islice(order, limit - count)), True)
        except ValueError:
            return min(count + num_evictable, limit)
        return count + position

    def _lru_order(self) -> Iterator[int]:
        """The evictable blocks, least recently used first (the LRU list without stale entries)."""
        stale = self._lru_stale
        skipped: dict[int, int] = {}
        for block_id in self._lru:
            if stale[block_id]:
                seen = skipped.get(block_id, 0)
                if seen < stale[block_id]:
                    skipped[block_id] = seen + 1
                    continue
            yield block_id

    def reserve_blocks(
        self, owner_id: str, num_blocks: int, respect_watermark: bool = True
    ) -> list[int] | None:
        """Append `num_blocks` fresh blocks to `owner_id`'s table (migration reservations).

        Refuses (None) if that would dip below the watermark. Returns the new block ids.
        """
        if num_blocks < 0:
            raise ValueError("num_blocks must be >= 0")
        reserve = self.watermark_blocks if respect_watermark else 0
        if num_blocks > self.num_free_blocks - reserve:
            return None
        table = self._owner_blocks.setdefault(owner_id, [])
        new_blocks = self._take_free_blocks(num_blocks)
        table.extend(new_blocks)
        return new_blocks

    def share_cached_blocks(self, owner_id: str, block_ids: Iterable[int]) -> None:
        """Append already-cached blocks to `owner_id`'s table, taking a reference on each."""
        ids = list(block_ids)
        for block_id in ids:
            if not 0 <= block_id < self.num_blocks or self._block_hash[block_id] is None:
                raise ValueError(f"block {block_id} is not a cached block")
        self._acquire(ids, self._owner_blocks.setdefault(owner_id, []))

    def transfer_owner(self, old_owner: str, new_owner: str) -> None:
        """Give `old_owner`'s block table to `new_owner` (a committed migration becomes a request)."""
        if new_owner in self._owner_blocks:
            raise ValueError(f"{new_owner!r} already owns blocks")
        self._owner_blocks[new_owner] = self._owner_blocks.pop(old_owner, [])
        handled = self._owner_num_handled.pop(old_owner, None)
        if handled is not None:
            self._owner_num_handled[new_owner] = handled

    def _acquire(self, block_ids: Sequence[int], table: list[int]) -> None:
        ref = self._ref
        stale = self._lru_stale
        revived = 0
        for block_id in block_ids:
            if not ref[block_id]:  # evictable: its LRU entry goes stale
                stale[block_id] += 1
                revived += 1
            ref[block_id] += 1
        table.extend(block_ids)
        if revived:
            self._num_evictable -= revived
            self._num_stale += revived
            if self._num_stale > 64 and 2 * self._num_stale > len(self._lru):
                self._compact_lru()

    def _compact_lru(self) -> None:
        """Drop the stale LRU entries (once they are most of the list: amortised O(1) each)."""
        live = deque(self._lru_order())
        stale = self._lru_stale
        for block_id in self._lru:
            stale[block_id] = 0
        self._lru = live
        self._num_stale = 0

    def _take_free_blocks(self, count: int) -> list[int]:
        """`count` blocks off the free lists (the caller checked there are enough), ref count 1:
        uncached ones first, in free order, then the least recently used cached ones, evicted
        (one BlockRemoved, merged into a pending one, as vLLM batches them)."""
        free = self._free_uncached
        if count == 1:  # a decode step's crossing: skip the bulk machinery
            block_id = free.popleft() if free else self._evict(1)[0]
            self._ref[block_id] = 1
            return [block_id]
        if count <= len(free):
            pop = free.popleft
            block_ids = [pop() for _ in range(count)]
        else:
            block_ids = list(free)
            free.clear()
            block_ids += self._evict(count - len(block_ids))
        ref = self._ref
        for block_id in block_ids:
            ref[block_id] = 1
        return block_ids

    def _evict(self, count: int) -> list[int]:
        pop = self._lru.popleft
        victims: list[int]
        if self._num_stale:
            victims = []
            stale = self._lru_stale
            while len(victims) < count:
                block_id = pop()
                if stale[block_id]:  # its oldest entries are the stale ones
                    stale[block_id] -= 1
                    self._num_stale -= 1
                else:
                    victims.append(block_id)
        elif count == 1:
            victims = [pop()]
        else:
            victims = [pop() for _ in range(count)]
        self._num_evictable -= count
        self.num_evictions += count
        block_hash = self._block_hash
        block_tokens = self._block_tokens
        hashes = cast("list[BlockHash]", [block_hash[block_id] for block_id in victims])
        if self.tiers is not None:
            self._demote(victims, hashes)
        for block_id in victims:
            block_hash[block_id] = None
            block_tokens[block_id] = None
        cached = self._cached
        for h in hashes:
            del cached[h]  # (a KeyError here would mean an evictable block was not cached)
        events = self._events
        if events and type(events[-1]) is BlockRemoved and events[-1].medium == MEDIUM_GPU:
            # Evictions in a row become one event: fewer events to publish and index. The
            # pending list is ours until take_events hands it out.
            events[-1].block_hashes.extend(hashes)
        else:
            events.append(BlockRemoved(block_hashes=hashes, medium=MEDIUM_GPU))
        return victims

    def _demote(self, victims: list[int], hashes: list[BlockHash]) -> None:
        """Move evicted blocks down a tier (their events precede the GPU removal)."""
        tiers = cast("TierStore", self.tiers)
        parents = self._block_parent
        tokens = self._block_tokens
        for block_id, h in zip(victims, hashes, strict=True):
            block_tokens = tokens[block_id]
            assert block_tokens is not None
            tiers.demote(h, parents[block_id], block_tokens, block_id, self._offloads, self._events)
            parents[block_id] = None

    # -- tiers -------------------------------------------------------------------------------
    def take_offloads(self) -> list[BlockCopy]:
        """The copies evictions queued since the last call, in the order they must run."""
        copies, self._offloads = self._offloads, []
        return copies

    def restore_tier(self, medium: str, entries: list[SlotEntry]) -> None:
        """Fill the empty `medium` tier with `entries` (`TierStore.restore`; `ValueError` when
        they do not fit it, or the GPU pool caches one of them)."""
        if self.tiers is None:
            raise ValueError("this pool has no lower tiers")
        if any(entry.block_hash in self._cached for entry in entries):
            raise ValueError("a restored block is cached on the GPU")
        self.tiers.restore(medium, entries, self._events)

    def lower_tier_hits(self, request: Request, start: int) -> list[TierHit]:
        """The blocks of `request` from table position `start` (its GPU hits) on that the lower
        tiers hold, up to the first miss or mismatch, never covering its last token."""
        tiers = self.tiers
        if tiers is None:
            return []
        bs = self.block_size
        tokens = request.token_ids
        end = min((len(tokens) - 1) // bs, len(request.block_hashes))
        hits: list[TierHit] = []
        for index in range(start, end):
            hit = tiers.locate(request.block_hashes[index])
            if hit is None or tiers.tokens(hit) != tokens[index * bs : (index + 1) * bs].tobytes():
                break  # a miss, or a hash collision: never serve another prompt's KV
            hits.append(hit)
        return hits

    def start_load(
        self,
        request: Request,
        computed_blocks: Sequence[int],
        hits: Sequence[TierHit],
        num_new_tokens: int,
        respect_watermark: bool = False,
    ) -> list[BlockCopy] | None:
        """Allocate the request's table for its GPU hits, then `hits` (to be loaded) and then
        `num_new_tokens`, and pin the hits' slots; the copies that load the hits. None, changing
        nothing, when the blocks do not fit."""
        tiers = cast("TierStore", self.tiers)
        num_tokens = len(hits) * self.block_size + num_new_tokens
        if not self.can_allocate(request, num_tokens, computed_blocks, respect_watermark):
            return None
        for hit in hits:  # before allocating: its evictions must not push these slots out
            tiers.pin(hit)
        allocated = self.allocate_slots(request, num_tokens, computed_blocks, respect_watermark)
        assert allocated
        self._loads[request.request_id] = list(hits)
        table = self._owner_blocks[request.request_id]
        first = len(computed_blocks)
        return [
            BlockCopy(tiers.tiers[hit.level].medium, hit.slot, MEDIUM_GPU, block_id)
            for hit, block_id in zip(hits, table[first : first + len(hits)], strict=True)
        ]

    def finish_load(self, request: Request, outcome: LoadOutcome) -> None:
        """End `request`'s load: "loaded" (its `num_computed_tokens` now covers the loaded
        blocks: they join the GPU prefix cache), "failed" (the copies failed: those lower entries
        are dropped) or "abandoned" (the request ended meanwhile). The table stays the owner's."""
        hits = self._loads.pop(request.request_id)
        tiers = cast("TierStore", self.tiers)
        if outcome == "loaded":
            self.cache_full_blocks(request)
        cached = self._cached
        for hit in hits:
            if outcome == "loaded":
                tiers.tiers[hit.level].counters.hits += 1
            drop = outcome == "failed" or hit.block_hash in cached
            tiers.release(hit, drop, self._events)

    def free(self, request: Request) -> None:
        self.free_owner(request.request_id)

    def free_owner(self, owner_id: str) -> None:
        """Drop `owner_id`'s references, tail first, so tails are evicted before heads."""
        self._owner_num_handled.pop(owner_id, None)
        table = self._owner_blocks.pop(owner_id, None)
        if not table:
            return
        ref = self._ref
        block_hash = self._block_hash
        lru = self._lru
        num_lru = len(lru)
        lru_append = lru.append
        free_append = self._free_uncached.append
        # A plain loop: shared prefix blocks need the per-block count anyway.
        for block_id in reversed(table):
            count = ref[block_id] - 1
            ref[block_id] = count
            if not count:
                if block_hash[block_id] is not None:
                    lru_append(block_id)
                else:
                    free_append(block_id)
        self._num_evictable += len(lru) - num_lru

    # -- events and checks -------------------------------------------------------------------
    def take_events(self) -> list[KVEvent]:
        events, self._events = self._events, []
        return events

    def check_integrity(self) -> None:
        """Assert the pool's invariants; raises AssertionError describing the first violation."""
        if self.tiers is not None:
            self.tiers.check_integrity()
            pinned = {hit.block_hash for hits in self._loads.values() for hit in hits}
            for h in self._cached.keys() & set().union(*self.tiers.block_hashes().values()):
                assert h in pinned, f"{h} is cached on the GPU and a lower tier, not being loaded"
            assert self._loads.keys() <= self._owner_blocks.keys(), "a load without blocks"
        refs = [0] * self.num_blocks
        for owner, table in self._owner_blocks.items():
            for block_id in table:
                assert 0 <= block_id < self.num_blocks, f"{owner} holds invalid block {block_id}"
                refs[block_id] += 1
        for owner, handled in self._owner_num_handled.items():
            assert 0 <= handled <= len(self._owner_blocks.get(owner, ())), (
                f"{owner}: {handled} blocks marked handled but it holds fewer"
            )
        free_uncached = set(self._free_uncached)
        assert len(free_uncached) == len(self._free_uncached), "duplicate block in free list"
        entries = Counter(self._lru)
        stale = self._lru_stale
        assert sum(stale) == self._num_stale, "stale LRU entries miscounted"
        for bid, num in enumerate(stale):
            assert num <= entries[bid], f"block {bid}: {num} stale LRU entries of {entries[bid]}"
        evictable = list(self._lru_order())
        assert len(set(evictable)) == len(evictable), "block twice in the LRU order"
        evictable_set = set(evictable)
        assert len(evictable) == self._num_evictable, "evictable blocks miscounted"
        assert not free_uncached & evictable_set, "block both free and evictable"
        assert len(self._block_tokens) == self.num_blocks, "token column lost its slots"
        assert len(self._block_hash) == self.num_blocks, "hash column lost its slots"
        for bid in range(self.num_blocks):
            assert self._ref[bid] == refs[bid], (
                f"block {bid}: ref_count {self._ref[bid]} but {refs[bid]} owners hold it"
            )
            is_free = bid in free_uncached or bid in evictable_set
            assert is_free == (refs[bid] == 0), f"block {bid}: free state disagrees with refs"
            block_hash = self._block_hash[bid]
            assert (block_hash is None) == (self._block_tokens[bid] is None), (
                f"block {bid}: hash and token columns differ"
            )
            if bid in free_uncached:
                assert block_hash is None, f"uncached free block {bid} has a hash"
            if bid in evictable_set:
                assert block_hash is not None, f"evictable block {bid} has no hash"
            if block_hash is not None:
                assert self._cached.get(block_hash) == bid, f"block {bid} not in hash map"
                assert len(self._block_tokens[bid] or b"") == 4 * self.block_size
        assert len(self._cached) == self.num_blocks - self._block_hash.count(None), (
            "hash map has entries for blocks that do not carry that hash"
        )
