"""`drain` migration: move every running request off draining instances.

Source: Llumnix (OSDI 2024) §4.4, scaling in / instance termination: a draining instance accepts no
new requests, and its running requests are migrated out so it can stop without aborting them. Each
goes to the dispatchable instance with the most room that fits it; requests that fit nowhere stay
(and finish where they are). Default: max_orders 8 per tick (the loop ticks again for the rest).
"""

from __future__ import annotations

from policies.migrate_room import Room
from policies.views import ClusterView, MigrationOrder


class DrainMigration:
    name = "drain"

    def __init__(self, max_orders: int = 8) -> None:
        self.max_orders = max_orders

    def plan(self, cluster: ClusterView) -> list[MigrationOrder]:
        room = Room(cluster)
        orders: list[MigrationOrder] = []
        for inst in sorted(cluster.instances, key=lambda i: i.instance_id):
            if not inst.draining:
                continue
            for req in sorted(inst.running, key=lambda r: (r.num_blocks, r.request_id)):
                if len(orders) >= self.max_orders:
                    return orders
                dst = room.freest_for(req, inst)
                if dst is None:
                    continue
                room.take(dst, req.num_blocks)
                orders.append(MigrationOrder(req.request_id, inst.instance_id, dst, "draining"))
        return orders
