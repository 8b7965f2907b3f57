"""`least_requests`: the instance with the fewest requests (running + waiting).

Source: Envoy's / nginx's least-request balancing, applied to the scheduler's effective request
counts (last report plus the router's own dispatches since). Ties are broken at random under `seed`
(default 0). Scores reported are the negated request counts (higher is better).
"""

from __future__ import annotations

import random

from policies.base import argbest, candidates
from policies.views import ClusterView, Decision, RequestView


class LeastRequests:
    name = "least_requests"

    def __init__(self, seed: int = 0) -> None:
        self._rng = random.Random(seed)

    def choose(self, request: RequestView, cluster: ClusterView) -> Decision:
        pool = candidates(cluster)
        best = argbest(pool, lambda inst: -inst.num_requests, self._rng)
        scores = {inst.instance_id: 0.0 - inst.num_requests for inst in pool}
        return Decision(best.instance_id, scores, f"fewest requests ({best.num_requests})")
