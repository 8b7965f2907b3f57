"""The destination side's bookkeeping of incoming migrations: which blocks each one holds.

Contract:
- A reservation is opened by a migration's stage 0 and holds, in the request's block order, the
  blocks shared from this instance's prefix cache, the blocks whose KV has landed, and the blocks
  reserved for the stage in flight. Those are exactly the blocks the destination must free on abort,
  or hand to the adopted request on commit: `pop` returns them once and forgets the reservation.
- Stages arrive in order (0, 1, 2, ...); anything else is a protocol error (`ReservationError`).
- At most `max_incoming` migrations are open at once (Llumnix: one in, one out per instance by
  default); more are refused, as is a second migration of a request already coming in.
- The source may die at any point. A reservation not touched for `timeout_s` is expired by `expire`,
  which returns it (popped) so the caller frees its blocks: nothing leaks.
- Pure: no clock of its own (callers pass `now`), no block manager (callers free and adopt).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field


class ReservationError(Exception):
    """A reservation request this destination refuses or does not understand."""


@dataclass(slots=True)
class Reservation:
    migration_id: str
    request_id: str
    src: str
    last_seen: float
    next_stage: int = 0
    shared_block_ids: list[int] = field(default_factory=list)
    landed_block_ids: list[int] = field(default_factory=list)
    pending_block_ids: list[int] = field(default_factory=list)

    @property
    def block_ids(self) -> list[int]:
        """Every block this reservation holds, in the request's block order."""
        return self.shared_block_ids + self.landed_block_ids + self.pending_block_ids

    @property
    def stage_in_flight(self) -> bool:
        return bool(self.pending_block_ids)


class ReservationTable:
    def __init__(self, max_incoming: int = 1, timeout_s: float = 30.0) -> None:
        if max_incoming < 1:
            raise ValueError("max_incoming must be at least 1")
        if timeout_s <= 0:
            raise ValueError("timeout_s must be positive")
        self.max_incoming = max_incoming
        self.timeout_s = timeout_s
        self._by_id: dict[str, Reservation] = {}

    def __len__(self) -> int:
        return len(self._by_id)

    def __iter__(self) -> Iterator[Reservation]:
        return iter(list(self._by_id.values()))

    def get(self, migration_id: str) -> Reservation | None:
        return self._by_id.get(migration_id)

    def has_request(self, request_id: str) -> bool:
        return any(r.request_id == request_id for r in self._by_id.values())

    def open(self, migration_id: str, request_id: str, src: str, now: float) -> Reservation:
        """Stage 0 of a new migration."""
        if migration_id in self._by_id:
            raise ReservationError(f"migration {migration_id!r} is already open")
        if self.has_request(request_id):
            raise ReservationError(f"request {request_id!r} is already migrating in")
        if len(self._by_id) >= self.max_incoming:
            raise ReservationError(
                f"busy: {len(self._by_id)} incoming migration(s), at most {self.max_incoming}"
            )
        reservation = Reservation(migration_id, request_id, src, last_seen=now)
        self._by_id[migration_id] = reservation
        return reservation

    def begin_stage(
        self,
        migration_id: str,
        stage: int,
        shared_block_ids: Sequence[int],
        reserved_block_ids: Sequence[int],
        now: float,
    ) -> Reservation:
        """Record the blocks taken for `stage` (shared ones only in stage 0)."""
        reservation = self._expect(migration_id, stage)
        if reservation.stage_in_flight:
            raise ReservationError(f"stage {stage - 1} of {migration_id!r} has not landed")
        if shared_block_ids and stage != 0:
            raise ReservationError("only stage 0 shares cached blocks")
        reservation.shared_block_ids.extend(shared_block_ids)
        reservation.pending_block_ids = list(reserved_block_ids)
        reservation.next_stage = stage + 1
        reservation.last_seen = now
        return reservation

    def landed(self, migration_id: str, now: float) -> Reservation:
        """The KV of the stage in flight is written."""
        reservation = self._require(migration_id)
        reservation.landed_block_ids.extend(reservation.pending_block_ids)
        reservation.pending_block_ids = []
        reservation.last_seen = now
        return reservation

    def touch(self, migration_id: str, now: float) -> None:
        self._require(migration_id).last_seen = now

    def pop(self, migration_id: str) -> Reservation | None:
        """Forget a reservation (commit or abort); the caller adopts or frees its `block_ids`."""
        return self._by_id.pop(migration_id, None)

    def expire(self, now: float) -> list[Reservation]:
        """Pop every reservation whose source has been silent for `timeout_s`."""
        stale = [r for r in self._by_id.values() if now - r.last_seen > self.timeout_s]
        for reservation in stale:
            del self._by_id[reservation.migration_id]
        return stale

    def held_block_ids(self) -> list[int]:
        return [b for r in self._by_id.values() for b in r.block_ids]

    def _require(self, migration_id: str) -> Reservation:
        reservation = self._by_id.get(migration_id)
        if reservation is None:
            raise ReservationError(f"no open migration {migration_id!r}")
        return reservation

    def _expect(self, migration_id: str, stage: int) -> Reservation:
        reservation = self._require(migration_id)
        if stage != reservation.next_stage:
            raise ReservationError(
                f"migration {migration_id!r}: expected stage {reservation.next_stage}, got {stage}"
            )
        return reservation
