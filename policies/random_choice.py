"""`random`: a uniformly random dispatchable instance.

Source: SGLang router's and Dynamo's `random` modes. Parameter: `seed` (default 0), so a run is
reproducible.
"""

from __future__ import annotations

import random

from policies.base import candidates
from policies.views import ClusterView, Decision, RequestView


class RandomChoice:
    name = "random"

    def __init__(self, seed: int = 0) -> None:
        self._rng = random.Random(seed)

    def choose(self, request: RequestView, cluster: ClusterView) -> Decision:
        ids = sorted(inst.instance_id for inst in candidates(cluster))
        chosen = self._rng.choice(ids)
        return Decision(chosen, {i: 1.0 / len(ids) for i in ids}, "uniform random")
