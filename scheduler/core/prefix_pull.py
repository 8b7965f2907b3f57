"""Cross-instance prefix pull: recompute a prefix, route to its holder, or pull its blocks.

Contract:
- `choose_pull(request, cluster, preferred, settings)` runs after the dispatch policy preferred
  `preferred` (P). The holder H is the dispatchable instance with the deepest prefix of the
  request on any tier (`ClusterView.prefix_match_tiers`; ties: more of it on GPU, then the first).
  Unless H's depth exceeds P's by at least `min_gain_tokens` (llm-d's 2,048), the answer is
  RECOMPUTE at P with no estimate: P already holds about as much as anyone.
- Otherwise it estimates TTFT in seconds, Mooncake-style, for three plans and picks the lowest
  (ties: recompute, then pull, then route: staying put and keeping the policy's pick cost least):
    recompute  queue(P) + load(P's lower-tier hits) + prefill(prompt past P's depth)
    route      queue(H) + load(H's lower-tier hits) + prefill(prompt past H's depth)
    pull       transfer(H's blocks past P's GPU hits) + queue(P) + prefill(prompt past H's depth)
  A pull copies only the blocks H is known to hold (`ClusterView.confirmed_depth`: its KV events
  said so), not those the match counts because requests were routed there and may still be
  prefilling; with none past P's depth there is no pull plan.
  queue(X) = max(waiting, pending prefill tokens) + `decode_token_cost` x running, load = tier
  tokens x the instance's load ratio (`cpu_load_ratio`/`storage_load_ratio` where unknown), both
  in prefill tokens over `prefill_tokens_per_s`; transfer = bytes / `bandwidth` + `latency_s`,
  plus H's disk-held blocks read at H's storage load ratio. Pulled blocks land on P's GPU, so they
  replace P's own lower-tier hits. The last prompt token is always prefilled.
- Pure: no I/O, no clock. The router asks it (`Router(..., pull=PullSettings(...))`); the driver
  (the simulator, the agents) moves the blocks of a PULL before the request's prefill.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

import numpy as np

from policies.views import ClusterView, InstanceView, RequestView


class PullAction(StrEnum):
    RECOMPUTE = "recompute"  # run at the preferred instance with what it holds
    ROUTE = "route"  # run at the holder instead
    PULL = "pull"  # copy the holder's blocks to the preferred instance, then run there


@dataclass(frozen=True, slots=True)
class PullSettings:
    prefill_tokens_per_s: float  # the fleet's prefill rate (one long chunk)
    kv_bytes_per_token: float  # KV bytes one token takes (all layers)
    bandwidth: float = 50e9  # bytes/s between two instances (400 Gb/s RDMA)
    latency_s: float = 50e-6  # per pull: control round trip and copy set-up
    min_gain_tokens: int = 2048  # prefix tokens the holder must add over the preferred instance
    decode_token_cost: float = 32.0  # a running request's share of each step, in prefill tokens
    cpu_load_ratio: float = 0.05  # where an instance's own is unknown (0), as `policies.kvherd`
    storage_load_ratio: float = 0.4

    def __post_init__(self) -> None:
        if not (self.prefill_tokens_per_s > 0 and self.bandwidth > 0):
            raise ValueError("prefill_tokens_per_s and bandwidth must be positive")
        if not (self.kv_bytes_per_token >= 0 and self.latency_s >= 0 and self.min_gain_tokens >= 0):
            raise ValueError("kv_bytes_per_token, latency_s and min_gain_tokens must be >= 0")


@dataclass(frozen=True, slots=True)
class PullChoice:
    """Where the request runs and, for a PULL, which of its blocks come from where.

    `first_block`/`num_blocks`: the request's block positions to copy from `source` (the blocks
    past the preferred instance's GPU hits, up to the holder's depth). `estimates`: TTFT in
    seconds per plan considered (empty when no holder was worth it)."""

    action: PullAction
    instance_id: str
    source: str | None = None
    first_block: int = 0
    num_blocks: int = 0
    estimates: dict[PullAction, float] = field(default_factory=dict)

    @property
    def reason(self) -> str:
        if not self.estimates:
            return "no holder worth a pull"
        plans = ", ".join(f"{a.value} {s * 1e3:.0f} ms" for a, s in self.estimates.items())
        return f"{self.action.value} (est. TTFT: {plans})"


def choose_pull(
    request: RequestView, cluster: ClusterView, preferred: str, settings: PullSettings
) -> PullChoice:
    """Recompute at `preferred`, route to the holder, or pull from it (module contract)."""
    stay = PullChoice(PullAction.RECOMPUTE, preferred)
    if not request.block_hashes:
        return stay
    tiers = cluster.prefix_match_tiers(request)
    bs = request.block_size
    usable = (request.num_tokens - 1) // bs  # the last token is always computed
    depth = np.minimum(tiers.sum(axis=0), usable)
    p = cluster.index_of(preferred)
    allowed = np.fromiter((inst.dispatchable for inst in cluster.instances), bool)
    # Deepest first, then most on GPU, then position (lexsort's last key is the primary one).
    keys = np.where(allowed, depth, -1.0)
    order = np.lexsort((np.arange(len(keys)), -tiers[0], -keys))
    h = int(order[0])
    if h == p or keys[h] < 0 or (depth[h] - depth[p]) * bs < settings.min_gain_tokens:
        return stay
    holder = cluster.instances[h]
    rate = settings.prefill_tokens_per_s
    here = cluster.instances[p]
    recompute = (
        _queue(here, settings) + _load(here, tiers[1:, p], bs, settings) + _rest(request, depth[p])
    ) / rate
    route = (
        _queue(holder, settings)
        + _load(holder, tiers[1:, h], bs, settings)
        + _rest(request, depth[h])
    ) / rate
    estimates = {PullAction.RECOMPUTE: recompute, PullAction.ROUTE: route}
    first, end = int(min(tiers[0, p], depth[h])), int(depth[h])
    known = cluster.confirmed_depth(request, holder.instance_id)
    if known is not None:  # blocks only routed to the holder are not there to copy yet
        end = min(end, known)
    if end > depth[p]:
        transfer = _transfer_s(holder, tiers[:, h], first, end, bs, settings)
        estimates[PullAction.PULL] = (
            transfer + (_queue(here, settings) + _rest(request, end)) / rate
        )
    ties = (PullAction.RECOMPUTE, PullAction.PULL, PullAction.ROUTE)  # the contract's order
    best = min((a for a in ties if a in estimates), key=estimates.__getitem__)
    if best is PullAction.PULL:
        return PullChoice(best, preferred, holder.instance_id, first, end - first, estimates)
    if best is PullAction.ROUTE:
        return PullChoice(best, holder.instance_id, estimates=estimates)
    return PullChoice(best, preferred, estimates=estimates)


def _queue(inst: InstanceView, settings: PullSettings) -> float:
    """Prefill tokens of work ahead of the request on `inst`."""
    queued = max(inst.waiting_prefill_tokens, inst.pending_prefill_tokens)
    return queued + settings.decode_token_cost * inst.num_running


def _ratios(inst: InstanceView, settings: PullSettings) -> tuple[float, float]:
    return (
        inst.cpu_load_ratio or settings.cpu_load_ratio,
        inst.storage_load_ratio or settings.storage_load_ratio,
    )


def _load(inst: InstanceView, lower: np.ndarray, bs: int, settings: PullSettings) -> float:
    """Prefill tokens the load of `lower` (CPU, STORAGE blocks) costs on `inst`."""
    cpu, storage = _ratios(inst, settings)
    return float(lower[0] * cpu + lower[1] * storage) * bs


def _rest(request: RequestView, depth: float) -> float:
    """Prompt tokens left to prefill past `depth` blocks."""
    return max(request.num_tokens - depth * request.block_size, 1)


def _transfer_s(
    holder: InstanceView,
    tiers: np.ndarray,
    first: int,
    end: int,
    bs: int,
    settings: PullSettings,
) -> float:
    """Seconds to copy block positions [first, end) from `holder`: over the link, plus reading
    the ones on its disk (its GPU and host-DRAM blocks go straight out on the link)."""
    on_disk_from = int(tiers[0] + tiers[1])  # positions past GPU and CPU: the disk's
    disk_blocks = max(0, end - max(first, on_disk_from))
    nbytes = (end - first) * bs * settings.kv_bytes_per_token
    read_s = disk_blocks * bs * _ratios(holder, settings)[1] / settings.prefill_tokens_per_s
    return nbytes / settings.bandwidth + settings.latency_s + read_s
