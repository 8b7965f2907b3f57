"""Destination bookkeeping shared by migration policies: who has room for how many blocks.

`Room` starts from each dispatchable instance's free blocks minus what its head-of-line waiting
request needs (that memory is already spoken for) and is debited as orders are planned, so one
plan never sends more blocks to an instance than it can hold.
"""

from __future__ import annotations

from collections.abc import Iterable

from policies.views import ClusterView, InstanceView, RunningRequestView


class Room:
    def __init__(self, cluster: ClusterView, exclude: Iterable[str] = ()) -> None:
        skip = set(exclude)
        self.free: dict[str, int] = {
            inst.instance_id: inst.free_blocks - inst.head_waiting_blocks
            for inst in cluster.dispatchable
            if inst.instance_id not in skip and inst.capacity > 0
        }

    def freest_for(self, request: RunningRequestView, src: InstanceView) -> str | None:
        """The destination with the most room that fits `request` (never `src`), or None."""
        fits = [
            (room, inst_id)
            for inst_id, room in self.free.items()
            if inst_id != src.instance_id and room >= request.num_blocks
        ]
        if not fits:
            return None
        # Most room first; equal room goes to the smallest id, so plans are deterministic.
        return min(fits, key=lambda pair: (-pair[0], pair[1]))[1]

    def take(self, dst: str, blocks: int) -> None:
        self.free[dst] -= blocks
