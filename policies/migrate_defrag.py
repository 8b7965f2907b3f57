"""`defrag` migration: make room for a head-of-line waiting request that cannot be admitted.

Source: Llumnix (OSDI 2024) §3, de-fragmentation: free memory is scattered across instances so a
queued request fits nowhere, although the fleet as a whole has room. For every instance whose
head-of-line waiting request needs more blocks than it has free, running requests are moved out,
largest first (fewest migrations to cover the deficit), each to the destination with the most
room that fits it. An instance is only touched when the whole deficit can be covered in this plan,
since a partial move would cost migrations without admitting the request.
Default: max_orders 8 per tick.
"""

from __future__ import annotations

from policies.migrate_room import Room
from policies.views import ClusterView, MigrationOrder


class DefragMigration:
    name = "defrag"

    def __init__(self, max_orders: int = 8) -> None:
        self.max_orders = max_orders

    def plan(self, cluster: ClusterView) -> list[MigrationOrder]:
        room = Room(cluster)
        orders: list[MigrationOrder] = []
        blocked = [
            inst
            for inst in cluster.instances
            if inst.healthy and inst.head_waiting_blocks > inst.free_blocks and inst.running
        ]
        for inst in sorted(
            blocked, key=lambda i: (i.free_blocks - i.head_waiting_blocks, i.instance_id)
        ):
            deficit = inst.head_waiting_blocks - inst.free_blocks
            # The blocked instance is a source now, not a destination.
            room.free.pop(inst.instance_id, None)
            trial = dict(room.free)
            planned: list[MigrationOrder] = []
            for req in sorted(inst.running, key=lambda r: (-r.num_blocks, r.request_id)):
                if deficit <= 0:
                    break
                dst = room.freest_for(req, inst)
                if dst is None:
                    continue
                room.take(dst, req.num_blocks)
                deficit -= req.num_blocks
                planned.append(
                    MigrationOrder(
                        req.request_id,
                        inst.instance_id,
                        dst,
                        f"defrag: head-of-line needs {inst.head_waiting_blocks} blocks, "
                        f"{inst.free_blocks} free",
                    )
                )
            if deficit > 0 or len(orders) + len(planned) > self.max_orders:
                room.free = trial  # give back the room this instance would have used
                continue
            orders.extend(planned)
        return orders
