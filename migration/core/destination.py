"""One incoming migration's destination protocol, sans-IO: events in (explicit time), actions out.

Contract:
- `on_reserve` opens a stage: stage 0 first asks its driver to `ShareCached` the leading blocks'
  hashes (answered by `on_shared`); then every stage asks to `ReserveBlocks` the fresh blocks it
  lacks (answered by `on_reserved`, None: no room), taking blocks reserved ahead first
  (`expected_blocks`, a P/D handoff). It ends in `Accept` (the stage's shared and reserved block
  ids) or `Refuse`.
- `on_commit` answers `Adopt` or `Refuse` (blocks reserved ahead unfilled, or a state that does
  not match the blocks held); `on_abort` answers `Refuse(SRC_CANCELLED)`.
- Every `Refuse` means: the driver frees everything the migration holds, then answers it refused.
- `expired(now, timeout_s)`: the source has been silent for longer than `timeout_s`.
- Pure: no engine, no wire, no clock of its own. Drivers: `migration.destination` (agents),
  `simulator.cluster`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from migration.core.protocol import AbortReason
from migration.core.session import AheadBlocks, DestinationSession


@dataclass(frozen=True, slots=True)
class ShareCached:
    hashes: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class ReserveBlocks:
    count: int


@dataclass(frozen=True, slots=True)
class Accept:
    shared_block_ids: tuple[int, ...]
    reserved_block_ids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Adopt:
    pass


@dataclass(frozen=True, slots=True)
class Refuse:
    reason: AbortReason
    detail: str


ReserveAction = ShareCached | ReserveBlocks | Accept | Refuse  # a stage's steps
CommitAction = Adopt | Refuse


@dataclass(slots=True)
class _Stage:
    index: int
    num_blocks: int
    expected_blocks: int
    shared: tuple[int, ...] = ()


class DestinationProtocol:
    """The destination's steps for one migration (the driver holds the engine's blocks)."""

    def __init__(self, request_id: str, block_size: int, now: float) -> None:
        self.decisions = DestinationSession(request_id, block_size)
        self.ahead = AheadBlocks()
        self.last_seen = now
        self._stage: _Stage | None = None

    def on_reserve(
        self,
        stage: int,
        num_blocks: int,
        expected_blocks: int,
        block_hashes: Sequence[int],
        now: float,
    ) -> ReserveAction:
        self.last_seen = now
        self._stage = _Stage(stage, num_blocks, expected_blocks)
        hashes = DestinationSession.hashes_to_share(
            stage, max(num_blocks, expected_blocks), block_hashes
        )
        if hashes:
            return ShareCached(tuple(hashes))
        return self.on_shared(())

    def on_shared(self, shared: Sequence[int]) -> ReserveAction:
        st = self._open()
        st.shared = tuple(shared)
        count = self.ahead.to_reserve(st.index, st.num_blocks, st.expected_blocks, len(shared))
        if count is None:
            return self.on_reserved(())
        return ReserveBlocks(count)

    def on_reserved(self, fresh: Sequence[int] | None) -> ReserveAction:
        st = self._open()
        self._stage = None
        reserved = (
            None
            if fresh is None
            else self.ahead.take(st.index, st.num_blocks, len(st.shared), fresh)
        )
        answer = DestinationSession.answer(st.num_blocks, st.shared, reserved)
        if not answer.accepted:
            return Refuse(AbortReason.DST_REFUSED, answer.reason)
        return Accept(answer.shared_block_ids, answer.reserved_block_ids)

    def on_commit(
        self, request_id: str, num_computed_tokens: int, num_blocks_held: int, now: float
    ) -> CommitAction:
        self.last_seen = now
        refusal = self.ahead.commit_refusal() or self.decisions.commit_refusal(
            request_id, num_computed_tokens, num_blocks_held
        )
        if refusal is not None:
            return Refuse(AbortReason.DST_FAILED, refusal)
        return Adopt()

    def on_abort(self) -> Refuse:
        return Refuse(AbortReason.SRC_CANCELLED, "aborted by the source")

    def expired(self, now: float, timeout_s: float) -> bool:
        return now - self.last_seen > timeout_s

    def _open(self) -> _Stage:
        if self._stage is None:
            raise RuntimeError("no stage is being reserved")
        return self._stage
