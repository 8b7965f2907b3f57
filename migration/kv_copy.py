"""Moving blocks of KV between two engines' caches over a pair channel, without staging when possible.

Contract:
- An engine exposes its cache as `views`: tensors indexed by block id on dim 0 (for kvherd's
  engine, one per layer and K/V). Both ends must expose the same number of views with the same row
  sizes (the destination checks the KV geometry at stage 0).
- Framing depends only on the block count and the views' row sizes, so each side picks its own
  copy path independently:
  - a transfer of at most `chunk_bytes` is one message, view after view (a short stop-and-copy
    stage pays one transport round trip, not one per view);
  - a larger one goes in pieces of `chunk_bytes // largest row` blocks, one message per piece and
    view. A run of consecutive block ids is then sent from (or received into) the cache directly,
    with no copy beyond the transport's own; other pieces go through one reused staging buffer.
- Only the blocks named are read or written, so the engine may keep stepping meanwhile (the
  destination's blocks are reserved and unused; the source's are full, hence immutable, or belong
  to a suspended request). Both functions block: run them off the event loop.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch

from migration.transport import PairChannel


def row_bytes(views: Sequence[torch.Tensor]) -> int:
    """Bytes of one block across all views (the KV bytes per block)."""
    return sum(_row(v) for v in views)


def _row(view: torch.Tensor) -> int:
    return view[0].numel() * view.element_size()


def _first_of_run(block_ids: Sequence[int]) -> int | None:
    """The first id if the ids are consecutive (rows [first, first + n) are then one slice)."""
    first = block_ids[0]
    return first if list(block_ids) == list(range(first, first + len(block_ids))) else None


def _rows(view: torch.Tensor, block_ids: Sequence[int], first: int | None) -> torch.Tensor:
    return view[first : first + len(block_ids)] if first is not None else view[list(block_ids)]


def _as_rows(flat: torch.Tensor, view: torch.Tensor, n: int) -> torch.Tensor:
    """`flat` bytes seen as `n` rows of `view`."""
    return flat.view(view.dtype).view(n, *view.shape[1:])


def _pieces(
    chunk_bytes: int, views: Sequence[torch.Tensor], block_ids: Sequence[int]
) -> Iterator[tuple[Sequence[int], int | None, torch.Tensor | None]]:
    """The pieces a large transfer is framed in, identical on both ends: (block ids, first id of a
    consecutive run or None, the ids as an index tensor when they are not consecutive)."""
    per = max(1, chunk_bytes // max(_row(v) for v in views))
    for start in range(0, len(block_ids), per):
        piece = block_ids[start : start + per]
        first = _first_of_run(piece)
        index = None if first is not None else torch.tensor(piece, device=views[0].device)
        yield piece, first, index


def send_blocks(
    channel: PairChannel, views: Sequence[torch.Tensor], block_ids: Sequence[int], tag: int
) -> None:
    if not block_ids:
        return
    total = len(block_ids) * row_bytes(views)
    if total <= channel.chunk_bytes:
        staging = torch.empty(total, dtype=torch.uint8, device=views[0].device)
        offset, first = 0, _first_of_run(block_ids)
        for view in views:
            size = len(block_ids) * _row(view)
            _as_rows(staging[offset : offset + size], view, len(block_ids)).copy_(
                _rows(view, block_ids, first)
            )
            offset += size
        channel.send(staging, tag)
        return
    buffer: torch.Tensor | None = None
    for piece, first, index in _pieces(channel.chunk_bytes, views, block_ids):
        for view in views:
            if first is not None:
                channel.send(view[first : first + len(piece)], tag)
                continue
            if buffer is None:
                buffer = torch.empty(channel.chunk_bytes, dtype=torch.uint8, device=view.device)
            out = _as_rows(buffer[: len(piece) * _row(view)], view, len(piece))
            torch.index_select(view, 0, index, out=out)  # type: ignore[arg-type]
            channel.send(out, tag)  # returns once sent: the buffer is free again


def recv_blocks(
    channel: PairChannel, views: Sequence[torch.Tensor], block_ids: Sequence[int], tag: int
) -> None:
    if not block_ids:
        return
    total = len(block_ids) * row_bytes(views)
    if total <= channel.chunk_bytes:
        staging = channel.recv_into(
            torch.empty(total, dtype=torch.uint8, device=views[0].device), tag
        )
        offset, first = 0, _first_of_run(block_ids)
        index = None if first is not None else torch.tensor(block_ids, device=views[0].device)
        for view in views:
            size = len(block_ids) * _row(view)
            rows = _as_rows(staging[offset : offset + size], view, len(block_ids))
            if first is not None:
                view[first : first + len(block_ids)].copy_(rows)
            else:
                view.index_copy_(0, index, rows)  # type: ignore[arg-type]
            offset += size
        return
    buffer: torch.Tensor | None = None
    for piece, first, index in _pieces(channel.chunk_bytes, views, block_ids):
        for view in views:
            if first is not None:
                channel.recv_into(view[first : first + len(piece)], tag)
                continue
            if buffer is None:
                buffer = torch.empty(channel.chunk_bytes, dtype=torch.uint8, device=view.device)
            rows = _as_rows(buffer[: len(piece) * _row(view)], view, len(piece))
            channel.recv_into(rows, tag)
            view.index_copy_(0, index, rows)  # type: ignore[arg-type]
