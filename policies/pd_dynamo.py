"""`dynamo` P/D pairing: NVIDIA Dynamo's KV router for decode workers with conditional disaggregation.

Source: ai-dynamo/dynamo disaggregated serving docs (the decode worker is chosen by the KV router;
its "disaggregated router" sends the prefill to the prefill pool only when the prompt's length not
covered by the decode worker's prefix cache exceeds `max_local_prefill_length`, else the decode worker
prefills locally; the prefill pool is a queue served by the first free prefill worker). Here: the
decode instance is `DynamoKV`'s argmin among instances that decode; the prefill instance, when the
request is split, is the prefill instance with the least queued prefill work (Dynamo's shared queue:
the least busy worker takes the next job), ties at random under `seed`. Defaults:
max_local_prefill_length 1000 tokens (Dynamo's documented default), overlap_score_weight 1.0, seed 0.
"""

from __future__ import annotations

import random

from policies.base import argbest, phase_candidates
from policies.dynamo_kv import DynamoKV
from policies.views import ClusterView, InstanceView, PDDecision, RequestView


class DynamoPD:
    name = "dynamo"

    def __init__(
        self, max_local_prefill_length: int = 1000, overlap_score_weight: float = 1.0, seed: int = 0
    ) -> None:
        self.max_local_prefill_length = max_local_prefill_length
        self._kv_router = DynamoKV(overlap_score_weight=overlap_score_weight, seed=seed)
        self._rng = random.Random(seed + 1)

    def pair(self, request: RequestView, cluster: ClusterView) -> PDDecision:
        prefill_pool, decode_pool = phase_candidates(cluster)
        decode = cluster[self._kv_router.choose_among(request, cluster, decode_pool).instance_id]
        cached = cluster.prefix_match_of(request, decode.instance_id) * request.block_size
        uncached = request.num_tokens - min(request.num_tokens, cached)
        if uncached <= self.max_local_prefill_length:
            return PDDecision(decode.instance_id, decode.instance_id, f"{uncached} tokens: local")

        def idle(inst: InstanceView) -> float:
            return -float(max(inst.waiting_prefill_tokens, inst.pending_prefill_tokens))

        prefill = argbest(prefill_pool, idle, self._rng)
        return PDDecision(prefill.instance_id, decode.instance_id, f"{uncached} tokens: remote")
