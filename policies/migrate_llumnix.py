"""`llumnix` migration: move short requests off overloaded instances onto the freest ones.

Source: Llumnix (Sun et al., OSDI 2024) §4.4, load balancing by migration. Each tick, instances
whose freeness is below `src_freeness` (3.0 blocks per request: short of KV within a few steps),
that preempted since the previous tick, or that are draining (-inf freeness, as Llumnix) are
sources; dispatchable ones with freeness at least `dst_freeness` (10.0) are destinations. Sources
from least free and destinations from most free are paired in order, at most `max_orders` (8);
each pair moves the source's *shortest* running request (fewest blocks: cheapest to move, least
disruption) if it fits the destination, passing over one with under `min_remaining` (64) tokens
of decode budget left while another can go: it would finish before the copy commits.
"""

from __future__ import annotations

import math

from policies.migrate_room import Room
from policies.views import ClusterView, InstanceView, MigrationOrder, RunningRequestView


class LlumnixMigration:
    name = "llumnix"

    def __init__(
        self,
        src_freeness: float = 3.0,
        dst_freeness: float = 10.0,
        max_orders: int = 8,
        min_remaining: int = 64,
    ) -> None:
        self.src_freeness = src_freeness
        self.dst_freeness = dst_freeness
        self.max_orders = max_orders
        self.min_remaining = min_remaining
        self._preemptions: dict[str, int] = {}

    def _source_freeness(self, inst: InstanceView) -> float:
        """Freeness used to rank sources; -inf for draining, below threshold when preempting."""
        preempted = inst.num_preemptions > self._preemptions.get(
            inst.instance_id, inst.num_preemptions
        )
        self._preemptions[inst.instance_id] = inst.num_preemptions
        if inst.draining:
            return -math.inf
        if preempted:
            return min(inst.freeness, self.src_freeness - 1e-9)
        return inst.freeness

    def _cost(self, request: RunningRequestView) -> tuple[bool, int, str]:
        """Sort key: requests about to finish last, then fewest blocks."""
        ending = request.remaining_tokens is not None and request.remaining_tokens < self.min_remaining
        return ending, request.num_blocks, request.request_id

    def plan(self, cluster: ClusterView) -> list[MigrationOrder]:
        ranked = {inst.instance_id: self._source_freeness(inst) for inst in cluster.instances}
        overloaded = [
            i
            for i in cluster.instances
            if i.healthy and i.running and ranked[i.instance_id] < self.src_freeness
        ]
        sources = sorted(
            overloaded,
            key=lambda i: (ranked[i.instance_id], i.instance_id),
        )
        dests = sorted(
            (i for i in cluster.dispatchable if i.freeness >= self.dst_freeness),
            key=lambda i: (-i.freeness, i.instance_id),
        )
        room = Room(cluster)
        orders: list[MigrationOrder] = []
        for src, dst in zip(sources, dests, strict=False):
            if len(orders) >= self.max_orders or src.instance_id == dst.instance_id:
                continue
            shortest = min(src.running, key=self._cost)
            if room.free.get(dst.instance_id, 0) < shortest.num_blocks:
                continue
            room.take(dst.instance_id, shortest.num_blocks)
            why = "draining" if src.draining else f"freeness {ranked[src.instance_id]:.2f}"
            orders.append(
                MigrationOrder(
                    shortest.request_id,
                    src.instance_id,
                    dst.instance_id,
                    f"{why} -> {dst.freeness:.2f}",
                )
            )
        return orders
