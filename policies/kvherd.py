"""`kvherd` (the default): least estimated time-to-first-token, counting the work it adds.

Contract: `choose(request, cluster)` scores each candidate by `ttft_cost`, in prefill-token
equivalents: queued prefill + `uncached_weight` x uncached prompt tokens + lower-tier load +
`decode_token_cost` x running + a KV-memory shortfall penalty + a LoRA slot cost; the lowest wins,
behind a hot-spot guard, ties to the longer match then at random under `seed`. Then three steps:
`spread` (a new prefix goes to the near-cheapest instance whose index holds the fewest blocks),
an SLO step (`RequestView.slo_ttft_s` against the learned `ClusterView.predict_ttft`) and, with
`learned_cost`, the soonest predicted. Scores are the negated costs of the `explain_top` cheapest.
Fleets above `SMALL_FLEET` are scored over numpy columns, smaller ones in plain Python, with the
very same costs, ties and scores. The terms, their defaults and the measurements behind them:
docs/policies.md ("The default in full").
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from typing import TypeVar

import numpy as np

from policies.lora_affinity import FREE_SLOT, LOADED, affinity
from policies.views import ClusterView, Decision, InstanceView, NoInstanceError, RequestView

SMALL_FLEET = 16
# One instance's figure (a number) or every instance's (a float64 array): `KvherdDispatch.ttft_cost`.
Figure = TypeVar("Figure", float, np.ndarray)

# Up to this many instances, `_cheapest` sorts every cost (measured: one argsort of 256 costs
# beats partition-then-sort; at 1,024 the partition wins).
_SORT_WHOLE_FLEET = 512


class KvherdDispatch:
    name = "kvherd"

    def __init__(
        self,
        decode_token_cost: float = 32.0,
        uncached_weight: float = 4.0,
        memory_penalty: float = 2.0,
        balance_abs_threshold: int = 128,
        balance_rel_threshold: float = 2.0,
        explain_top: int = 16,
        seed: int = 0,
        cpu_load_ratio: float = 0.05,
        storage_load_ratio: float = 0.4,
        lora_load_tokens: float = 256.0,
        lora_evict_tokens: float = 2048.0,
        learned_cost: bool = False,
        spread_slack: float = 64.0,
        spread_match_ratio: float = 0.5,
    ) -> None:
        self.decode_token_cost = decode_token_cost
        self.uncached_weight = uncached_weight
        self.memory_penalty = memory_penalty
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold
        self.explain_top = explain_top
        self.cpu_load_ratio = cpu_load_ratio
        self.storage_load_ratio = storage_load_ratio
        self.lora_load_tokens = lora_load_tokens
        self.lora_evict_tokens = lora_evict_tokens
        self.learned_cost = learned_cost
        self.spread_slack = spread_slack
        self.spread_match_ratio = spread_match_ratio
        self._rng = random.Random(seed)

    def ttft_cost(
        self,
        request: RequestView,
        queued: Figure,
        matched: Figure,
        running: Figure,
        shortfall: Figure | None,
        capacity_known: Figure,
        maximum: Callable[[Figure, float], Figure],
        lower: Figure | float = 0.0,
        load: Figure | float = 0.0,
    ) -> Figure:
        """The cost, written once: estimated TTFT in prefill-token equivalents (module docstring)
        over one instance's figures (numbers, `maximum` = `max`) or every instance's columns
        (float64 arrays, `maximum` = `np.maximum`). `queued` is max(waiting, pending) prefill
        tokens, `matched` the GPU blocks cached, `lower` the blocks continuing them on lower tiers
        and `load` their load time in prefill tokens (`load_tokens`), `shortfall` head-of-line
        waiting blocks minus free blocks (None: the memory term is 0, as no instance is short,
        cached or not, or the one instance's capacity is unknown), `capacity_known` 1 where the
        instance's KV capacity is known."""
        bs = request.block_size
        # Prompt tokens cached on no tier.
        uncached = maximum((matched + lower) * -bs + request.num_tokens, 0.0)
        cost = queued + self.uncached_weight * uncached + load + self.decode_token_cost * running
        if shortfall is None:
            return cost
        # Memory: uncached blocks beyond the free ones the head-of-line waiting request leaves.
        short = maximum(shortfall - matched + request.num_blocks, 0.0)
        return cost + self.memory_penalty * bs * short * capacity_known

    def lora_tokens(self, adapter: str | None, inst: InstanceView) -> float:
        """The adapter term of the cost: what getting `adapter` into a slot of `inst` costs."""
        score = affinity(adapter, inst)
        if score == LOADED:
            return 0.0
        return self.lora_load_tokens if score == FREE_SLOT else self.lora_evict_tokens

    def load_tokens(
        self,
        request: RequestView,
        cpu_blocks: Figure,
        storage_blocks: Figure,
        cpu_ratio: Figure,
        storage_ratio: Figure,
    ) -> Figure:
        """Load time of the lower-tier blocks in prefill tokens (a ratio of 0: the default)."""
        if not isinstance(cpu_ratio, np.ndarray):
            cpu_ratio = cpu_ratio or self.cpu_load_ratio
            storage_ratio = storage_ratio or self.storage_load_ratio
        else:
            cpu_ratio = np.where(cpu_ratio > 0, cpu_ratio, self.cpu_load_ratio)
            storage_ratio = np.where(storage_ratio > 0, storage_ratio, self.storage_load_ratio)
        return (cpu_blocks * cpu_ratio + storage_blocks * storage_ratio) * request.block_size

    def cost(
        self,
        request: RequestView,
        inst: InstanceView,
        matched_blocks: float,
        cpu_blocks: float = 0.0,
        storage_blocks: float = 0.0,
    ) -> float:
        """`ttft_cost` for one instance (`matched_blocks` on its GPU, then lower-tier blocks)."""
        load = 0.0
        if cpu_blocks or storage_blocks:
            load = self.load_tokens(
                request, cpu_blocks, storage_blocks, inst.cpu_load_ratio, inst.storage_load_ratio
            )
        lora = 0.0 if request.adapter is None else self.lora_tokens(request.adapter, inst)
        return lora + self.ttft_cost(
            request,
            max(inst.waiting_prefill_tokens, inst.pending_prefill_tokens),
            matched_blocks,
            inst.num_running,
            inst.head_waiting_blocks - inst.free_blocks if inst.capacity > 0 else None,
            1,
            max,
            cpu_blocks + storage_blocks,
            load,
        )

    def costs(self, request: RequestView, cluster: ClusterView) -> tuple[np.ndarray, np.ndarray]:
        """`ttft_cost` for every instance at once (inf where it may not be chosen), and matched blocks.

        On a large fleet each numpy call costs more in dispatch than in arithmetic, so the number
        of calls is the decision's cost.
        """
        tiers = cluster.prefix_match_tiers(request) if cluster.has_lower_tiers else None
        matched = cluster.prefix_match_array(request) if tiers is None else tiers[0]
        column = cluster.column
        # Queued prefill: what the instance reported waiting, or what the router itself sent that has
        # not produced a first token (this also covers chunked prefills already running).
        queued = np.maximum(column("waiting_prefill_tokens"), column("pending_prefill_tokens"))
        short_by = column("head_waiting_blocks") - column("free_blocks")
        # None where no instance is short of blocks, cached or not: the memory term is 0 anyway.
        shortfall = short_by if short_by.max() + request.num_blocks > 0 else None
        lower, load = 0.0, 0.0
        if tiers is not None and tiers[1:].any():
            lower = tiers[1] + tiers[2]
            load = self.load_tokens(
                request,
                tiers[1],
                tiers[2],
                column("cpu_load_ratio"),
                column("storage_load_ratio"),
            )
        cost = self.ttft_cost(
            request,
            queued,
            matched,
            column("num_running"),
            shortfall,
            column("capacity") > 0,
            np.maximum,
            lower,
            load,
        )
        if request.adapter is not None:
            cost = cost + [self.lora_tokens(request.adapter, inst) for inst in cluster.instances]
        dispatchable = column("dispatchable")
        inflight = column("inflight")
        if dispatchable.all():  # the usual case: only the hot-spot guard can exclude
            least = inflight.min()
            if inflight.max() - least > self.balance_abs_threshold:
                cost[self._hot(inflight, least)] = np.inf
            return cost, matched
        allowed = dispatchable > 0
        if not allowed.any():
            raise NoInstanceError(f"no dispatchable instance among {len(cluster)} registered")
        least = inflight[allowed].min()
        cost[~allowed | self._hot(inflight, least)] = np.inf
        return cost, matched

    def _hot(self, inflight: np.ndarray, least: float) -> np.ndarray:
        """Instances too far above the least-loaded one, in absolute and relative terms."""
        return (inflight - least > self.balance_abs_threshold) & (
            inflight > self.balance_rel_threshold * least
        )

    def choose(self, request: RequestView, cluster: ClusterView) -> Decision:
        if len(cluster.instances) <= SMALL_FLEET:
            decision = self.choose_scalar(request, cluster)
        else:
            decision = self.choose_vectorised(request, cluster)
        if self.spread_slack > 0 and len(decision.scores) > 1:
            decision = self.spread(request, cluster, decision)
        if request.slo_ttft_s is None and not self.learned_cost:
            return decision
        predicted = self._predicted(request, cluster, decision)
        if predicted is None:
            return decision  # nothing learned yet: the formula decides
        slo = request.slo_ttft_s
        if slo is None:  # learned_cost: the soonest predicted
            pick = min(predicted, key=predicted.__getitem__)
            if pick == decision.instance_id:
                return decision
            why = f"soonest predicted TTFT: {1000 * predicted[pick]:.0f} ms"
        elif predicted[decision.instance_id] <= slo:
            return decision
        elif meets := [i for i, t in predicted.items() if t <= slo]:
            pick = max(meets, key=decision.scores.__getitem__)  # scores are negated costs
            why = f"cheapest predicted within the TTFT SLO: {1000 * predicted[pick]:.0f} ms"
        else:
            pick = min(predicted, key=predicted.__getitem__)
            why = f"none predicted within the TTFT SLO: the soonest, {1000 * predicted[pick]:.0f} ms"
        return Decision(pick, decision.scores, why)

    def spread(self, request: RequestView, cluster: ClusterView, decision: Decision) -> Decision:
        """The spread step: a request that no candidate caches `spread_match_ratio` of (a new
        prefix) goes, among the candidates within `spread_slack` (64: two running requests) of
        the cheapest cost, to the one whose index and in-flight requests hold the fewest blocks;
        its later requests follow it there by affinity. A burst still spreads by load."""
        blocks = request.num_blocks
        if not blocks or any(
            cluster.prefix_match_of(request, i) > self.spread_match_ratio * blocks
            for i in decision.scores
        ):
            return decision
        floor = decision.scores[decision.instance_id] - self.spread_slack  # scores: -cost
        near = [i for i, score in decision.scores.items() if score >= floor]
        def drawn(i: str) -> int:  # blocks it holds and blocks its requests in flight will hold
            return cluster.indexed_blocks(i) + cluster[i].inflight_blocks

        pick = min(near, key=lambda i: (drawn(i), i != decision.instance_id))
        if pick == decision.instance_id:
            return decision
        why = f"new prefix: the fewest indexed and in-flight blocks ({drawn(pick)}) near the cheapest"
        return Decision(pick, decision.scores, why)

    @staticmethod
    def _predicted(
        request: RequestView, cluster: ClusterView, decision: Decision
    ) -> dict[str, float] | None:
        """Predicted TTFT (`ClusterView.predict_ttft`) of the cheapest candidates
        (`decision.scores`, the pick among them); None while the model cannot predict one."""
        predicted: dict[str, float] = {}
        for instance_id in decision.scores or (decision.instance_id,):
            matched = cluster.prefix_match_of(request, instance_id)
            cached = min(request.num_tokens, matched * request.block_size)
            guess = cluster.predict_ttft(request, cluster[instance_id], cached)
            if guess is None:
                return None
            predicted[instance_id] = guess
        if decision.instance_id not in predicted:
            return None
        return predicted

    def choose_scalar(self, request: RequestView, cluster: ClusterView) -> Decision:
        """`choose_vectorised`'s decision, one instance at a time."""
        instances = cluster.instances
        allowed = [inst.dispatchable for inst in instances]
        if not any(allowed):
            raise NoInstanceError(f"no dispatchable instance among {len(cluster)} registered")
        least = min(inst.inflight for inst, ok in zip(instances, allowed, strict=True) if ok)
        # The core's one form of the match: arrays (GPU only while no instance holds lower tiers).
        cpu: list[float] = []
        storage: list[float] = []
        if cluster.has_lower_tiers:
            tiers = cluster.prefix_match_tiers(request)
            matched = tiers[0].tolist()
            if tiers[1:].any():
                cpu, storage = tiers[1].tolist(), tiers[2].tolist()
        else:
            matched = cluster.prefix_match_array(request).tolist()
        cost = [
            self.cost(request, inst, blocks, *((cpu[i], storage[i]) if cpu else ()))
            if ok
            and not (
                inst.inflight - least > self.balance_abs_threshold
                and inst.inflight > self.balance_rel_threshold * least
            )
            else math.inf
            for i, (inst, blocks, ok) in enumerate(zip(instances, matched, allowed, strict=True))
        ]
        lowest = min(cost)
        tied = [i for i, c in enumerate(cost) if c == lowest]
        if len(tied) > 1:  # prefer the longer cached prefix, then a seeded coin
            deepest = max(matched[i] for i in tied)
            tied = [i for i in tied if matched[i] == deepest]
        pick = tied[0] if len(tied) == 1 else self._rng.choice(tied)
        ranked = sorted(range(len(cost)), key=cost.__getitem__)
        top = [i for i in ranked if cost[i] != math.inf][: max(self.explain_top, 0)]
        scores = {instances[i].instance_id: -float(cost[i]) for i in top}
        best = instances[pick]
        scores[best.instance_id] = -float(lowest)
        return Decision(
            best.instance_id,
            scores,
            f"lowest est. TTFT cost {lowest:.0f} tokens ({int(matched[pick])} cached blocks)",
        )

    def choose_vectorised(self, request: RequestView, cluster: ClusterView) -> Decision:
        cost, matched = self.costs(request, cluster)
        lowest = cost.min()
        tied = (cost == lowest).nonzero()[0]
        if len(tied) > 1:  # prefer the longer cached prefix, then a seeded coin
            tied = tied[matched[tied] == matched[tied].max()]
        pick = int(tied[0]) if len(tied) == 1 else int(self._rng.choice(tied.tolist()))
        instances = cluster.instances
        best = instances[pick]
        top = self._cheapest(cost)
        scores = {
            instances[i].instance_id: score
            for i, score in zip(top.tolist(), (-cost[top]).tolist(), strict=True)
        }
        scores[best.instance_id] = -float(lowest)
        return Decision(
            best.instance_id,
            scores,
            f"lowest est. TTFT cost {lowest:.0f} tokens ({int(matched[pick])} cached blocks)",
        )

    def _cheapest(self, cost: np.ndarray) -> np.ndarray:
        """Positions of the `explain_top` lowest finite costs, cheapest first, ties by position."""
        top = self.explain_top
        if top <= 0:
            return np.zeros(0, dtype=np.intp)
        if len(cost) <= _SORT_WHOLE_FLEET:  # one stable sort costs less than the calls it saves
            ranked = np.argsort(cost, kind="stable")[:top]
            return ranked[np.isfinite(cost[ranked])]
        if top < len(cost):
            # Only costs up to the top-th smallest can be among the top: sort those, not the fleet.
            bound = np.partition(cost, top - 1)[top - 1]
            candidates = np.flatnonzero(cost <= bound)
        else:
            candidates = np.arange(len(cost))
        ranked = candidates[np.argsort(cost[candidates], kind="stable")]
        return ranked[np.isfinite(cost[ranked])][:top]
