"""KV cache events and their wire encoding, compatible with vLLM's `kv_events` format.

Contract:
- Three events describe how an instance's prefix cache changes: `BlockStored` (a run of consecutive full
  blocks became reusable), `BlockRemoved` (blocks were evicted), `AllBlocksCleared`.
- Events travel in batches `KVEventBatch(seq, ts, events)`; `seq` increases by one per batch per
  instance, so a consumer that sees a gap knows it missed batches and can ask for a replay.
- `encode_batch` / `decode_batch` produce and read the msgpack payload vLLM's ZMQ publisher sends:
  an EventBatch is the array ``[ts, [event, ...], dp_rank]`` (dp_rank omitted when None) and each
  event is a tagged array ``["BlockStored", block_hashes, parent_block_hash, token_ids, block_size,
  lora_id, medium]``, ``["BlockRemoved", block_hashes, medium]`` or ``["AllBlocksCleared"]``.
  The sequence number is not in the payload: it is its own 8-byte big-endian ZMQ frame.
- Decoding also reads the map form newer vLLM releases send for events
  (``{"type": "BlockStored", "block_hashes": ..., ...}`` inside the same positional batch), ignores the
  fields newer versions append (extra trailing items or unknown keys), and accepts block hashes sent as
  bytes (converted to ints, big-endian, as vLLM's consumers do).
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field
from typing import Any

import msgpack


class BlockStored:
    """A run of consecutive full blocks became reusable.

    `token_ids` may be given as a uint32 `array` (how the engine holds a request's tokens): it
    becomes the list it reads as on first access. An engine stores every block it computes, a
    prompt's thousands of tokens at a time, and most consumers never read them (the router
    trusts engine hashes; the simulator's index does too), so a list of int objects built per
    event was most of what storing a block cost. Mutable, like the other events, though nobody
    changes an event once it is out.
    """

    __slots__ = (
        "_token_ids",
        "block_hashes",
        "block_size",
        "lora_id",
        "medium",
        "parent_block_hash",
    )
    __match_args__ = (
        "block_hashes",
        "parent_block_hash",
        "token_ids",
        "block_size",
        "lora_id",
        "medium",
    )

    def __init__(
        self,
        block_hashes: list[int],
        parent_block_hash: int | None,
        token_ids: list[int] | array[int],
        block_size: int,
        lora_id: int | None = None,
        medium: str | None = None,
    ) -> None:
        self.block_hashes = block_hashes
        self.parent_block_hash = parent_block_hash
        self._token_ids = token_ids
        self.block_size = block_size
        self.lora_id = lora_id
        self.medium = medium

    @property
    def token_ids(self) -> list[int]:
        tokens = self._token_ids
        if type(tokens) is array:
            tokens = self._token_ids = tokens.tolist()
        return tokens  # type: ignore[return-value]

    @token_ids.setter
    def token_ids(self, tokens: list[int] | array[int]) -> None:
        self._token_ids = tokens

    def _fields(self) -> tuple[Any, ...]:
        return (
            self.block_hashes,
            self.parent_block_hash,
            self.token_ids,
            self.block_size,
            self.lora_id,
            self.medium,
        )

    def __eq__(self, other: object) -> bool:
        if type(other) is not BlockStored:
            return NotImplemented
        return self._fields() == other._fields()

    __hash__ = None  # type: ignore[assignment]  # mutable and compared by value, as a dataclass

    def __repr__(self) -> str:
        return (
            f"BlockStored(block_hashes={self.block_hashes!r}, "
            f"parent_block_hash={self.parent_block_hash!r}, token_ids={self.token_ids!r}, "
            f"block_size={self.block_size!r}, lora_id={self.lora_id!r}, medium={self.medium!r})"
        )


@dataclass(slots=True)
class BlockRemoved:
    block_hashes: list[int]
    medium: str | None = None


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    pass


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True, slots=True)
class KVEventBatch:
    seq: int
    ts: float
    events: list[KVEvent] = field(default_factory=list)
    dp_rank: int | None = None


class KVEventDecodeError(ValueError):
    """A payload that is not a vLLM-format KV event batch."""


def _event_to_wire(event: KVEvent) -> list[Any]:
    if isinstance(event, BlockStored):
        return [
            "BlockStored",
            event.block_hashes,
            event.parent_block_hash,
            event.token_ids,
            event.block_size,
            event.lora_id,
            event.medium,
        ]
    if isinstance(event, BlockRemoved):
        return ["BlockRemoved", event.block_hashes, event.medium]
    return ["AllBlocksCleared"]


def encode_batch(batch: KVEventBatch) -> bytes:
    """msgpack payload of one batch (without its sequence number)."""
    wire: list[Any] = [batch.ts, [_event_to_wire(e) for e in batch.events]]
    if batch.dp_rank is not None:
        wire.append(batch.dp_rank)
    return msgpack.packb(wire, use_bin_type=True)


def _as_hash(value: Any) -> int:
    if isinstance(value, bytes):
        return int.from_bytes(value, "big")
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    raise KVEventDecodeError(f"block hash must be int or bytes, got {type(value).__name__}")


def _event_from_map(item: dict[Any, Any]) -> KVEvent:
    tag = item.get("type")
    try:
        if tag == "BlockStored":
            parent = item.get("parent_block_hash")
            return BlockStored(
                block_hashes=[_as_hash(h) for h in item["block_hashes"]],
                parent_block_hash=None if parent is None else _as_hash(parent),
                token_ids=[int(t) for t in item["token_ids"]],
                block_size=int(item["block_size"]),
                lora_id=item.get("lora_id"),
                medium=item.get("medium"),
            )
        if tag == "BlockRemoved":
            return BlockRemoved(
                block_hashes=[_as_hash(h) for h in item["block_hashes"]], medium=item.get("medium")
            )
        if tag == "AllBlocksCleared":
            return AllBlocksCleared()
    except (KeyError, ValueError, TypeError) as exc:
        raise KVEventDecodeError(f"malformed {tag} event: {exc!r}") from exc
    raise KVEventDecodeError(f"unknown event type {tag!r}")


def _event_from_wire(item: Any) -> KVEvent:
    if isinstance(item, dict):
        return _event_from_map(item)
    if not isinstance(item, list | tuple) or not item or not isinstance(item[0], str):
        raise KVEventDecodeError(f"event must be a tagged array, got {item!r:.80}")
    tag, fields = item[0], item[1:]
    try:
        if tag == "BlockStored":
            hashes, parent, token_ids, block_size = fields[:4]
            rest = list(fields[4:6]) + [None] * (2 - len(fields[4:6]))
            return BlockStored(
                block_hashes=[_as_hash(h) for h in hashes],
                parent_block_hash=None if parent is None else _as_hash(parent),
                token_ids=[int(t) for t in token_ids],
                block_size=int(block_size),
                lora_id=rest[0],
                medium=rest[1],
            )
        if tag == "BlockRemoved":
            medium = fields[1] if len(fields) > 1 else None
            return BlockRemoved(block_hashes=[_as_hash(h) for h in fields[0]], medium=medium)
        if tag == "AllBlocksCleared":
            return AllBlocksCleared()
    except (ValueError, TypeError, IndexError) as exc:
        raise KVEventDecodeError(f"malformed {tag} event: {exc}") from exc
    raise KVEventDecodeError(f"unknown event tag {tag!r}")


def decode_batch(seq: int, payload: bytes) -> KVEventBatch:
    """Parse a msgpack EventBatch payload received with sequence number `seq`."""
    try:
        wire = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except Exception as exc:  # msgpack raises several unrelated types
        raise KVEventDecodeError(f"not msgpack: {exc}") from exc
    if not isinstance(wire, list) or len(wire) < 2 or not isinstance(wire[1], list):
        raise KVEventDecodeError("EventBatch must be [ts, events, dp_rank?]")
    dp_rank = wire[2] if len(wire) > 2 else None
    return KVEventBatch(
        seq=seq,
        ts=float(wire[0]),
        events=[_event_from_wire(e) for e in wire[1]],
        dp_rank=dp_rank,
    )
