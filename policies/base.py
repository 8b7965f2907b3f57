"""The two policy protocols and the helpers every built-in shares.

Contract:
- A dispatch policy has ``choose(request, cluster) -> Decision`` and picks among
  ``cluster.dispatchable`` (healthy, not draining); it raises `NoInstanceError` when that is empty.
- A P/D policy has ``pair(request, cluster) -> PDDecision``: a prefill instance among the
  dispatchable ones that prefill, a decode instance among those that decode (the same instance when
  the request should not be handed off); it raises `NoInstanceError` when either set is empty.
- A migration policy has ``plan(cluster) -> list[MigrationOrder]``; the migration loop filters out
  requests and instances already busy with a migration, so a plan may be naive about in-flight moves.
- Policies are plain objects, constructed with keyword parameters (the registry passes YAML/CLI
  parameters through). Any randomness comes from a ``random.Random(seed)`` owned by the policy, so a
  policy is deterministic under its seed.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from typing import Protocol, runtime_checkable

from policies.views import (
    ClusterView,
    Decision,
    InstanceView,
    MigrationOrder,
    NoInstanceError,
    PDDecision,
    RequestView,
)


@runtime_checkable
class DispatchPolicy(Protocol):
    """Chooses the instance for a new request."""

    name: str

    def choose(self, request: RequestView, cluster: ClusterView) -> Decision: ...


@runtime_checkable
class PDPolicy(Protocol):
    """Pairs a prefill instance with a decode instance for a new request (P/D disaggregation)."""

    name: str

    def pair(self, request: RequestView, cluster: ClusterView) -> PDDecision: ...


@runtime_checkable
class MigrationPolicy(Protocol):
    """Proposes live migrations of running requests, once per migration-loop tick."""

    name: str

    def plan(self, cluster: ClusterView) -> list[MigrationOrder]: ...


def candidates(cluster: ClusterView) -> tuple[InstanceView, ...]:
    """The instances a dispatch policy may choose from; raises if there are none."""
    found = cluster.dispatchable
    if not found:
        raise NoInstanceError(
            f"no dispatchable instance among {len(cluster)} registered (all unhealthy or draining)"
        )
    return found


def phase_candidates(cluster: ClusterView) -> tuple[list[InstanceView], list[InstanceView]]:
    """Dispatchable instances that prefill and that decode; raises if either is empty."""
    found = candidates(cluster)
    prefill = [inst for inst in found if inst.prefills]
    decode = [inst for inst in found if inst.decodes]
    if not prefill or not decode:
        missing = "prefill" if not prefill else "decode"
        raise NoInstanceError(f"no dispatchable instance can {missing} among {len(cluster)}")
    return prefill, decode


def argbest(
    items: Sequence[InstanceView], key: Callable[[InstanceView], float], rng: random.Random
) -> InstanceView:
    """The item with the highest key; ties broken by the seeded `rng` (never by list order)."""
    values = [key(item) for item in items]
    best = max(values)
    tied = [item for item, value in zip(items, values, strict=True) if value == best]
    return tied[0] if len(tied) == 1 else rng.choice(tied)
