"""A third-party dispatch policy: the instance with the fewest waiting requests, ties to the lowest id.

It depends on nothing but the `policies` views, as a real plug-in would, and is registered under
the `kvherd.policies` entry-point group as `fewest_waiting` (see ../pyproject.toml).
"""

from __future__ import annotations

from policies import ClusterView, Decision, RequestView, candidates


class FewestWaiting:
    name = "fewest_waiting"

    def __init__(self, bias: float = 0.0) -> None:
        self.bias = bias

    def choose(self, request: RequestView, cluster: ClusterView) -> Decision:
        pool = sorted(candidates(cluster), key=lambda inst: (inst.num_waiting, inst.instance_id))
        scores = {inst.instance_id: self.bias - inst.num_waiting for inst in pool}
        return Decision(pool[0].instance_id, scores, "fewest waiting (plug-in)")
