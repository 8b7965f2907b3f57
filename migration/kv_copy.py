"""Moving blocks of KV between two engines' caches over a pair channel, without staging when possible.

Contract:
- An engine exposes its cache as `views`: tensors indexed by block id on dim 0 (for kvherd's
  engine, one per layer and K/V). Both ends must expose the same number of views with the same row
  size (the destination checks the KV geometry at stage 0).
- A stage's blocks go in pieces of `blocks_per_piece` blocks; each piece is one message per view
  holding that piece's rows in order. The framing depends only on the block count, so each side
  picks its own path: a run of consecutive block ids is sent from (or received into) the cache
  directly — no gather, no scatter, no copy beyond the transport's own — and any other piece goes
  through a staging buffer (`index_select` / `index_copy_`).
- Only the blocks named are read or written, so the engine may keep stepping meanwhile (the
  destination's blocks are reserved and unused; the source's are full, hence immutable, or belong
  to a suspended request). Both functions block: run them off the event loop.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from migration.transport import PairChannel, blocks_per_piece


def row_bytes(views: Sequence[torch.Tensor]) -> int:
    """Bytes of one block across all views (the KV bytes per block)."""
    return sum(v[0].numel() * v.element_size() for v in views)


def _run(block_ids: Sequence[int]) -> int | None:
    """The first id if the ids are consecutive (then rows [first, first + n) are one slice)."""
    first = block_ids[0]
    return first if list(block_ids) == list(range(first, first + len(block_ids))) else None


def send_blocks(
    channel: PairChannel, views: Sequence[torch.Tensor], block_ids: Sequence[int], tag: int
) -> None:
    per = blocks_per_piece(channel.chunk_bytes, row_bytes(views))
    staging: list[torch.Tensor] = []
    for start in range(0, len(block_ids), per):
        piece = block_ids[start : start + per]
        first = _run(piece)
        if first is None and not staging:
            staging = [v.new_empty((min(per, len(block_ids)), *v.shape[1:])) for v in views]
        index = None if first is not None else torch.tensor(piece, device=views[0].device)
        for n, view in enumerate(views):
            if first is not None:
                channel.send(view[first : first + len(piece)], tag)
            else:
                out = staging[n][: len(piece)]
                torch.index_select(view, 0, index, out=out)  # type: ignore[arg-type]
                channel.send(out, tag)


def recv_blocks(
    channel: PairChannel, views: Sequence[torch.Tensor], block_ids: Sequence[int], tag: int
) -> None:
    per = blocks_per_piece(channel.chunk_bytes, row_bytes(views))
    staging: list[torch.Tensor] = []
    for start in range(0, len(block_ids), per):
        piece = block_ids[start : start + per]
        first = _run(piece)
        if first is None and not staging:
            staging = [v.new_empty((min(per, len(block_ids)), *v.shape[1:])) for v in views]
        index = None if first is not None else torch.tensor(piece, device=views[0].device)
        for n, view in enumerate(views):
            if first is not None:
                channel.recv_into(view[first : first + len(piece)], tag)
            else:
                buf = staging[n][: len(piece)]
                channel.recv_into(buf, tag)
                view.index_copy_(0, index, buf)  # type: ignore[arg-type]
