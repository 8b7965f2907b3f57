"""`round_robin`: each new request goes to the next dispatchable instance in id order.

Source: the classic load-balancer policy (nginx's default upstream method, SGLang router's
`round_robin`). No parameters. The cursor is over instance ids sorted, so instances joining or
leaving shift the cycle but never make it skip a whole round.
"""

from __future__ import annotations

from bisect import bisect_right

from policies.base import candidates
from policies.views import ClusterView, Decision, RequestView


class RoundRobin:
    name = "round_robin"

    def __init__(self) -> None:
        self._last: str | None = None

    def choose(self, request: RequestView, cluster: ClusterView) -> Decision:
        ids = sorted([inst.instance_id for inst in candidates(cluster)])
        # Next id after the last one chosen (wrapping), robust to the last one having left.
        after = 0 if self._last is None else bisect_right(ids, self._last)
        chosen = ids[after] if after < len(ids) else ids[0]
        self._last = chosen
        scores = dict.fromkeys(ids, 0.0)
        scores[chosen] = 1.0
        return Decision(chosen, scores, "next in rotation")
