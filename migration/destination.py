"""The destination side of live migration: reserve, receive, commit or abort, and expire.

Contract:
- The protocol's steps (which hashes to share, what to reserve, the answer, whether a commit
  fits) are `migration.core.destination.DestinationProtocol`'s, driven here and by the simulator;
  this module adds the wire, the engine thread, the transport and the reservation table.
- `reserve` answers each stage: stage 0 checks the KV geometry and that the request's model and
  LoRA adapter are served here, opens a reservation (refused when busy), shares the cached leading blocks by
  reference, reserves the rest and offers a transport endpoint; every stage then receives its
  blocks' KV in the background and writes it into the reserved blocks. The next message for the
  migration waits for that receive first.
- A stage 0 with `expected_blocks` (a P/D handoff opened before its prefill) reserves that many
  blocks at once (less the cached ones shared); each stage then takes its blocks from them, in
  order, and reserves only what they lack. A commit that leaves some of them unfilled is refused.
- A refusal or failure at any stage frees everything the migration held here before answering, so
  the source can simply continue; `commit` adopts the request with exactly the blocks received, in
  order; `abort` frees them. Either is answered for an unknown migration too (idempotent).
- KV lands directly in the reserved blocks (`migration.kv_copy`), so a reservation is freed only
  after its receive in flight has ended: an abort never frees blocks that bytes may still reach.
- `expire()` frees reservations whose source has gone silent for the table's timeout (a dead
  source); the agent calls it periodically (`run_expiry`).
- All engine calls go through `call` (the engine thread); the table is touched only from the
  asyncio thread.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

from migration.core.destination import (
    Accept,
    DestinationProtocol,
    Refuse,
    ReserveAction,
    ReserveBlocks,
    ShareCached,
)
from migration.core.protocol import (
    AbortReason,
    AbortRequest,
    AckResponse,
    CommitRequest,
    EngineCall,
    ReserveRequest,
    ReserveResponse,
)
from migration.core.reservations import Reservation, ReservationError, ReservationTable
from migration.kv_copy import recv_blocks
from migration.transport import TransferError, TransportHub

log = logging.getLogger(__name__)


class MigrationDestination:
    def __init__(
        self,
        call: EngineCall,
        hub: TransportHub,
        table: ReservationTable,
        block_size: int,
        kv_bytes_per_block: int,
        clock: Callable[[], float] = time.monotonic,
        model: str | None = None,
    ) -> None:
        self.call = call
        self.hub = hub
        self.table = table
        self.block_size = block_size
        self.kv_bytes_per_block = kv_bytes_per_block
        self.model = model  # the served model name (None: not compared)
        self.clock = clock
        self._receiving: dict[str, asyncio.Task[None]] = {}
        self._tags: dict[str, tuple[str, int]] = {}  # migration -> (pair group, message tag)
        self._views: Sequence[Any] | None = None  # the engine's KV cache, by block id
        self._landing: set[str] = set()  # migrations whose bytes are being received right now
        # Each open migration's protocol steps; blocks it reserves ahead for later stages
        # (`expected_blocks`) are held under the migration id, so freeing it frees them.
        self._sessions: dict[str, DestinationProtocol] = {}
        self.committed = 0
        self.aborted: dict[str, int] = {}  # reason -> count

    # -- messages --------------------------------------------------------------------------------
    async def reserve(self, msg: ReserveRequest) -> ReserveResponse:
        mid = msg.migration_id
        if msg.stage == 0:
            refusal = self._check_geometry(msg)
            lora = msg.lora_name
            if (
                refusal is None
                and lora is not None
                and not await self.call(lambda e: e.serves_lora(lora))
            ):
                refusal = f"this instance does not serve the request's LoRA adapter {lora!r}"
            if refusal is not None:
                return ReserveResponse(False, reason=refusal)
            try:
                self.table.open(mid, msg.request_id, msg.src, self.clock())
            except ReservationError as e:
                return ReserveResponse(False, reason=str(e))
            session = self._sessions[mid] = DestinationProtocol(
                msg.request_id, self.block_size, self.clock()
            )
        else:
            reservation = self.table.get(mid)
            if reservation is None:
                return ReserveResponse(False, reason=f"no open migration {mid!r}")
            failure = await self._wait_landed(reservation)
            if failure is not None:
                await self._drop(mid, AbortReason.TRANSFER_FAILED)
                return ReserveResponse(False, reason=failure)
            session = self._sessions[mid]
        action: ReserveAction = session.on_reserve(
            msg.stage, msg.num_blocks, msg.expected_blocks, msg.block_hashes, self.clock()
        )
        while not isinstance(action, Accept):
            match action:
                case ShareCached(hashes):
                    found = await self.call(lambda e: e.share_cached_prefix(mid, list(hashes)))
                    action = session.on_shared(found)
                case ReserveBlocks(count):
                    action = session.on_reserved(
                        await self.call(lambda e: e.reserve_blocks(mid, count))
                    )
                case Refuse(reason, detail):
                    await self._drop(mid, reason)
                    return ReserveResponse(False, reason=detail)
        shared, reserved = list(action.shared_block_ids), list(action.reserved_block_ids)
        try:
            reservation = self.table.begin_stage(mid, msg.stage, shared, reserved, self.clock())
        except ReservationError as e:
            await self._drop(mid, AbortReason.DST_FAILED)
            return ReserveResponse(False, reason=str(e))
        endpoint = None
        if msg.stage == 0:
            endpoint = self.hub.offer(msg.src)
            self._tags[mid] = (endpoint.group, endpoint.tag)
        task = asyncio.create_task(self._receive(reservation))
        task.add_done_callback(_retrieve)
        self._receiving[mid] = task
        return ReserveResponse(True, reserved, len(shared), endpoint)

    async def commit(self, msg: CommitRequest) -> AckResponse:
        mid = msg.migration_id
        reservation = self.table.get(mid)
        if reservation is None:
            return AckResponse(False, f"no open migration {mid!r} (expired or aborted)")
        failure = await self._wait_landed(reservation)
        if failure is not None:
            await self._drop(mid, AbortReason.TRANSFER_FAILED)
            return AckResponse(False, failure)
        state = msg.state
        block_ids = reservation.block_ids
        answer = self._sessions[mid].on_commit(
            state.request_id, state.num_computed_tokens, len(block_ids), self.clock()
        )
        if isinstance(answer, Refuse):
            await self._drop(mid, answer.reason)
            return AckResponse(False, answer.detail)
        # Popped before adopting: once the engine owns the blocks, an expiry must not free them.
        self.table.pop(mid)
        self._forget(mid)
        try:
            await self._adopt_on_engine(state.to_json(), block_ids, mid)
        except (ValueError, KeyError) as e:
            await self.call(lambda e: e.free_reservation(mid))
            self._count(AbortReason.DST_FAILED)
            return AckResponse(False, f"cannot adopt the request: {e}")
        self.committed += 1
        return AckResponse(True)

    async def abort(self, msg: AbortRequest) -> AckResponse:
        session = self._sessions.get(msg.migration_id)
        if session is not None:  # none: unknown, already freed (answered all the same)
            await self._drop(msg.migration_id, session.on_abort().reason)
        return AckResponse(True)

    # -- expiry ----------------------------------------------------------------------------------
    async def expire(self) -> list[str]:
        """Free every reservation whose source went silent; returns their migration ids."""
        now = self.clock()
        stale = [
            r for r in self.table if now - r.last_seen > self.table.timeout_s and not self._busy(r)
        ]
        for reservation in stale:
            log.warning(
                "migration %s of %s from %s: source silent, freeing %d blocks",
                reservation.migration_id,
                reservation.request_id,
                reservation.src,
                len(reservation.block_ids),
            )
            await self._drop(reservation.migration_id, AbortReason.SRC_TIMEOUT)
        return [r.migration_id for r in stale]

    async def run_expiry(self, interval_s: float | None = None) -> None:
        """Expire stale reservations forever (cancel the task to stop)."""
        interval = interval_s if interval_s is not None else self.table.timeout_s / 4
        while True:
            await asyncio.sleep(interval)
            try:
                await self.expire()
            except Exception:  # the loop must outlive one bad round (e.g. engine shutting down)
                log.exception("migration reservation expiry failed")

    async def close(self) -> None:
        """Free every open reservation (agent shutdown)."""
        for reservation in self.table:
            await self._drop(reservation.migration_id, AbortReason.DST_FAILED)

    # -- internals -------------------------------------------------------------------------------
    async def _adopt_on_engine(
        self, state: dict[str, Any], block_ids: list[int], owner_id: str
    ) -> Any:
        # The engine runs the adopted request with no client; the agent's engine loop buffers
        # its outputs until a follower attaches (`EngineLoop.attach`).
        return await self.call(lambda e: e.adopt_request(state, block_ids, owner_id))

    def _check_geometry(self, msg: ReserveRequest) -> str | None:
        if msg.block_size != self.block_size:
            return f"block size {msg.block_size} differs from this instance's {self.block_size}"
        if msg.model is not None and self.model is not None and msg.model != self.model:
            return f"the request runs on model {msg.model!r}; this instance serves {self.model!r}"
        if msg.kv_bytes_per_block != self.kv_bytes_per_block:
            return (
                f"KV of {msg.kv_bytes_per_block} bytes per block differs from this instance's "
                f"{self.kv_bytes_per_block} (different model or dtype)"
            )
        return None

    def _busy(self, reservation: Reservation) -> bool:
        task = self._receiving.get(reservation.migration_id)
        return task is not None and not task.done()

    async def _receive(self, reservation: Reservation) -> None:
        """Receive the stage in flight straight into its reserved blocks."""
        mid = reservation.migration_id
        block_ids = list(reservation.pending_block_ids)
        if block_ids:
            if self._views is None:
                self._views = await self.call(lambda e: e.kv_block_views())
            group, tag = self._tags[mid]
            channel = await asyncio.to_thread(self.hub.accepted, reservation.src, group)
            if self.table.get(mid) is not reservation:
                return  # aborted while the source was joining: its blocks may be gone already
            self._landing.add(mid)
            try:
                await asyncio.to_thread(recv_blocks, channel, self._views, block_ids, tag)
            except TransferError:
                self.hub.drop(channel)
                raise
            finally:
                self._landing.discard(mid)
        if self.table.get(mid) is reservation:
            self.table.landed(mid, self.clock())

    async def _wait_landed(self, reservation: Reservation) -> str | None:
        """Wait for the stage in flight; returns why it failed, or None."""
        task = self._receiving.get(reservation.migration_id)
        if task is None:
            return None
        try:
            await asyncio.shield(task)
        except TransferError as e:
            return f"receiving the KV failed: {e}"
        except Exception as e:
            log.exception("migration %s: receive failed", reservation.migration_id)
            return f"receiving the KV failed: {e!r}"
        return None

    async def _drop(self, migration_id: str, reason: AbortReason) -> None:
        reservation = self.table.pop(migration_id)
        receiving = self._receiving.get(migration_id)
        self._forget(migration_id)
        if reservation is None:
            return
        self._count(reason)
        if receiving is not None and migration_id in self._landing:
            # Bytes land in the reserved blocks directly: they are freed only once the receive
            # is over (it ends by itself within the transfer timeout when the source stops).
            await asyncio.wait([receiving])
        await self.call(lambda e: e.free_reservation(migration_id))

    def _forget(self, migration_id: str) -> None:
        # A receive still in flight finishes on its own and drops its bytes (see `_receive`).
        self._tags.pop(migration_id, None)
        self._receiving.pop(migration_id, None)
        self._sessions.pop(migration_id, None)

    def _count(self, reason: AbortReason) -> None:
        self.aborted[reason.value] = self.aborted.get(reason.value, 0) + 1


def _retrieve(task: asyncio.Task[None]) -> None:
    """Mark a receive's failure as seen: it is reported through `_wait_landed`, or moot."""
    if not task.cancelled():
        task.exception()
