"""What an engine must offer to be migratable, and the control messages two agents exchange.

Contract:
- `MigratableEngine` is the whole surface the migration drivers touch. The engine implements it;
  `migration` never imports the engine. Block ids are the engine's physical KV block ids; the KV
  of a request's first `n` tokens lives in `block_ids[: ceil(n / block_size)]`, and a block
  is immutable once full (the engine appends only into the last, still-filling block).
- `RequestState` carries everything a destination needs to continue a request bit-identically: its
  token ids (prompt then output), how many have KV, its sampling parameters and counter-based
  sampling seed, its stop conditions and accounting. It is plain JSON.
- Every control message is a slots dataclass with `to_json()` / `from_json()`; `from_json` validates
  types and raises `MessageError` naming the offending field, so bad input from the wire becomes an
  HTTP 400, never a crash.
- One migration is named by its `migration_id` on both sides; the destination keys its reservation
  by it.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, Self, TypeVar, runtime_checkable


class MessageError(ValueError):
    """A control message that does not parse; `param` names the offending field."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


class AbortReason(enum.Enum):
    """Why a migration did not commit. The value is what the API reports."""

    REQUEST_FINISHED = "request_finished"  # finished (stop/length) while migrating: nothing to move
    REQUEST_ABORTED = "request_aborted"  # the client went away
    REQUEST_PREEMPTED = "request_preempted"  # the source preempted it; its blocks are gone
    REQUEST_NOT_RUNNING = "request_not_running"  # unknown, waiting or already migrating
    DST_REFUSED = "dst_refused"  # the destination has no room (below its watermark) or is busy
    DST_FAILED = "dst_failed"  # the destination errored or did not answer in time
    TRANSFER_FAILED = "transfer_failed"  # a KV send or receive failed or timed out
    SRC_TIMEOUT = "src_timeout"  # destination side: the source went silent, reservation expired
    SRC_CANCELLED = "src_cancelled"  # destination side: the source asked to abort
    BUSY = "busy"  # the source already runs its maximum number of outgoing migrations


class MigrationStatus(enum.Enum):
    COMMITTED = "committed"
    ABORTED = "aborted"


# -- the engine's side ---------------------------------------------------------------------------


@dataclass(slots=True)
class RequestState:
    """A running request's complete state at the moment it stops on the source.

    The field names are the keys of `Request.to_state()` (plus the engine's ``emitted_text``)."""

    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    sampling_params: dict[str, Any]  # SamplingParams fields, by name
    sampling_seed: int  # counter-based sampling: draw i depends only on (seed, i)
    num_computed_tokens: int  # tokens whose KV is in the transferred blocks
    num_cached_tokens: int = 0
    num_preemptions: int = 0  # accounting: recomputes the request went through so far
    priority: int = 0
    cache_salt: str | None = None
    lora_name: str | None = None  # the LoRA adapter it runs with; a destination without it refuses
    arrival_time: float = 0.0
    eos_token_id: int | None = None
    emitted_text: str = ""  # text already streamed (stop-string progress)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def to_json(self) -> dict[str, Any]:
        # Shallow on purpose: `dataclasses.asdict` deep-copies every token id, which costs
        # milliseconds of downtime at 8k tokens.
        data = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        data["sampling_params"] = dict(self.sampling_params)
        return data

    @classmethod
    def from_json(cls, data: Any) -> RequestState:
        state = _parse(cls, data)
        if not state.prompt_token_ids:
            raise MessageError("prompt_token_ids must not be empty", "prompt_token_ids")
        if not 0 < state.num_computed_tokens < state.num_tokens:
            raise MessageError(
                "num_computed_tokens must leave at least one token to compute",
                "num_computed_tokens",
            )
        return state


@runtime_checkable
class MigratableEngine(Protocol):
    """The operations migration needs from one engine instance (source and destination roles).

    The drivers call them on the engine's own thread, between steps, so they never race a step.
    Reservations are held under an owner id (the migration id) until adopted or freed.
    """

    @property
    def block_size(self) -> int: ...

    @property
    def served_model(self) -> str | None:
        """The name fleets route this engine's model by (None: unnamed, never compared)."""
        ...

    def kv_bytes_per_block(self) -> int:
        """Bytes of KV one block holds (all layers, keys and values)."""
        ...

    # -- source role -----------------------------------------------------------------------------
    def request_phase(self, request_id: str) -> str | None:
        """ "decoding", "prefilling", "waiting", "suspended", or None once finished or unknown."""
        ...

    def request_blocks(self, request_id: str) -> tuple[list[int], int]:
        """(block ids, tokens whose KV is computed) of a live request; `KeyError` if gone."""
        ...

    def request_block_hashes(self, request_id: str) -> list[int]:
        """The chained hashes of the request's full blocks, in order (for cache-aware transfer)."""
        ...

    def request_lora(self, request_id: str) -> str | None:
        """The LoRA adapter a live request runs with (None: the base model, or unknown)."""
        ...

    def suspend(self, request_id: str) -> None:
        """Take a decoding request out of the batch, keeping its blocks (`ValueError` if not)."""
        ...

    def resume(self, request_id: str) -> None:
        """Put a suspended request back into the running batch (the migration aborted)."""
        ...

    def export_request_state(self, request_id: str) -> dict[str, Any]:
        """The state of a suspended request, as `RequestState` fields."""
        ...

    def release_migrated(self, request_id: str) -> None:
        """The destination committed: end the request here as migrated and free its blocks."""
        ...

    def kv_block_views(self) -> Sequence[Any]:
        """The KV cache as tensors indexed by block id on dim 0 (`migration.kv_copy`); the
        migration reads the source's rows and writes the destination's reserved rows in place,
        off the engine thread (full blocks never change, reserved ones are unused)."""
        ...

    # -- destination role ------------------------------------------------------------------------
    def serves_lora(self, name: str) -> bool:
        """Is LoRA adapter `name` resident here (may an adopted request run with it)?"""
        ...

    def share_cached_prefix(self, owner_id: str, block_hashes: Sequence[int]) -> list[int]:
        """Take a reference, under `owner_id`, on the longest leading run of `block_hashes` cached
        here; returns those block ids (eviction cannot take them until the owner lets go)."""
        ...

    def reserve_blocks(self, owner_id: str, num_blocks: int) -> list[int] | None:
        """Append `num_blocks` free blocks to `owner_id`'s table, or None below the watermark."""
        ...

    def free_reservation(self, owner_id: str) -> None:
        """Drop every block `owner_id` holds (shared ones lose one reference)."""
        ...

    def adopt_request(self, state: dict[str, Any], block_ids: Sequence[int], owner_id: str) -> Any:
        """Join the running batch with `state`, taking over `owner_id`'s blocks (`block_ids`, in
        order). Raises `ValueError` and changes nothing if the state does not fit the blocks."""
        ...


EngineCall = Callable[[Callable[[MigratableEngine], Any]], Awaitable[Any]]
"""Runs a function against the engine on the engine's thread and awaits its result."""


class DestinationLink(Protocol):
    """The source's view of one destination agent (HTTP in production; any transport will do).

    Each method raises `DestinationError` when the destination cannot be reached or answers
    nonsense."""

    async def reserve(self, msg: ReserveRequest) -> ReserveResponse: ...

    async def commit(self, msg: CommitRequest) -> AckResponse: ...

    async def abort(self, msg: AbortRequest) -> AckResponse: ...


class DestinationError(RuntimeError):
    """The destination did not answer, or answered something that is not a valid reply."""


# -- control messages over the agents' HTTP API --------------------------------------------------


class _Message:
    """A control message: `to_json` gives its fields as JSON, `from_json` parses and type-checks."""

    __slots__ = ()

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)  # type: ignore[call-overload]

    @classmethod
    def from_json(cls, data: Any) -> Self:
        return _parse(cls, data)


@dataclass(slots=True)
class MigrateOrder(_Message):
    """`POST /kvherd/v1/migrate` on the source agent."""

    request_id: str
    dst: str  # destination agent's base URL, e.g. http://127.0.0.1:8001

    @classmethod
    def from_json(cls, data: Any) -> MigrateOrder:
        order = _parse(cls, data)
        if not order.request_id:
            raise MessageError("request_id must be a non-empty string", "request_id")
        if not order.dst.startswith(("http://", "https://")):
            raise MessageError("dst must be an http(s) URL of the destination agent", "dst")
        return order


@dataclass(slots=True)
class TransportEndpoint:
    """Where the destination's rendezvous store listens, and the pair's group name."""

    host: str
    port: int
    group: str  # unique per (source, destination, destination incarnation)
    tag: int  # distinguishes concurrent migrations over the same pair group
    backend: str = "gloo"
    chunk_bytes: int = 16 << 20  # both ends must split payloads alike: the destination decides


@dataclass(slots=True)
class ReserveRequest(_Message):
    """Before each stage: reserve room for `num_blocks` blocks of `request_id` on the destination.

    On the first stage (`stage == 0`) `block_hashes` lists the request's full-block hashes so the
    destination can share the leading ones it already caches instead of receiving them."""

    migration_id: str
    request_id: str
    src: str
    stage: int
    num_blocks: int
    block_hashes: list[int] = field(default_factory=list)
    # Stage 0: the source's KV geometry; the destination refuses a mismatch.
    block_size: int = 0
    kv_bytes_per_block: int = 0
    # Stage 0 of a P/D handoff opened before its prefill: the blocks the request will hold at its
    # first token, all reserved (or shared) now; later stages take theirs from them.
    expected_blocks: int = 0
    # Stage 0: the model (its served name) and LoRA adapter the request runs with; a destination
    # serving another model, or without the adapter, refuses before any KV is copied.
    model: str | None = None
    lora_name: str | None = None

    @classmethod
    def from_json(cls, data: Any) -> ReserveRequest:
        msg = _parse(cls, data)
        if not msg.migration_id:
            raise MessageError("migration_id must be a non-empty string", "migration_id")
        if msg.stage < 0:
            raise MessageError("stage must be non-negative", "stage")
        if msg.num_blocks < 0:
            raise MessageError("num_blocks must be non-negative", "num_blocks")
        if msg.expected_blocks < 0:
            raise MessageError("expected_blocks must be non-negative", "expected_blocks")
        if any(h < 0 or h >= 1 << 64 for h in msg.block_hashes):
            raise MessageError("block_hashes must be unsigned 64-bit integers", "block_hashes")
        return msg


@dataclass(slots=True)
class ReserveResponse(_Message):
    accepted: bool
    dst_block_ids: list[int] = field(default_factory=list)  # where this stage's blocks go
    num_cached_blocks: int = 0  # stage 0: leading blocks shared from the destination's cache
    transport: TransportEndpoint | None = None  # stage 0: where to rendezvous for the KV bytes
    reason: str | None = None


@dataclass(slots=True)
class CommitRequest(_Message):
    migration_id: str
    state: RequestState

    def to_json(self) -> dict[str, Any]:
        return {"migration_id": self.migration_id, "state": self.state.to_json()}


@dataclass(slots=True)
class AbortRequest(_Message):
    migration_id: str
    reason: str


@dataclass(slots=True)
class AckResponse(_Message):
    """Answer to commit and abort: `ok` false carries the reason."""

    ok: bool
    reason: str | None = None


@dataclass(slots=True)
class MigrationOutcome(_Message):
    """What `POST /kvherd/v1/migrate` returns."""

    migration_id: str
    request_id: str
    status: MigrationStatus
    reason: AbortReason | None = None
    detail: str | None = None
    stages: int = 0  # live stages plus the stop-and-copy stage
    blocks_sent: int = 0
    final_blocks: int = 0  # of them, sent by the stop-and-copy stage (inside the downtime)
    blocks_skipped: int = 0  # shared from the destination's prefix cache, not sent
    bytes_sent: int = 0
    bytes_skipped: int = 0
    downtime_s: float = 0.0  # suspended on the source until committed (or resumed)
    duration_s: float = 0.0

    def to_json(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["status"] = self.status.value
        data["reason"] = self.reason.value if self.reason else None
        return data


# -- parsing -------------------------------------------------------------------------------------

_T = TypeVar("_T")
_NESTED: dict[str, type] = {
    "state": RequestState,
    "transport": TransportEndpoint,
}
_ENUMS: dict[str, type[enum.Enum]] = {"status": MigrationStatus, "reason": AbortReason}
_INT_LISTS = {"prompt_token_ids", "output_token_ids", "block_hashes", "dst_block_ids"}


def _parse(cls: type[_T], data: Any) -> _T:
    """Build dataclass `cls` from a JSON object, checking each field's type."""
    if not isinstance(data, Mapping):
        raise MessageError(f"{cls.__name__} must be a JSON object")
    hints = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    unknown = set(data) - set(hints)
    if unknown:
        raise MessageError(f"unknown field {sorted(unknown)[0]!r}", sorted(unknown)[0])
    kwargs: dict[str, Any] = {}
    for name, f in hints.items():
        if name not in data:
            required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
            if required:
                raise MessageError(f"missing field {name!r}", name)
            continue
        kwargs[name] = _convert(cls, name, str(f.type), data[name])
    return cls(**kwargs)


def _convert(cls: type, name: str, annotation: str, value: Any) -> Any:
    optional = "None" in annotation
    if value is None:
        if optional:
            return None
        raise MessageError(f"{name} must not be null", name)
    if (name == "reason" and cls is MigrationOutcome) or name == "status":
        try:
            return _ENUMS[name](value)
        except ValueError:
            raise MessageError(f"invalid {name} {value!r}", name) from None
    if name in _NESTED:
        return RequestState.from_json(value) if name == "state" else _parse(_NESTED[name], value)
    if name in _INT_LISTS:
        # type() first: this runs over every token id of a request, inside the downtime.
        if not isinstance(value, list) or not all(type(v) is int or _is_int(v) for v in value):
            raise MessageError(f"{name} must be a list of integers", name)
        return list(value)
    base = annotation.replace(" | None", "")
    if base == "int" and not _is_int(value):
        raise MessageError(f"{name} must be an integer", name)
    if base == "float" and not (_is_int(value) or isinstance(value, float)):
        raise MessageError(f"{name} must be a number", name)
    if base == "str" and not isinstance(value, str):
        raise MessageError(f"{name} must be a string", name)
    if base == "bool" and not isinstance(value, bool):
        raise MessageError(f"{name} must be a boolean", name)
    if base.startswith("dict") and not isinstance(value, dict):
        raise MessageError(f"{name} must be an object", name)
    return float(value) if base == "float" else value


def _is_int(value: Any) -> bool:
    return type(value) is int or (isinstance(value, int) and not isinstance(value, bool))
