"""The source side of a live migration as a pure state machine: which blocks each stage copies.

Contract (Llumnix's multi-stage copy, OSDI'24 §4.2):
- A live stage copies every *full* block the destination does not hold yet, while the request keeps
  decoding on the source. Full blocks never change again, so a copy made while decoding continues is
  exact; the last, still-filling block is left for later.
- Stages repeat for the blocks filled meanwhile until at most `last_stage_max_blocks` blocks remain
  or `max_live_stages` live stages ran; then the driver suspends the request and the stop-and-copy
  stage copies the rest, the partial last block included. Downtime is therefore bounded by the copy
  of at most K blocks plus the commit, whatever the context length.
- Cache-aware transfer: with the first reservation the destination reports how many leading blocks
  it already caches (by chained block hash); those are shared there by reference count and never sent.
- Opened before the prefill (`prefill_tokens`: a P/D handoff reserves on its decode instance at
  admission): stage 0 offers the hashes of every full block of the prompt and asks the destination
  to reserve all `blocks_for(prefill_tokens)` blocks now (`Stage.expected_blocks`); its cached
  leading blocks may then lie beyond what the source has computed yet. Live stages copy the full
  blocks a chunked prefill has computed so far (immutable like any full block), so the
  stop-and-copy at the first token sends only the last chunk's blocks.
- Every transition is checked: the blocks already on the destination must still be the request's
  leading blocks (a preempted and rescheduled request gets new blocks, which aborts the migration),
  and a reservation answer must match what was asked. Violations raise `MigrationAborted`.
- No I/O and no clock: the drivers (`migration.source`) and the simulator feed it block lists.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

from migration.core.protocol import AbortReason


@dataclass(frozen=True, slots=True)
class StageConfig:
    """Knobs of the multi-stage copy (Llumnix's migration_last_stage_max_blocks / max_stages)."""

    last_stage_max_blocks: int = 4  # K: stop-and-copy once at most this many blocks remain
    max_live_stages: int = 8  # after this many live stages, stop-and-copy whatever remains
    cache_aware: bool = True  # offer block hashes so the destination shares its cached prefix

    def __post_init__(self) -> None:
        # K >= 1 guarantees every live stage moves at least one block (see `needs_suspend`).
        if self.last_stage_max_blocks < 1:
            raise ValueError("last_stage_max_blocks must be at least 1")
        if self.max_live_stages < 0:
            raise ValueError("max_live_stages must be non-negative")


class MigrationAborted(Exception):
    """The migration cannot go on; `reason` says why (the request then continues on the source)."""

    def __init__(self, reason: AbortReason, detail: str = "") -> None:
        super().__init__(f"{reason.value}: {detail}" if detail else reason.value)
        self.reason = reason
        self.detail = detail


class Phase(enum.Enum):
    LIVE = "live"  # copying while the request decodes
    SUSPENDED = "suspended"  # request paused; the stop-and-copy stage is next
    COMMITTING = "committing"  # every block is on the destination
    COMMITTED = "committed"
    ABORTED = "aborted"


@dataclass(frozen=True, slots=True)
class Stage:
    """One copy step: the request's blocks `[first_block, first_block + len(src_block_ids))`."""

    index: int
    first_block: int
    src_block_ids: tuple[int, ...]
    final: bool  # the stop-and-copy stage
    num_kv_tokens: int  # tokens whose KV the destination holds once this stage lands
    block_hashes: tuple[int, ...] = ()  # stage 0 only: hashes of its full blocks, for cache sharing
    # Stage 0 of a session opened before the prefill: the blocks the request will hold at its
    # first token, all reserved on the destination now (later stages fill them).
    expected_blocks: int = 0

    @property
    def num_blocks(self) -> int:
        return len(self.src_block_ids)


def blocks_for(num_tokens: int, block_size: int) -> int:
    """Blocks that hold the KV of `num_tokens` tokens."""
    return -(-num_tokens // block_size)


class StagePlanner:
    """Plans the stages of one request's migration and records what has reached the destination."""

    def __init__(
        self, request_id: str, block_size: int, config: StageConfig, prefill_tokens: int = 0
    ) -> None:
        if block_size < 1:
            raise ValueError("block_size must be at least 1")
        self.request_id = request_id
        self.block_size = block_size
        self.config = config
        # > 0: opened before the prefill, which leaves this much KV at the first token.
        self.prefill_tokens = prefill_tokens
        self.phase = Phase.LIVE
        self.abort_reason: AbortReason | None = None
        # The request's leading source blocks that the destination holds (shared or received);
        # None for a cached block shared there before the source had allocated its own.
        self._on_dst: list[int | None] = []
        self.num_shared_blocks = 0  # leading blocks taken from the destination's cache
        self.num_kv_tokens = 0  # tokens whose KV the destination holds
        self.stages: list[Stage] = []  # stages that landed, cache-shared blocks trimmed
        self._pending: Stage | None = None

    # -- sizes -----------------------------------------------------------------------------------
    @property
    def num_live_stages(self) -> int:
        return sum(1 for s in self.stages if not s.final)

    @property
    def blocks_sent(self) -> int:
        return sum(s.num_blocks for s in self.stages)

    def has_full_blocks_to_send(self, num_kv_tokens: int) -> bool:
        """Does a live stage now have at least one full block to copy?"""
        return num_kv_tokens // self.block_size > len(self._on_dst)

    # -- transitions -----------------------------------------------------------------------------
    def needs_suspend(self, block_ids: Sequence[int], num_kv_tokens: int) -> bool:
        """True when the next stage should be the stop-and-copy one."""
        self._require(Phase.LIVE)
        remaining = blocks_for(num_kv_tokens, self.block_size) - len(self._on_dst)
        # remaining > K >= 1 means at least two blocks are missing, so at least one of them is
        # full: a live stage always makes progress.
        return (
            remaining <= self.config.last_stage_max_blocks
            or self.num_live_stages >= self.config.max_live_stages
        )

    def suspended(self) -> None:
        """The driver paused the request on the source; only the stop-and-copy stage is left."""
        self._require(Phase.LIVE)
        self.phase = Phase.SUSPENDED

    def next_stage(
        self,
        block_ids: Sequence[int],
        num_kv_tokens: int,
        block_hashes: Sequence[int] = (),
    ) -> Stage:
        """The next stage for the request's current `block_ids` and KV length.

        Live: the full blocks not on the destination. Suspended: every block not on the
        destination, the partial last one included. `block_hashes` (the request's full-block hash
        chain) is attached to stage 0 so the destination can share its cached prefix.
        """
        if self._pending is not None:
            raise RuntimeError("the previous stage has not landed")
        if self.phase not in (Phase.LIVE, Phase.SUSPENDED):
            raise RuntimeError(f"no stage to plan in phase {self.phase.value}")
        self.check_prefix(block_ids, num_kv_tokens)
        final = self.phase is Phase.SUSPENDED
        if final:
            end = blocks_for(num_kv_tokens, self.block_size)
            covered = num_kv_tokens
        else:
            end = num_kv_tokens // self.block_size
            covered = end * self.block_size
        if end > len(block_ids):
            raise MigrationAborted(
                AbortReason.REQUEST_PREEMPTED,
                f"{len(block_ids)} blocks cannot hold {num_kv_tokens} tokens of KV",
            )
        start = len(self._on_dst)
        end = max(end, start)  # cached blocks shared ahead of the source's prefill
        hashes: tuple[int, ...] = ()
        expected = 0
        if not self.stages:
            expected = blocks_for(self.prefill_tokens, self.block_size)
            if self.config.cache_aware:
                full = max(
                    min(end, num_kv_tokens // self.block_size),
                    self.prefill_tokens // self.block_size,
                )
                hashes = tuple(block_hashes[:full])
        stage = Stage(
            index=len(self.stages),
            first_block=start,
            src_block_ids=tuple(block_ids[start:end]),
            final=final,
            num_kv_tokens=max(covered, self.num_kv_tokens),
            block_hashes=hashes,
            expected_blocks=expected,
        )
        self._pending = stage
        return stage

    def reserved(self, stage: Stage, num_cached_blocks: int, num_reserved: int) -> Stage:
        """Apply the destination's reservation answer; returns the stage with shared blocks trimmed.

        `num_cached_blocks` leading blocks of stage 0 are shared from the destination's cache;
        `num_reserved` blocks receive the rest."""
        if stage is not self._pending:
            raise RuntimeError("reservation for a stage that is not pending")
        if num_cached_blocks and (stage.index != 0 or num_cached_blocks > len(stage.block_hashes)):
            raise MigrationAborted(
                AbortReason.DST_FAILED,
                f"destination claims {num_cached_blocks} cached blocks for stage {stage.index} "
                f"with {len(stage.block_hashes)} hashed blocks",
            )
        expected = max(0, stage.num_blocks - num_cached_blocks)
        if num_cached_blocks < 0 or num_reserved != expected:
            raise MigrationAborted(
                AbortReason.DST_FAILED,
                f"destination reserved {num_reserved} blocks, expected {expected}",
            )
        if num_cached_blocks:
            known = stage.src_block_ids[:num_cached_blocks]
            self._on_dst.extend(known)
            self._on_dst.extend([None] * (num_cached_blocks - len(known)))
            self.num_shared_blocks = num_cached_blocks
            stage = Stage(
                index=stage.index,
                first_block=stage.first_block + num_cached_blocks,
                src_block_ids=stage.src_block_ids[num_cached_blocks:],
                final=stage.final,
                num_kv_tokens=stage.num_kv_tokens,
                block_hashes=stage.block_hashes,
                expected_blocks=stage.expected_blocks,
            )
            self._pending = stage
        return stage

    def landed(self, stage: Stage) -> None:
        """The stage's KV was written on the destination."""
        if stage is not self._pending:
            raise RuntimeError("landed() for a stage that is not pending")
        self._on_dst.extend(stage.src_block_ids)
        self.num_kv_tokens = stage.num_kv_tokens
        self.stages.append(stage)
        self._pending = None
        if stage.final:
            self.phase = Phase.COMMITTING

    def committed(self) -> None:
        self._require(Phase.COMMITTING)
        self.phase = Phase.COMMITTED

    def abort(self, reason: AbortReason) -> bool:
        """End the migration. Returns True if the request was suspended (the driver must resume
        it on the source, unless it is gone)."""
        if self.phase in (Phase.COMMITTED, Phase.ABORTED):
            raise RuntimeError(f"cannot abort a migration that is already {self.phase.value}")
        was_suspended = self.phase in (Phase.SUSPENDED, Phase.COMMITTING)
        self.phase = Phase.ABORTED
        self.abort_reason = reason
        self._pending = None
        return was_suspended

    # -- checks ----------------------------------------------------------------------------------
    def _require(self, phase: Phase) -> None:
        if self.phase is not phase:
            raise RuntimeError(f"expected phase {phase.value}, in {self.phase.value}")

    def check_prefix(self, block_ids: Sequence[int], num_kv_tokens: int) -> None:
        """Raise `MigrationAborted` if the blocks sent are no longer the request's."""
        on_dst = self._on_dst
        changed = len(block_ids) < len(on_dst) and any(
            b is not None for b in on_dst[len(block_ids) :]
        )
        if not changed:
            changed = any(
                b is not None and b != mine for b, mine in zip(on_dst, block_ids, strict=False)
            )
        if changed or num_kv_tokens < self.num_kv_tokens:
            # The blocks we copied are no longer the request's: it was preempted (and maybe
            # recomputed into new blocks) since the last stage.
            raise MigrationAborted(
                AbortReason.REQUEST_PREEMPTED, "the request's blocks changed during migration"
            )
