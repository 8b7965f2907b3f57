"""`kvherd` P/D pairing (the default): the decode instance by decode load and what it already holds,
the prefill instance by kvherd's TTFT cost, and no handoff for short uncached prompts.

Design (kvherd's own), in prefill-token equivalents like the `kvherd` dispatch policy:

    decode cost = `decode_token_cost` * requests it decodes (max of reported and the router's own)
                + `transfer_weight` * block_size * blocks of this request it lacks (only those move)
                + `memory_penalty` * block_size * max(0, blocks it lacks - (free - head-of-line))
    -> lowest wins among instances that decode; ties to the longer cached prefix, then a seeded coin

Conditional disaggregation (as Dynamo and llm-d do): when the chosen decode instance would have to
compute at most `local_prefill_tokens` uncached prompt tokens, the request runs there entirely,
since a handoff would cost more than the interference of so short a prefill. Otherwise the prefill
instance is `KvherdDispatch`'s cheapest (queued prefill + uncached prompt + its decodes + memory)
among instances that prefill; when that is the decode instance itself (a ``mixed`` one), the request
is not handed off either. Defaults: local_prefill_tokens 256, transfer_weight 0.25 (moving a block
costs far less than computing it, but it is not free), decode_token_cost 32, memory_penalty 2.0,
seed 0; the prefill cost takes `uncached_weight` (4.0) from `KvherdDispatch`.
"""

from __future__ import annotations

import random

from policies.base import phase_candidates
from policies.kvherd import KvherdDispatch
from policies.views import ClusterView, InstanceView, PDDecision, RequestView


class KvherdPD:
    name = "kvherd"

    def __init__(
        self,
        local_prefill_tokens: int = 256,
        transfer_weight: float = 0.25,
        decode_token_cost: float = 32.0,
        memory_penalty: float = 2.0,
        uncached_weight: float = 4.0,
        seed: int = 0,
    ) -> None:
        self.local_prefill_tokens = local_prefill_tokens
        self.transfer_weight = transfer_weight
        self.decode_token_cost = decode_token_cost
        self.memory_penalty = memory_penalty
        self._prefill_cost = KvherdDispatch(
            decode_token_cost=decode_token_cost,
            uncached_weight=uncached_weight,
            memory_penalty=memory_penalty,
        ).cost
        self._rng = random.Random(seed)

    def decode_cost(self, request: RequestView, inst: InstanceView, matched_blocks: int) -> float:
        """What decoding `request` on `inst` adds, in prefill-token equivalents."""
        bs = request.block_size
        missing = max(0, request.num_blocks - matched_blocks)
        decoding = max(inst.num_running + inst.num_waiting, inst.inflight)
        memory = 0.0
        if inst.capacity > 0:
            room = inst.free_blocks - inst.head_waiting_blocks
            memory = self.memory_penalty * bs * max(0, missing - room)
        return self.decode_token_cost * decoding + self.transfer_weight * bs * missing + memory

    def _cheapest(
        self, costs: list[float], instances: list[InstanceView], matched: list[int]
    ) -> int:
        lowest = min(costs)
        tied = [i for i, c in enumerate(costs) if c == lowest]
        if len(tied) > 1:
            deepest = max(matched[i] for i in tied)
            tied = [i for i in tied if matched[i] == deepest]
        return tied[0] if len(tied) == 1 else self._rng.choice(tied)

    def pair(self, request: RequestView, cluster: ClusterView) -> PDDecision:
        prefill_pool, decode_pool = phase_candidates(cluster)
        match = cluster.prefix_match(request)
        d_matched = [match.get(inst.instance_id, 0) for inst in decode_pool]
        d_costs = [
            self.decode_cost(request, inst, m)
            for inst, m in zip(decode_pool, d_matched, strict=True)
        ]
        d = self._cheapest(d_costs, decode_pool, d_matched)
        decode = decode_pool[d]
        uncached = request.num_tokens - min(request.num_tokens, d_matched[d] * request.block_size)
        if uncached <= self.local_prefill_tokens:
            return PDDecision(
                decode.instance_id,
                decode.instance_id,
                f"{uncached} uncached prompt tokens: prefilled where it decodes",
            )
        p_matched = [match.get(inst.instance_id, 0) for inst in prefill_pool]
        p_costs = [
            self._prefill_cost(request, inst, m)
            for inst, m in zip(prefill_pool, p_matched, strict=True)
        ]
        prefill = prefill_pool[self._cheapest(p_costs, prefill_pool, p_matched)]
        return PDDecision(
            prefill.instance_id,
            decode.instance_id,
            f"prefill cost {min(p_costs):.0f}, decode cost {d_costs[d]:.0f} "
            f"({d_matched[d]} blocks already on the decode instance)",
        )
