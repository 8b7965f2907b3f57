"""Pipeline scorers: each maps every candidate instance to a score in [0, 1], higher is better.

Contract: ``score(request, cluster, instances) -> dict[instance_id, float]`` with a value in [0, 1]
for every instance given. The pipeline multiplies by the scorer's weight and sums. Defaults follow
llm-d's inference scheduler (gateway-api-inference-extension) scorers.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from policies.views import ClusterView, InstanceView, RequestView


def min_max_lower_is_better(values: dict[str, float]) -> dict[str, float]:
    """(max - v) / (max - min); every instance scores 1 when all are equal (llm-d's convention)."""
    if not values:
        return {}
    low, high = min(values.values()), max(values.values())
    if high == low:
        return dict.fromkeys(values, 1.0)
    return {key: (high - v) / (high - low) for key, v in values.items()}


class PrefixCacheScorer:
    """`prefix-cache-scorer`: fraction of the request's blocks already cached on the instance,
    a block on a lower tier counting as its tier's weight (llm-d's KV-cache scorer backends:
    `gpu_weight` 1.0, `cpu_weight` 0.8; its defaults name no disk tier: `storage_weight` 0)."""

    type_name = "prefix-cache-scorer"

    def __init__(
        self, gpu_weight: float = 1.0, cpu_weight: float = 0.8, storage_weight: float = 0.0
    ) -> None:
        self.tier_weights = (gpu_weight, cpu_weight, storage_weight)

    def score(
        self, request: RequestView, cluster: ClusterView, instances: Sequence[InstanceView]
    ) -> dict[str, float]:
        total = len(request.block_hashes)
        if total == 0:
            return {inst.instance_id: 0.0 for inst in instances}
        matched = cluster.weighted_prefix_match(request, self.tier_weights)
        return {inst.instance_id: matched.get(inst.instance_id, 0) / total for inst in instances}


class QueueScorer:
    """`queue-scorer`: shorter waiting queue scores higher, min-max normalised over candidates."""

    type_name = "queue-scorer"

    def score(
        self, request: RequestView, cluster: ClusterView, instances: Sequence[InstanceView]
    ) -> dict[str, float]:
        return min_max_lower_is_better({i.instance_id: float(i.num_waiting) for i in instances})


class KVCacheUtilizationScorer:
    """`kv-cache-utilization-scorer`: 1 - KV cache usage."""

    type_name = "kv-cache-utilization-scorer"

    def score(
        self, request: RequestView, cluster: ClusterView, instances: Sequence[InstanceView]
    ) -> dict[str, float]:
        return {i.instance_id: min(1.0, max(0.0, 1.0 - i.kv_usage)) for i in instances}


class ActiveRequestScorer:
    """`active-request-scorer`: fewer requests (running + waiting) scores higher, min-max."""

    type_name = "active-request-scorer"

    def score(
        self, request: RequestView, cluster: ClusterView, instances: Sequence[InstanceView]
    ) -> dict[str, float]:
        return min_max_lower_is_better({i.instance_id: float(i.num_requests) for i in instances})


class FreenessScorer:
    """`freeness-scorer`: Llumnix freeness, min-max normalised; idle instances (inf) score 1."""

    type_name = "freeness-scorer"

    def score(
        self, request: RequestView, cluster: ClusterView, instances: Sequence[InstanceView]
    ) -> dict[str, float]:
        finite = [i.freeness for i in instances if math.isfinite(i.freeness)]
        cap = (max(finite) + 1.0) if finite else 1.0  # idle beats the freest busy instance
        return min_max_lower_is_better({i.instance_id: -min(i.freeness, cap) for i in instances})
