"""Sans-IO migration sessions: the order of every check and step of one live migration, both sides.

Contract:
- `SourceSession` drives one request's multi-stage copy (`StagePlanner`) on the source. It takes
  events (a snapshot of the request, suspended, a reservation answer, blocks landed, the commit
  answer, released, a failure) and returns the one action the driver performs next: `Snapshot`
  (read the request's phase, blocks, KV length and block hashes), `Suspend`, `Reserve(stage)`,
  `Copy(stage)` (send the stage's blocks; a stage without blocks lands at once), `Commit` (send the
  request state), `Release` (end the request here as migrated), `Done` (committed), `Wait`
  (snapshot again once the engine has stepped), or `Abort(reason, resume, notify_destination)`.
  Order: snapshot; if the next stage is the stop-and-copy one, suspend and snapshot again (the
  request may have decoded meanwhile); plan the stage; reserve it on the destination; copy;
  repeat until the final stage landed; commit; release.
  A request whose first snapshot finds it suspended already (held by its engine at its first
  token: a P/D handoff out of a prefill-only instance) goes straight to the stop-and-copy stage,
  with no `Suspend`.
- Opened before the prefill (`prefill_tokens` > 0: a P/D handoff opened at admission): the first
  snapshot may find the request waiting or prefilling; stage 0 is reserved at once whatever it
  copies (the destination reserves the blocks of `prefill_tokens` now, `Stage.expected_blocks`),
  then while the request prefills each snapshot with new full blocks gets a live stage and one
  without gets `Wait`; once it has its first token the session goes on as above (held: the
  stop-and-copy stage; decoding: live stages).
- A snapshot is checked before every stage: a finished request aborts `REQUEST_FINISHED`; one no
  longer decoding (waiting or prefilling again after stages landed: preempted) aborts
  `REQUEST_PREEMPTED`, before any stage `REQUEST_NOT_RUNNING`.
- `Abort.resume`: the request was suspended, so the driver resumes it if it is still there;
  `Abort.notify_destination`: the destination may hold blocks for this migration (every abort but
  a refusal of stage 0, which freed them already). After `Abort` or `Done` the session is over.
- `DestinationSession` holds one incoming migration's decisions: each stage's reservation is
  answered with the cached leading blocks shared (stage 0 only) and the rest reserved, or refused
  with everything this migration holds freed; a commit is accepted only for a state whose KV
  length fills exactly the blocks received, for the request the reservation was opened for.
  `AheadBlocks` holds the blocks a stage 0 with `expected_blocks` reserved for later stages: each
  stage takes its blocks from them first, in order, then fresh ones; a commit leaving any unfilled
  is refused.
- No I/O and no clock: the agents drive the sessions with asyncio (`migration.source`,
  `migration.destination`), the simulator with its virtual-clock event loop.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from migration.core.protocol import AbortReason
from migration.core.stages import (
    MigrationAborted,
    Phase,
    Stage,
    StageConfig,
    StagePlanner,
    blocks_for,
)


@dataclass(frozen=True, slots=True)
class RequestSnapshot:
    """The request on the source between two steps; `phase` None once finished or unknown."""

    phase: (
        str | None
    )  # "decoding", "prefilling", "waiting", "suspended" (`Request.migration_phase`)
    block_ids: Sequence[int] = ()
    num_kv_tokens: int = 0
    block_hashes: Sequence[int] = ()


# -- actions the source driver performs ----------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Snapshot:
    pass


@dataclass(frozen=True, slots=True)
class Suspend:
    pass


@dataclass(frozen=True, slots=True)
class Reserve:
    stage: Stage


@dataclass(frozen=True, slots=True)
class Copy:
    stage: Stage


@dataclass(frozen=True, slots=True)
class Commit:
    pass


@dataclass(frozen=True, slots=True)
class Release:
    pass


@dataclass(frozen=True, slots=True)
class Done:
    pass


@dataclass(frozen=True, slots=True)
class Wait:
    pass


@dataclass(frozen=True, slots=True)
class Abort:
    reason: AbortReason
    detail: str
    resume: bool
    notify_destination: bool


SourceAction = Snapshot | Suspend | Reserve | Copy | Commit | Release | Done | Wait | Abort


def _check_live(phase: str | None, planner: StagePlanner, prefilling: bool = False) -> None:
    if phase is None:
        raise MigrationAborted(AbortReason.REQUEST_FINISHED, "finished or aborted on the source")
    if prefilling and phase in ("waiting", "prefilling"):
        return
    expected = "suspended" if planner.phase is Phase.SUSPENDED else "decoding"
    if phase == expected:
        return
    if phase in ("waiting", "prefilling") and planner.stages:
        raise MigrationAborted(AbortReason.REQUEST_PREEMPTED, f"request is {phase} again")
    raise MigrationAborted(AbortReason.REQUEST_NOT_RUNNING, f"request is {phase}, not decoding")


class SourceSession:
    """One outgoing migration: feed it events, perform the action each returns."""

    def __init__(
        self,
        request_id: str,
        block_size: int,
        config: StageConfig | None = None,
        prefill_tokens: int = 0,
    ) -> None:
        self.request_id = request_id
        self.planner = StagePlanner(request_id, block_size, config or StageConfig(), prefill_tokens)
        self._stage: Stage | None = None
        self._resnapshot = False  # the next snapshot follows a suspension
        self._prefilling = prefill_tokens > 0  # opened before the first token, not there yet
        self.outcome: Done | Abort | None = None

    @property
    def finished(self) -> bool:
        return self.outcome is not None

    def start(self) -> SourceAction:
        return Snapshot()

    def on_snapshot(self, snapshot: RequestSnapshot) -> SourceAction:
        planner = self.planner
        try:
            if snapshot.phase in ("decoding", "suspended"):
                self._prefilling = False
            if (
                snapshot.phase == "suspended"
                and planner.phase is Phase.LIVE
                and (not planner.stages or planner.prefill_tokens > 0)
            ):
                planner.suspended()  # held at its first token: nothing can change it now
                self._resnapshot = True
            _check_live(snapshot.phase, planner, self._prefilling)
            if self._prefilling:
                if planner.stages and not planner.has_full_blocks_to_send(snapshot.num_kv_tokens):
                    planner.check_prefix(snapshot.block_ids, snapshot.num_kv_tokens)
                    return Wait()
            elif (
                not self._resnapshot
                and planner.phase is Phase.LIVE
                and planner.needs_suspend(snapshot.block_ids, snapshot.num_kv_tokens)
            ):
                return Suspend()
            self._resnapshot = False
            self._stage = planner.next_stage(
                snapshot.block_ids, snapshot.num_kv_tokens, snapshot.block_hashes
            )
        except MigrationAborted as e:
            return self.fail(e.reason, e.detail)
        return Reserve(self._stage)

    def on_suspended(self) -> SourceAction:
        self.planner.suspended()
        self._resnapshot = True
        return Snapshot()

    def on_reserved(
        self, accepted: bool, num_cached_blocks: int = 0, num_reserved: int = 0, reason: str = ""
    ) -> SourceAction:
        assert self._stage is not None, "no stage is being reserved"
        if not accepted:
            return self.fail(AbortReason.DST_REFUSED, reason)
        try:
            self._stage = self.planner.reserved(self._stage, num_cached_blocks, num_reserved)
        except MigrationAborted as e:
            return self.fail(e.reason, e.detail)
        return Copy(self._stage)

    def on_landed(self) -> SourceAction:
        stage = self._stage
        assert stage is not None, "no stage is being copied"
        self.planner.landed(stage)
        self._stage = None
        return Commit() if stage.final else Snapshot()

    def on_commit_answer(self, ok: bool, reason: str = "") -> SourceAction:
        if not ok:
            return self.fail(AbortReason.DST_FAILED, reason or "commit refused")
        return Release()

    def on_released(self) -> SourceAction:
        self.planner.committed()
        self.outcome = Done()
        return self.outcome

    def fail(self, reason: AbortReason, detail: str = "") -> Abort:
        """The migration cannot go on (a check above, or the driver's transport or engine)."""
        planner = self.planner
        resume = planner.abort(reason)
        notify = reason is not AbortReason.DST_REFUSED or bool(planner.stages)
        self.outcome = Abort(reason, detail, resume, notify)
        return self.outcome


# -- the destination side ------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class ReserveAnswer:
    accepted: bool
    shared_block_ids: tuple[int, ...] = ()
    reserved_block_ids: tuple[int, ...] = ()
    reason: str = ""


class DestinationSession:
    """One incoming migration's decisions (the driver holds the engine and the reservation)."""

    def __init__(self, request_id: str, block_size: int) -> None:
        self.request_id = request_id
        self.block_size = block_size

    @staticmethod
    def hashes_to_share(stage: int, num_blocks: int, block_hashes: Sequence[int]) -> list[int]:
        """The hashes whose cached blocks a stage shares: stage 0's leading full blocks."""
        return list(block_hashes[:num_blocks]) if stage == 0 else []

    @staticmethod
    def answer(
        num_blocks: int, shared: Sequence[int], reserved: Sequence[int] | None
    ) -> ReserveAnswer:
        """The reservation answer once the engine shared `shared` and reserved the rest
        (`reserved` None: no room; the driver then frees everything the migration holds)."""
        if reserved is None:
            need = num_blocks - len(shared)
            return ReserveAnswer(
                False, reason=f"no room for {need} blocks above the free-block watermark"
            )
        return ReserveAnswer(True, tuple(shared), tuple(reserved))

    def commit_refusal(
        self, request_id: str, num_computed_tokens: int, num_blocks: int
    ) -> str | None:
        """Why a commit of this state cannot be adopted on the `num_blocks` received, or None."""
        if (
            request_id != self.request_id
            or blocks_for(num_computed_tokens, self.block_size) != num_blocks
        ):
            return "the request state does not match the received blocks"
        return None


@dataclass(slots=True)
class AheadBlocks:
    """The blocks one incoming migration reserved ahead of its later stages, in the order they
    take them (a P/D handoff opened before its prefill: stage 0's ``expected_blocks``). The
    driver reserves the fresh blocks `to_reserve` names, under the migration (so freeing the
    migration frees these too), and hands them to `take`."""

    blocks: list[int] = field(default_factory=list)

    def to_reserve(
        self, stage: int, num_blocks: int, expected_blocks: int, num_shared: int
    ) -> int | None:
        """Fresh blocks to reserve for a stage of `num_blocks` whose first `num_shared` are
        shared (cached here): stage 0 reserves every expected block now; a later stage only what
        the blocks reserved ahead do not cover (None: it asks for none)."""
        if stage == 0:
            return max(0, max(num_blocks, expected_blocks) - num_shared)
        missing = max(0, num_blocks - num_shared) - len(self.blocks)
        return missing if missing > 0 else None

    def take(self, stage: int, num_blocks: int, num_shared: int, fresh: Sequence[int]) -> list[int]:
        """The stage's blocks past its shared ones: from the blocks reserved ahead, then
        `fresh`; stage 0 keeps the fresh blocks it does not use for the later stages."""
        want = max(0, num_blocks - num_shared)
        if stage == 0:
            self.blocks = list(fresh[want:])
            return list(fresh[:want])
        taken, self.blocks = self.blocks[:want], self.blocks[want:]
        return taken + list(fresh)

    def commit_refusal(self) -> str | None:
        """Why a commit cannot be accepted while blocks reserved ahead were never filled."""
        return (
            f"{len(self.blocks)} blocks reserved ahead were never filled" if self.blocks else None
        )
