"""`kvherd` (the default): least estimated time-to-first-token, in prefill-token units.

Design (kvherd's own). TTFT on an instance is dominated by the prefill work queued ahead of the
request plus the request's own uncached prefill; running decodes share every step with that work,
and a request that does not fit in free KV memory waits for memory. So, per candidate instance:

    prefill   = queued prefill tokens (reported waiting work + the router's pending dispatches)
                + this request's tokens not covered by the instance's cached prefix
    decode    = `decode_token_cost` * running requests      (a running request's share of steps)
    memory    = `memory_penalty` * block_size * max(0, uncached blocks - (free blocks - blocks the
                head-of-line waiting request needs))        (only when capacity is known)
    cost      = prefill + decode + memory                   -> lowest wins

Prefix affinity comes from `prefill` (a hit removes work), load from the queued-work and decode
terms, so a cached prefix is used only while it is actually faster than a cold instance.
Hot-spot guard: like SGLang's balance check, an instance whose router in-flight count exceeds the
least-loaded one by more than `balance_abs_threshold` and by a factor `balance_rel_threshold` is
not considered, so one hot prefix cannot pile an unbounded queue on one instance between load
reports. Ties go to the longer prefix match, then at random under `seed`.
Defaults: decode_token_cost 32, memory_penalty 2.0, balance_abs_threshold 32,
balance_rel_threshold 2.0, seed 0. Decision scores are the negated costs.
"""

from __future__ import annotations

import random

from policies.base import argbest, candidates
from policies.views import ClusterView, Decision, InstanceView, RequestView


class KvherdDispatch:
    name = "kvherd"

    def __init__(
        self,
        decode_token_cost: float = 32.0,
        memory_penalty: float = 2.0,
        balance_abs_threshold: int = 32,
        balance_rel_threshold: float = 2.0,
        seed: int = 0,
    ) -> None:
        self.decode_token_cost = decode_token_cost
        self.memory_penalty = memory_penalty
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold
        self._rng = random.Random(seed)

    def cost(self, request: RequestView, inst: InstanceView, matched_blocks: int) -> float:
        """Estimated TTFT of `request` on `inst`, in prefill-token equivalents."""
        cached_tokens = min(request.num_tokens, matched_blocks * request.block_size)
        prefill = inst.waiting_prefill_tokens + (request.num_tokens - cached_tokens)
        decode = self.decode_token_cost * inst.num_running
        memory = 0.0
        if inst.capacity > 0:
            need = request.num_blocks - matched_blocks
            room = inst.free_blocks - inst.head_waiting_blocks
            memory = self.memory_penalty * request.block_size * max(0, need - room)
        return prefill + decode + memory

    def _unbalanced_out(self, pool: tuple[InstanceView, ...]) -> list[InstanceView]:
        least = min(inst.inflight for inst in pool)
        return [
            inst
            for inst in pool
            if not (
                inst.inflight - least > self.balance_abs_threshold
                and inst.inflight > self.balance_rel_threshold * least
            )
        ]

    def choose(self, request: RequestView, cluster: ClusterView) -> Decision:
        pool = self._unbalanced_out(candidates(cluster))
        matched = cluster.prefix_match(request)
        costs = {i.instance_id: self.cost(request, i, matched.get(i.instance_id, 0)) for i in pool}
        lowest = min(costs.values())
        tied = [i for i in pool if costs[i.instance_id] == lowest]
        best = argbest(tied, lambda i: matched.get(i.instance_id, 0), self._rng)
        hit = matched.get(best.instance_id, 0)
        return Decision(
            best.instance_id,
            {key: -value for key, value in costs.items()},
            f"lowest est. TTFT cost {lowest:.0f} tokens ({hit} cached blocks)",
        )
