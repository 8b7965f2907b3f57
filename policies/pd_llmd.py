"""`llmd` P/D pairing: llm-d's P/D scheduling profiles with its threshold decider.

Source: llm-d inference scheduler (EPP) P/D configuration: a decode profile (`decode-filter`, then
the default scorers: `prefix-cache-scorer` 3, `queue-scorer` 2, `kv-cache-utilization-scorer` 2,
`max-score-picker`) runs first; the `pd-profile-handler` then compares the request's prompt tokens
not cached on the chosen decode instance with its `threshold`: below it, the decode instance serves
the whole request; otherwise a prefill profile (`prefill-filter` and the same scorers) picks the
prefill instance. Defaults: threshold 256 tokens (llm-d's examples range from 10 to a few hundred),
the weights above, seed 0.
"""

from __future__ import annotations

from policies.base import phase_candidates
from policies.pipeline import Pipeline
from policies.plugins.filters import DecodeFilter, PrefillFilter
from policies.plugins.pickers import MaxScorePicker
from policies.plugins.scorers import KVCacheUtilizationScorer, PrefixCacheScorer, QueueScorer
from policies.views import ClusterView, PDDecision, RequestView


def _profile(
    role_filter: PrefillFilter | DecodeFilter,
    weights: tuple[float, float, float],
    seed: int,
    name: str,
) -> Pipeline:
    prefix, queue, kv = weights
    return Pipeline(
        filters=[role_filter],
        scorers=[
            (PrefixCacheScorer(), prefix),
            (QueueScorer(), queue),
            (KVCacheUtilizationScorer(), kv),
        ],
        picker=MaxScorePicker(),
        seed=seed,
        name=name,
    )


class LlmdPD:
    name = "llmd"

    def __init__(
        self,
        threshold: int = 256,
        prefix_weight: float = 3.0,
        queue_weight: float = 2.0,
        kv_utilization_weight: float = 2.0,
        seed: int = 0,
    ) -> None:
        self.threshold = threshold
        weights = (prefix_weight, queue_weight, kv_utilization_weight)
        self._decode = _profile(DecodeFilter(), weights, seed, "llmd-decode")
        self._prefill = _profile(PrefillFilter(), weights, seed + 1, "llmd-prefill")

    def pair(self, request: RequestView, cluster: ClusterView) -> PDDecision:
        phase_candidates(cluster)  # both phases must have someone, or NoInstanceError
        decode = self._decode.choose(request, cluster).instance_id
        cached = cluster.prefix_match_of(request, decode) * request.block_size
        uncached = request.num_tokens - min(request.num_tokens, cached)
        if uncached < self.threshold:
            return PDDecision(decode, decode, f"{uncached} non-cached tokens < {self.threshold}")
        prefill = self._prefill.choose(request, cluster).instance_id
        return PDDecision(prefill, decode, f"{uncached} non-cached tokens: split")
