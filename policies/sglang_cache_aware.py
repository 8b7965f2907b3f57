"""`sglang_cache_aware`: SGLang router's cache-aware load balancing.

Source: sgl-router `cache_aware` policy (Rust, sgl-project/sglang). The router counts its own
in-flight requests per worker (`InstanceView.inflight`) and keeps an approximate radix tree per
worker; here the prefix index plays the tree's part.
- The system is *imbalanced* when (max load - min load) > `balance_abs_threshold` AND
  max load > `balance_rel_threshold` * min load; then the request goes to the least-loaded worker
  (shortest queue), ignoring the cache.
- Otherwise it goes to the worker with the longest prefix match if the match rate
  (matched tokens / prompt tokens) exceeds `cache_threshold`; else to the worker whose cache is
  smallest (SGLang: the smallest tree), to grow caches evenly.
Defaults: balance_abs_threshold 64, balance_rel_threshold 1.5, cache_threshold 0.3, seed 0 (ties).
"""

from __future__ import annotations

import random

from policies.base import argbest, candidates
from policies.views import ClusterView, Decision, RequestView


class SGLangCacheAware:
    name = "sglang_cache_aware"

    def __init__(
        self,
        balance_abs_threshold: int = 64,
        balance_rel_threshold: float = 1.5,
        cache_threshold: float = 0.3,
        seed: int = 0,
    ) -> None:
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold
        self.cache_threshold = cache_threshold
        self._rng = random.Random(seed)

    def choose(self, request: RequestView, cluster: ClusterView) -> Decision:
        pool = candidates(cluster)
        loads = [inst.inflight for inst in pool]
        max_load, min_load = max(loads), min(loads)
        imbalanced = (
            max_load - min_load > self.balance_abs_threshold
            and max_load > self.balance_rel_threshold * min_load
        )
        if imbalanced:
            best = argbest(pool, lambda i: -i.inflight, self._rng)
            scores = {i.instance_id: 0.0 - i.inflight for i in pool}
            return Decision(
                best.instance_id, scores, f"imbalanced: shortest queue ({best.inflight})"
            )
        matched = cluster.prefix_match(request)
        scores = {
            i.instance_id: min(
                1.0, matched.get(i.instance_id, 0) * request.block_size / max(1, request.num_tokens)
            )
            for i in pool
        }
        best = argbest(pool, lambda i: scores[i.instance_id], self._rng)
        rate = scores[best.instance_id]
        if rate > self.cache_threshold:
            return Decision(best.instance_id, scores, f"cache hit: match rate {rate:.2f}")
        smallest = argbest(pool, lambda i: -i.cached_blocks, self._rng)
        return Decision(
            smallest.instance_id,
            scores,
            f"match rate {rate:.2f} <= {self.cache_threshold}: smallest cache ({smallest.cached_blocks})",
        )
