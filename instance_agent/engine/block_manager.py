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
- Every change to the set of cached blocks is reported as a KV event (`BlockStored`, `BlockRemoved`,
  `AllBlocksCleared`), collected until `take_events()`; replaying the events yields exactly the
  cached-block set.
- The watermark keeps a fraction of the pool free when admitting new work, so running requests can grow
  without immediate preemption.
- Allocation is all-or-nothing: a failed `allocate_slots` or `reserve_blocks` changes nothing.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from instance_agent.engine.block_hash import BlockHash
from instance_agent.engine.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from instance_agent.engine.request import Request


@dataclass(slots=True)
class KVBlock:
    block_id: int
    ref_count: int = 0
    block_hash: BlockHash | None = None
    token_ids: tuple[int, ...] | None = None  # kept for verifying prefix-cache hits


class BlockManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        watermark: float = 0.01,
    ) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError("num_blocks and block_size must be positive")
        if not 0.0 <= watermark < 1.0:
            raise ValueError("watermark must be in [0, 1)")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.watermark_blocks = int(watermark * num_blocks)
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self._free_uncached: deque[int] = deque(range(num_blocks))
        self._evictable: OrderedDict[int, None] = OrderedDict()  # LRU order, oldest first
        self._cached: dict[BlockHash, int] = {}  # block hash -> block id
        self._owner_blocks: dict[str, list[int]] = {}
        # Leading blocks of each owner's table that `cache_full_blocks` has already handled, so a
        # decode step costs O(new blocks), not O(context) (vLLM's num_cached_block).
        self._owner_num_handled: dict[str, int] = {}
        self._events: list[KVEvent] = []

    # -- sizes -------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now (uncached free plus evictable cached)."""
        return len(self._free_uncached) + len(self._evictable)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks registered in the prefix cache, in use or evictable."""
        return len(self._cached)

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

    # -- prefix cache ------------------------------------------------------------------------
    def get_computed_blocks(self, request: Request) -> tuple[list[int], int]:
        """Leading cached blocks of `request` and how many tokens they cover."""
        if not self.enable_prefix_caching:
            return [], 0
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[int] = []
        tokens = request.token_ids
        bs = self.block_size
        for index, block_hash in enumerate(request.block_hashes[:max_blocks]):
            block_id = self._cached.get(block_hash)
            if block_id is None:
                break
            block = self.blocks[block_id]
            if block.token_ids != tuple(tokens[index * bs : (index + 1) * bs]):
                break  # a hash collision: never serve another prompt's KV
            hits.append(block_id)
        return hits, len(hits) * bs

    def lookup_cached_prefix(self, block_hashes: Sequence[BlockHash]) -> list[int]:
        """Block ids of the leading `block_hashes` present in the cache (hash match only)."""
        hits: list[int] = []
        for block_hash in block_hashes:
            block_id = self._cached.get(block_hash)
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def cache_full_blocks(self, request: Request) -> None:
        """Register the request's computed full blocks in the prefix cache (emits BlockStored)."""
        if not self.enable_prefix_caching:
            return
        table = self._owner_blocks.get(request.request_id)
        if not table:
            return
        num_full = min(
            request.num_computed_tokens // self.block_size, len(request.block_hashes), len(table)
        )
        first = self._owner_num_handled.get(request.request_id, 0)
        if num_full <= first:
            return
        self._owner_num_handled[request.request_id] = num_full
        bs = self.block_size
        blocks = self.blocks
        cached = self._cached
        hashes = request.block_hashes
        tokens = request.token_ids
        run_start = -1
        run_hashes: list[BlockHash] = []
        for index in range(first, num_full):
            block = blocks[table[index]]
            if block.block_hash is not None:
                self._emit_stored(request, run_start, run_hashes)
                run_hashes = []
                continue
            block_hash = hashes[index]
            if block_hash in cached:
                # The same prefix was computed twice concurrently: keep the first copy cached.
                self._emit_stored(request, run_start, run_hashes)
                run_hashes = []
                continue
            block.block_hash = block_hash
            start = index * bs
            block.token_ids = tuple(tokens[start : start + bs])
            cached[block_hash] = block.block_id
            if not run_hashes:
                run_start = index
            run_hashes.append(block_hash)
        self._emit_stored(request, run_start, run_hashes)

    def _emit_stored(self, request: Request, start: int, hashes: list[BlockHash]) -> None:
        if not hashes:
            return
        bs = self.block_size
        self._events.append(
            BlockStored(
                block_hashes=list(hashes),
                parent_block_hash=request.block_hashes[start - 1] if start > 0 else None,
                token_ids=request.token_ids[start * bs : (start + len(hashes)) * bs],
                block_size=bs,
            )
        )

    def reset_prefix_cache(self) -> bool:
        """Drop every cached block; only possible while no block is owned (vLLM's rule)."""
        if self._owner_blocks:
            return False
        for block in self.blocks:
            block.block_hash = None
            block.token_ids = None
        self._cached.clear()
        self._evictable.clear()
        self._free_uncached = deque(range(self.num_blocks))
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
        table = self._owner_blocks.get(request.request_id, [])
        num_new_blocks = self._num_new_blocks(request, num_new_tokens, computed_blocks, table)
        if num_new_blocks <= 0 and not computed_blocks:
            return True  # the common decode step: the last block still has room
        if not self._fits(num_new_blocks, computed_blocks, respect_watermark):
            return False
        table = self._owner_blocks.setdefault(request.request_id, table)
        self._acquire(computed_blocks, table)
        free_uncached = self._free_uncached
        blocks = self.blocks
        for _ in range(num_new_blocks):
            if free_uncached:  # `_take_free_block`'s first choice, inlined for long prompts
                block_id = free_uncached.popleft()
                blocks[block_id].ref_count = 1
                table.append(block_id)
            else:
                table.append(self._take_free_block())
        return True

    def can_allocate(
        self,
        request: Request,
        num_new_tokens: int,
        computed_blocks: Sequence[int] = (),
        respect_watermark: bool = False,
    ) -> bool:
        """Whether `allocate_slots` with these arguments would succeed now (changes nothing)."""
        table = self._owner_blocks.get(request.request_id, [])
        num_new_blocks = self._num_new_blocks(request, num_new_tokens, computed_blocks, table)
        if num_new_blocks <= 0 and not computed_blocks:
            return True
        return self._fits(num_new_blocks, computed_blocks, respect_watermark)

    def _num_new_blocks(
        self,
        request: Request,
        num_new_tokens: int,
        computed_blocks: Sequence[int],
        table: list[int],
    ) -> int:
        num_tokens = (
            request.num_computed_tokens + len(computed_blocks) * self.block_size + num_new_tokens
        )
        return self.blocks_needed(num_tokens) - len(table) - len(computed_blocks)

    def _fits(
        self, num_new_blocks: int, computed_blocks: Sequence[int], respect_watermark: bool
    ) -> bool:
        num_revived = sum(1 for b in computed_blocks if self.blocks[b].ref_count == 0)
        reserve = self.watermark_blocks if respect_watermark else 0
        return max(num_new_blocks, 0) + num_revived <= self.num_free_blocks - reserve

    def num_free_before_evicting(self, block_hashes: set[BlockHash], limit: int) -> int:
        """Fresh blocks that can be handed out before one cached under `block_hashes` is evicted
        (counted up to `limit`)."""
        count = len(self._free_uncached)
        for block_id in self._evictable:
            if count >= limit or self.blocks[block_id].block_hash in block_hashes:
                break
            count += 1
        return count

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
        new_blocks = [self._take_free_block() for _ in range(num_blocks)]
        table.extend(new_blocks)
        return new_blocks

    def share_cached_blocks(self, owner_id: str, block_ids: Iterable[int]) -> None:
        """Append already-cached blocks to `owner_id`'s table, taking a reference on each."""
        ids = list(block_ids)
        for block_id in ids:
            if self.blocks[block_id].block_hash is None:
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

    def _acquire(self, block_ids: Iterable[int], table: list[int]) -> None:
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self._evictable[block_id]
            block.ref_count += 1
            table.append(block_id)

    def _take_free_block(self) -> int:
        if self._free_uncached:
            block_id = self._free_uncached.popleft()
            self.blocks[block_id].ref_count = 1
            return block_id
        block_id, _ = self._evictable.popitem(last=False)
        block = self.blocks[block_id]
        block_hash = block.block_hash
        assert block_hash is not None
        del self._cached[block_hash]
        events = self._events
        if events and isinstance(events[-1], BlockRemoved):
            # Evictions in a row become one event, as vLLM batches them: fewer events to publish
            # and index. The pending list is ours until take_events hands it out.
            events[-1].block_hashes.append(block_hash)
        else:
            events.append(BlockRemoved(block_hashes=[block_hash]))
        block.block_hash = None
        block.token_ids = None
        block.ref_count = 1
        return block_id

    def free(self, request: Request) -> None:
        self.free_owner(request.request_id)

    def free_owner(self, owner_id: str) -> None:
        """Drop `owner_id`'s references, tail first, so tails are evicted before heads."""
        self._owner_num_handled.pop(owner_id, None)
        for block_id in reversed(self._owner_blocks.pop(owner_id, [])):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                if block.block_hash is not None:
                    self._evictable[block_id] = None
                else:
                    self._free_uncached.append(block_id)

    # -- events and checks -------------------------------------------------------------------
    def take_events(self) -> list[KVEvent]:
        events, self._events = self._events, []
        return events

    def check_integrity(self) -> None:
        """Assert the pool's invariants; raises AssertionError describing the first violation."""
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
        assert not free_uncached & self._evictable.keys(), "block both free and evictable"
        for block in self.blocks:
            bid = block.block_id
            assert block.ref_count == refs[bid], (
                f"block {bid}: ref_count {block.ref_count} but {refs[bid]} owners hold it"
            )
            is_free = bid in free_uncached or bid in self._evictable
            assert is_free == (block.ref_count == 0), f"block {bid}: free state disagrees with refs"
            if bid in free_uncached:
                assert block.block_hash is None, f"uncached free block {bid} has a hash"
            if bid in self._evictable:
                assert block.block_hash is not None, f"evictable block {bid} has no hash"
            if block.block_hash is not None:
                assert self._cached.get(block.block_hash) == bid, f"block {bid} not in hash map"
                assert block.token_ids is not None and len(block.token_ids) == self.block_size
        assert len(self._cached) == sum(b.block_hash is not None for b in self.blocks), (
            "hash map has entries for blocks that do not carry that hash"
        )
