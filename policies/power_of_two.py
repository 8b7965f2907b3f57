"""`power_of_two`: sample two distinct instances at random, take the one with fewer requests.

Source: Mitzenmacher, "The Power of Two Choices in Randomized Load Balancing" (2001); Envoy's
least-request default (`choice_count` 2). Parameters: `choices` (default 2), `seed` (default 0).
Sampling avoids the herd effect of a global argmin when load figures are stale.
"""

from __future__ import annotations

import random

from policies.base import argbest, candidates
from policies.views import ClusterView, Decision, RequestView


class PowerOfTwo:
    name = "power_of_two"

    def __init__(self, choices: int = 2, seed: int = 0) -> None:
        if choices < 1:
            raise ValueError("choices must be >= 1")
        self.choices = choices
        self._rng = random.Random(seed)

    def choose(self, request: RequestView, cluster: ClusterView) -> Decision:
        pool = sorted(candidates(cluster), key=lambda inst: inst.instance_id)
        sampled = self._rng.sample(pool, min(self.choices, len(pool)))
        best = argbest(sampled, lambda inst: -inst.num_requests, self._rng)
        scores = {inst.instance_id: 0.0 - inst.num_requests for inst in sampled}
        return Decision(best.instance_id, scores, f"fewer requests of {len(sampled)} sampled")
