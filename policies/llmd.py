"""`llmd`: llm-d's default scheduling profile.

Source: llm-d inference scheduler (gateway-api-inference-extension EPP) default configuration:
`prefix-cache-scorer` weight 3, `queue-scorer` weight 2, `kv-cache-utilization-scorer` weight 2,
`max-score-picker`. Scorers (see `policies.plugins.scorers`): prefix = cached fraction of the
request's blocks; queue = min-max normalised waiting-queue length (all equal -> 1);
KV utilisation = 1 - usage. Ties are broken at random under `seed` (default 0).
"""

from __future__ import annotations

from policies.pipeline import Pipeline
from policies.plugins.pickers import MaxScorePicker
from policies.plugins.scorers import KVCacheUtilizationScorer, PrefixCacheScorer, QueueScorer


class Llmd(Pipeline):
    def __init__(
        self,
        prefix_weight: float = 3.0,
        queue_weight: float = 2.0,
        kv_utilization_weight: float = 2.0,
        seed: int = 0,
    ) -> None:
        super().__init__(
            scorers=[
                (PrefixCacheScorer(), prefix_weight),
                (QueueScorer(), queue_weight),
                (KVCacheUtilizationScorer(), kv_utilization_weight),
            ],
            picker=MaxScorePicker(),
            seed=seed,
            name="llmd",
        )
