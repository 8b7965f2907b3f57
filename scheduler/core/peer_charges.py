"""What other router replicas have in flight on each instance: their charges, as they last said.

Contract:
- Pure (explicit `now`, seconds). A `Charge` is one replica's own accounting of one instance:
  requests in flight, those not yet at their first token, their uncached prompt tokens, their
  KV blocks. `parse_charges(body)` reads a replica's ``GET /admin/v1/charges`` answer
  (``{"replica", "charges": {instance: [inflight, pending_prefill, pending_tokens, blocks]}}``);
  anything else is a ValueError, never a partial update.
- `PeerCharges.update(peer, now, charges)` replaces what `peer` said; `totals(now)` sums, per
  instance, what every peer said within the last `ttl_s`: a replica that stops answering (it
  died, or the network split) stops counting after `ttl_s`, so its charges never pin load on an
  instance for longer. A replica never counts its own answer (`own` is skipped by name).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class Charge:
    inflight: int = 0
    pending_prefill: int = 0
    pending_prefill_tokens: int = 0
    blocks: int = 0

    def __add__(self, other: Charge) -> Charge:
        return Charge(
            self.inflight + other.inflight,
            self.pending_prefill + other.pending_prefill,
            self.pending_prefill_tokens + other.pending_prefill_tokens,
            self.blocks + other.blocks,
        )


NO_CHARGE = Charge()


def parse_charges(body: Any) -> tuple[str, dict[str, Charge]]:
    """(replica, charges per instance) from a ``GET /admin/v1/charges`` body."""
    if not isinstance(body, dict) or not isinstance(body.get("replica"), str):
        raise ValueError("a charges answer is {'replica': str, 'charges': {...}}")
    given = body.get("charges")
    if not isinstance(given, dict):
        raise ValueError("'charges' must be an object")
    charges = {}
    for instance_id, figures in given.items():
        if (
            not isinstance(figures, list)
            or len(figures) != 4
            or not all(type(f) is int and f >= 0 for f in figures)
        ):
            raise ValueError(f"charges of {instance_id!r} must be 4 non-negative ints")
        charges[instance_id] = Charge(*figures)
    return body["replica"], charges


class PeerCharges:
    def __init__(self, own: str, ttl_s: float) -> None:
        if ttl_s <= 0:
            raise ValueError("ttl_s must be positive")
        self.own = own
        self.ttl_s = ttl_s
        self._said: dict[str, tuple[float, Mapping[str, Charge]]] = {}

    def update(self, peer: str, now: float, charges: Mapping[str, Charge]) -> None:
        if peer != self.own:
            self._said[peer] = (now, charges)

    def fresh_peers(self, now: float) -> list[str]:
        return [p for p, (at, _) in self._said.items() if now - at <= self.ttl_s]

    def totals(self, now: float) -> dict[str, Charge]:
        summed: dict[str, Charge] = {}
        for at, charges in self._said.values():
            if now - at > self.ttl_s:
                continue
            for instance_id, charge in charges.items():
                summed[instance_id] = summed.get(instance_id, NO_CHARGE) + charge
        return summed
