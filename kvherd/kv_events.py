"""KV cache events and their wire encoding, compatible with vLLM's `kv_events` format.

Contract:
- Three events describe how an instance's prefix cache changes: `BlockStored` (a run of consecutive full
  blocks became reusable), `BlockRemoved` (blocks were evicted), `AllBlocksCleared`.
- Events travel in batches `KVEventBatch(seq, ts, events)`; `seq` increases by one per batch per
  instance, so a consumer that sees a gap knows it missed batches and can ask for a replay.
- `encode_batch` / `decode_batch` produce and read the msgpack payload vLLM 0.32's ZMQ publisher
  sends (msgspec: the batch array-like, events tagged maps, defaults omitted): an EventBatch is the
  array ``[ts, [event, ...], dp_rank]`` (dp_rank omitted when None) and each event a map
  ``{"type": "BlockStored", "block_hashes", "parent_block_hash", "token_ids", "block_size",
  "lora_id", "medium", "lora_name"[, "extra_keys"]}`` (``lora_name`` present even when null,
  ``extra_keys`` only when known), ``{"type": "BlockRemoved", "block_hashes", "medium"}`` or
  ``{"type": "AllBlocksCleared"}``. The sequence number is not in the payload: it is its own
  8-byte big-endian ZMQ frame.
- `BlockStored.extra_keys` is vLLM's per-block list: one entry per block hash, None or the block's
  untagged extra hash keys in vLLM's order: the LoRA name (every block of a LoRA request), then
  multi-modal ``[identifier, offset]`` pairs, then the request's ``cache_salt`` (first block of a
  prompt only), then prompt-embedding digests. `salt_and_extras` reads them back.
- ``medium`` names where the blocks live, with vLLM's names (`MEDIUM_GPU` ``"GPU"``, `MEDIUM_CPU`
  ``"CPU"``, `MEDIUM_STORAGE` ``"STORAGE"``): kvherd's engine sets it on every stored and removed
  block; a block moving down a tier is stored on the lower one, then removed from the upper one.
- Decoding also reads the positional form older vLLM releases and older kvherd agents send
  (``["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium,
  lora_name?, extra_keys?]``), ignores the fields newer versions add (extra trailing items or
  unknown keys: ``group_idx``, ``kv_cache_spec_kind``, ...), and accepts block hashes sent as bytes
  (converted to ints, big-endian, as vLLM's consumers do).
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field
from typing import Any

import msgpack

# vLLM's names for where a block lives (`vllm.distributed.kv_events.MEDIUM_*`).
MEDIUM_GPU = "GPU"
MEDIUM_CPU = "CPU"
MEDIUM_STORAGE = "STORAGE"

ExtraKeys = list[list[Any] | None]  # one entry per block: None or the block's untagged keys


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
        "extra_keys",
        "lora_id",
        "lora_name",
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
        "lora_name",
        "extra_keys",
    )

    def __init__(
        self,
        block_hashes: list[int],
        parent_block_hash: int | None,
        token_ids: list[int] | array[int],
        block_size: int,
        lora_id: int | None = None,
        medium: str | None = None,
        lora_name: str | None = None,
        extra_keys: ExtraKeys | None = None,
    ) -> None:
        self.block_hashes = block_hashes
        self.parent_block_hash = parent_block_hash
        self._token_ids = token_ids
        self.block_size = block_size
        self.lora_id = lora_id
        self.medium = medium
        self.lora_name = lora_name
        self.extra_keys = extra_keys

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
            self.lora_name,
            self.extra_keys,
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
            f"block_size={self.block_size!r}, lora_id={self.lora_id!r}, medium={self.medium!r}, "
            f"lora_name={self.lora_name!r}, extra_keys={self.extra_keys!r})"
        )


def salt_and_extras(
    keys: list[Any] | None, lora_name: str | None, first_block: bool
) -> tuple[str | None, tuple[str | int | bytes, ...]]:
    """One block's vLLM event extra keys, as (cache_salt, other keys kvherd cannot produce).

    The LoRA name (the event's `lora_name`, repeated first in every block's keys) is dropped: the
    caller folds it in from `lora_name` itself. A lone string left on the first block of a prompt
    is its cache salt. Anything else (multi-modal pairs, embedding digests) comes back as hash keys
    behind an ``"extra"`` marker, so a consumer can keep those blocks apart from every text-only
    request.
    """
    if not keys:
        return None, ()
    rest = list(keys)
    if lora_name is not None and rest and rest[0] == lora_name:
        del rest[0]
    salt = None
    if first_block:
        # The salt comes after the multi-modal pairs (lists) and before embedding digests (bytes).
        for index in range(len(rest) - 1, -1, -1):
            if isinstance(rest[index], str):
                salt = rest.pop(index)
                break
    if rest:  # marked, so that no salt (a lone key) can ever read as these keys
        return salt, ("extra", *map(_scalar, rest))
    return salt, ()


def _scalar(key: Any) -> str | int | bytes:
    """A hash key of one extra key: strings, ints and bytes as they are, anything else (a
    multi-modal ``[identifier, offset]`` pair) by its repr."""
    if isinstance(key, str | bytes) or (isinstance(key, int) and not isinstance(key, bool)):
        return key
    return repr(key)


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


def _event_to_wire(event: KVEvent) -> dict[str, Any]:
    # The maps msgspec writes for vLLM's tagged structs: fields in declaration order, a field whose
    # value is its default (None, for the ones with a default) left out.
    if isinstance(event, BlockStored):
        wire: dict[str, Any] = {
            "type": "BlockStored",
            "block_hashes": event.block_hashes,
            "parent_block_hash": event.parent_block_hash,
            "token_ids": event.token_ids,
            "block_size": event.block_size,
            "lora_id": event.lora_id,
            "medium": event.medium,
            "lora_name": event.lora_name,
        }
        if event.extra_keys is not None:
            wire["extra_keys"] = event.extra_keys
        return wire
    if isinstance(event, BlockRemoved):
        return {"type": "BlockRemoved", "block_hashes": event.block_hashes, "medium": event.medium}
    return {"type": "AllBlocksCleared"}


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


def _block_stored(
    hashes: Any,
    parent: Any,
    token_ids: Any,
    block_size: Any,
    lora_id: Any = None,
    medium: Any = None,
    lora_name: Any = None,
    extra_keys: Any = None,
) -> BlockStored:
    block_hashes = [_as_hash(h) for h in hashes]
    if lora_name is not None and not isinstance(lora_name, str):
        raise TypeError(f"lora_name must be a string, got {type(lora_name).__name__}")
    if extra_keys is not None and (
        not isinstance(extra_keys, list)
        or len(extra_keys) != len(block_hashes)
        or not all(keys is None or isinstance(keys, list) for keys in extra_keys)
    ):
        raise ValueError("extra_keys must hold one list (or null) per block hash")
    return BlockStored(
        block_hashes=block_hashes,
        parent_block_hash=None if parent is None else _as_hash(parent),
        token_ids=[int(t) for t in token_ids],
        block_size=int(block_size),
        lora_id=lora_id,
        medium=medium,
        lora_name=lora_name,
        extra_keys=extra_keys,
    )


def _event_from_map(item: dict[Any, Any]) -> KVEvent:
    tag = item.get("type")
    try:
        if tag == "BlockStored":
            return _block_stored(
                item["block_hashes"],
                item.get("parent_block_hash"),
                item["token_ids"],
                item["block_size"],
                item.get("lora_id"),
                item.get("medium"),
                item.get("lora_name"),
                item.get("extra_keys"),
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
        raise KVEventDecodeError(f"event must be a tagged map or array, got {item!r:.80}")
    tag, fields = item[0], item[1:]
    try:
        if tag == "BlockStored":
            if len(fields) < 4:
                raise ValueError(f"{len(fields)} fields, expected at least 4")
            return _block_stored(*fields[:8])
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
