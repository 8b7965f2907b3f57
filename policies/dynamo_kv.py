"""`dynamo_kv`: NVIDIA Dynamo's KV router cost function.

Source: ai-dynamo/dynamo `lib/llm/src/kv_router/scheduler.rs` (DefaultWorkerSelector) and its
router docs. For each worker, in blocks:
- potential prefill blocks = (tokens the worker still has to prefill for requests the router sent
  it + this request's tokens not covered by the worker's overlap) / block size;
- potential decode blocks = KV blocks of the router's active requests on the worker + this
  request's blocks;
- logit = `overlap_score_weight` * potential prefill blocks + potential decode blocks.
The lowest logit wins. With `temperature` 0 the choice is the argmin (ties at random); with
temperature > 0 logits are min-max normalised to [0, 1] and a worker is sampled with probability
proportional to exp(-logit / temperature). Defaults: overlap_score_weight 1.0, temperature 0.0,
seed 0. Decision scores are the negated logits.
KV tiers: Dynamo's router prices overlap blocks on lower tiers as a fraction of a device hit
(KVBM: `host_weight` 0.75 for host memory, `disk_weight` 0.25 for disk), so the overlap is the
weighted sum of the blocks matched per tier (`ClusterView.weighted_prefix_match`).
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence

from policies.base import argbest, candidates
from policies.views import ClusterView, Decision, InstanceView, RequestView


class DynamoKV:
    name = "dynamo_kv"

    def __init__(
        self,
        overlap_score_weight: float = 1.0,
        temperature: float = 0.0,
        seed: int = 0,
        host_weight: float = 0.75,
        disk_weight: float = 0.25,
    ) -> None:
        if temperature < 0:
            raise ValueError("temperature must be >= 0")
        self.overlap_score_weight = overlap_score_weight
        self.tier_weights = (1.0, host_weight, disk_weight)
        self.temperature = temperature
        self._rng = random.Random(seed)

    def logit(self, request: RequestView, inst: InstanceView, overlap_blocks: float) -> float:
        new_prefill_tokens = max(0, request.num_tokens - overlap_blocks * request.block_size)
        prefill_blocks = (inst.pending_prefill_tokens + new_prefill_tokens) / request.block_size
        decode_blocks = inst.inflight_blocks + request.num_blocks
        return self.overlap_score_weight * prefill_blocks + decode_blocks

    def choose(self, request: RequestView, cluster: ClusterView) -> Decision:
        return self.choose_among(request, cluster, candidates(cluster))

    def choose_among(
        self, request: RequestView, cluster: ClusterView, instances: Sequence[InstanceView]
    ) -> Decision:
        """The decision over `instances` only (a P/D policy's decode pool)."""
        pool = sorted(instances, key=lambda i: i.instance_id)
        matched = cluster.weighted_prefix_match(request, self.tier_weights)
        logits = {
            i.instance_id: self.logit(request, i, matched.get(i.instance_id, 0)) for i in pool
        }
        scores = {key: -value for key, value in logits.items()}
        if self.temperature == 0.0:
            best = argbest(pool, lambda i: scores[i.instance_id], self._rng)
            return Decision(best.instance_id, scores, f"lowest cost {logits[best.instance_id]:.1f}")
        low, high = min(logits.values()), max(logits.values())
        span = high - low or 1.0
        weights = [
            math.exp(-((logits[i.instance_id] - low) / span) / self.temperature) for i in pool
        ]
        chosen = self._rng.choices(pool, weights=weights, k=1)[0].instance_id
        return Decision(chosen, scores, f"softmax sample, cost {logits[chosen]:.1f}")
