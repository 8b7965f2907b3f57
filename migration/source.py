"""The source side of live migration: run one request's multi-stage copy and commit, or abort.

Contract:
- `migrate_out` drives a `migration.core.session.SourceSession` (the order of every check and
  step, shared with the simulator) against the engine (through `call`, on the engine thread)
  and one destination (`DestinationLink` for control, a `TransportHub` channel for KV bytes). Live
  stages copy full blocks while the request keeps decoding; the stop-and-copy stage suspends it,
  copies the rest and commits; only then is the request released here.
- Opened before the prefill (`PrefillOpening`, a P/D handoff as its request is admitted): stage 0
  is reserved at once, before any engine call (so the engine's first prefill step cannot delay
  it), from the prompt's block hashes: the destination reserves the prompt's blocks now and
  shares those it caches. Then live stages copy the full blocks each prefill chunk computes,
  polled between engine steps (`Wait`), and `before_final` (if given) is awaited before the
  stop-and-copy stage is reserved.
- It never raises for a migration that fails: it returns a `MigrationOutcome` saying why. On every
  abort path the request is left running on the source (resumed if it was suspended, untouched if
  it finished or was preempted meanwhile) and the destination is told to free its reservation
  (best effort: if the destination is unreachable it frees on its own after its timeout).
- Downtime is measured from the suspension to the commit (or to the resume, on abort): the time
  the request makes no progress (for a request its engine held at its first token, from the
  first snapshot that found it suspended).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from migration.core.protocol import (
    AbortReason,
    AbortRequest,
    CommitRequest,
    DestinationError,
    DestinationLink,
    EngineCall,
    MigratableEngine,
    MigrationOutcome,
    MigrationStatus,
    RequestState,
    ReserveRequest,
    TransportEndpoint,
)
from migration.core.session import (
    Abort,
    Commit,
    Copy,
    Done,
    Release,
    RequestSnapshot,
    Reserve,
    Snapshot,
    SourceAction,
    SourceSession,
    Suspend,
    Wait,
)
from migration.core.stages import StageConfig, StagePlanner
from migration.kv_copy import send_blocks
from migration.transport import PairChannel, TransferError, TransportHub

# How long a session opened before the prefill waits before looking at the request again (the
# snapshot itself then waits for the engine's step in progress).
PREFILL_POLL_S = 0.002


@dataclass(frozen=True, slots=True)
class PrefillOpening:
    """A migration opened as its request is admitted, before its prefill (a P/D handoff)."""

    num_tokens: int  # KV the prefill leaves at the first token (the prompt)
    block_hashes: Sequence[int]  # the prompt's full-block hash chain
    block_size: int  # this engine's KV geometry (read once: no engine call before stage 0)
    kv_bytes_per_block: int
    model: str | None = None  # this engine's served model name
    lora_name: str | None = None  # the LoRA adapter the request runs with


def _snapshot(request_id: str) -> Any:
    def read(engine: MigratableEngine) -> RequestSnapshot:
        phase = engine.request_phase(request_id)
        if phase is None:
            return RequestSnapshot(None)
        blocks, num_kv = engine.request_blocks(request_id)
        return RequestSnapshot(phase, blocks, num_kv, engine.request_block_hashes(request_id))

    return read


def _views_and_snapshot(request_id: str) -> Any:
    # One engine call, so the snapshot sees the step that ends as the views are read.
    read = _snapshot(request_id)
    return lambda engine: (engine.kv_block_views(), read(engine))


async def migrate_out(
    call: EngineCall,
    hub: TransportHub,
    link: DestinationLink,
    request_id: str,
    src: str,
    config: StageConfig | None = None,
    on_released: Callable[[RequestState], None] | None = None,
    opening: PrefillOpening | None = None,
    before_final: Callable[[], Awaitable[None]] | None = None,
) -> MigrationOutcome:
    """Migrate `request_id` to the destination behind `link`; `src` names this instance (its
    transport peer identity, unique per incarnation). `on_released(state)` runs on the engine
    thread in the same step as the release (e.g. to end the request's stream here with a
    "continues on dst from token len(state.output_token_ids)" notice)."""
    migration_id = uuid.uuid4().hex
    started = time.perf_counter()
    views: Any = None
    action: SourceAction
    if opening is None:
        block_size, bytes_per_block, views, model, lora_name = await call(
            lambda e: (
                e.block_size,
                e.kv_bytes_per_block(),
                e.kv_block_views(),
                e.served_model,
                e.request_lora(request_id),
            )
        )
        session = SourceSession(request_id, block_size, config)
        action = session.start()
    else:
        block_size, bytes_per_block = opening.block_size, opening.kv_bytes_per_block
        model, lora_name = opening.model, opening.lora_name
        session = SourceSession(request_id, block_size, config, opening.num_tokens)
        # As admitted: nothing computed yet (what the engine computed since, the next snapshot
        # sees), so stage 0 copies nothing and reserves the whole prompt.
        action = session.on_snapshot(RequestSnapshot("waiting", (), 0, opening.block_hashes))
    channel: PairChannel | None = None
    endpoint: TransportEndpoint | None = None
    suspended_at: float | None = None
    state: RequestState | None = None
    while not isinstance(action, Done | Abort):
        try:
            match action:
                case Snapshot():
                    if views is None:  # opened before the prefill: its first engine call
                        views, snapshot = await call(_views_and_snapshot(request_id))
                    else:
                        snapshot = await call(_snapshot(request_id))
                    if snapshot.phase == "suspended" and suspended_at is None:
                        suspended_at = time.perf_counter()  # held at its first token (P/D)
                    action = session.on_snapshot(snapshot)
                case Suspend():
                    await call(lambda e: e.suspend(request_id))
                    suspended_at = time.perf_counter()
                    action = session.on_suspended()
                case Wait():
                    await asyncio.sleep(PREFILL_POLL_S)
                    action = Snapshot()
                case Reserve(stage=stage):
                    if stage.final and before_final is not None:
                        await before_final()
                    answer = await link.reserve(
                        ReserveRequest(
                            migration_id=migration_id,
                            request_id=request_id,
                            src=src,
                            stage=stage.index,
                            num_blocks=stage.num_blocks,
                            block_hashes=list(stage.block_hashes),
                            block_size=block_size,
                            kv_bytes_per_block=bytes_per_block,
                            expected_blocks=stage.expected_blocks,
                            model=model if stage.index == 0 else None,
                            lora_name=lora_name if stage.index == 0 else None,
                        )
                    )
                    action = session.on_reserved(
                        answer.accepted,
                        answer.num_cached_blocks,
                        len(answer.dst_block_ids),
                        answer.reason or "",
                    )
                    if isinstance(action, Copy) and stage.index == 0:
                        if answer.transport is None:
                            action = session.fail(AbortReason.DST_FAILED, "no transport endpoint")
                        else:
                            endpoint = answer.transport
                            channel = await asyncio.to_thread(hub.connect, endpoint)
                case Copy(stage=stage):
                    if stage.num_blocks:
                        assert channel is not None and endpoint is not None
                        ids = list(stage.src_block_ids)
                        await asyncio.to_thread(send_blocks, channel, views, ids, endpoint.tag)
                    action = session.on_landed()
                case Commit():
                    state = RequestState.from_json(
                        await call(lambda e: e.export_request_state(request_id))
                    )
                    ack = await link.commit(CommitRequest(migration_id, state))
                    action = session.on_commit_answer(ack.ok, ack.reason or "")
                case Release():
                    assert state is not None
                    await call(_releaser(state, on_released))
                    action = session.on_released()
        except TransferError as e:
            action = session.fail(AbortReason.TRANSFER_FAILED, str(e))
            if channel is not None:
                hub.drop(channel)
        except DestinationError as e:
            action = session.fail(AbortReason.DST_FAILED, str(e))
        except (KeyError, ValueError) as e:  # the engine refused: the request changed under us
            action = session.fail(AbortReason.REQUEST_FINISHED, f"engine: {e}")
    if isinstance(action, Done):
        return _outcome(session.planner, migration_id, bytes_per_block, started, suspended_at)
    if action.resume:
        await call(_resume_if_suspended(request_id))
    if action.notify_destination:
        # The destination may hold blocks for us; a refusal at stage 0 already freed them.
        # If unreachable, it frees on its own once we stay silent past its timeout.
        with contextlib.suppress(DestinationError):
            await link.abort(AbortRequest(migration_id, action.reason.value))
    return _outcome(
        session.planner,
        migration_id,
        bytes_per_block,
        started,
        suspended_at,
        action.reason,
        action.detail,
    )


def _releaser(state: RequestState, on_released: Callable[[RequestState], None] | None) -> Any:
    def release(engine: MigratableEngine) -> None:
        engine.release_migrated(state.request_id)
        if on_released is not None:
            on_released(state)

    return release


def _resume_if_suspended(request_id: str) -> Any:
    def resume(engine: MigratableEngine) -> None:
        if engine.request_phase(request_id) == "suspended":
            engine.resume(request_id)

    return resume


def _outcome(
    planner: StagePlanner,
    migration_id: str,
    bytes_per_block: int,
    started: float,
    suspended_at: float | None,
    reason: AbortReason | None = None,
    detail: str = "",
) -> MigrationOutcome:
    now = time.perf_counter()
    return MigrationOutcome(
        migration_id=migration_id,
        request_id=planner.request_id,
        status=MigrationStatus.ABORTED if reason else MigrationStatus.COMMITTED,
        reason=reason,
        detail=detail or None,
        stages=len(planner.stages),
        blocks_sent=planner.blocks_sent,
        final_blocks=sum(s.num_blocks for s in planner.stages if s.final),
        blocks_skipped=planner.num_shared_blocks,
        bytes_sent=planner.blocks_sent * bytes_per_block,
        bytes_skipped=planner.num_shared_blocks * bytes_per_block,
        downtime_s=now - suspended_at if suspended_at is not None else 0.0,
        duration_s=now - started,
    )
