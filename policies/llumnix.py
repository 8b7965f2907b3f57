"""`llumnix`: dispatch to the instance with the highest freeness.

Source: Llumnix (Sun et al., OSDI 2024), §4.4 "dispatching": the global scheduler dispatches each
new request to the instance with the highest freeness F = (M - ΣV) / B, where M is the instance's
KV memory, V the (virtual) usage of its requests including the head-of-line queuing request, and
B its batch size. The scheduler core computes `InstanceView.freeness` as
(free blocks - blocks the head-of-line waiting request needs) / number of requests, +inf when the
instance is idle (Llumnix treats an empty instance as the least loaded). Ties are broken by more
free blocks, then at random under `seed` (default 0).
"""

from __future__ import annotations

import random

from policies.base import argbest, candidates
from policies.views import ClusterView, Decision, RequestView


class LlumnixDispatch:
    name = "llumnix"

    def __init__(self, seed: int = 0) -> None:
        self._rng = random.Random(seed)

    def choose(self, request: RequestView, cluster: ClusterView) -> Decision:
        pool = candidates(cluster)
        top = max(inst.freeness for inst in pool)
        best = argbest(
            [inst for inst in pool if inst.freeness == top], lambda i: i.free_blocks, self._rng
        )
        scores = {inst.instance_id: inst.freeness for inst in pool}
        return Decision(best.instance_id, scores, f"highest freeness ({best.freeness:.2f})")
