"""Cross-instance prefix pull: recompute a prefix, route to its holder, or pull its blocks.

Contract:
- `choose_pull(request, cluster, preferred, settings, peers)` runs after the dispatch policy
  preferred `preferred` (P). The holder H is the dispatchable instance with the deepest prefix of
  the request on any tier (`ClusterView.prefix_match_tiers`; ties: more of it on GPU, then the
  first). Unless H's depth exceeds P's by at least `min_gain_tokens` (llm-d's 2,048), the answer is
  RECOMPUTE at P with no estimate. Otherwise it estimates TTFT in seconds, Mooncake-style, and picks
  the lowest (ties: recompute, then pull, then route: staying put costs least):
    recompute  queue(P) + load(P's lower-tier hits) + prefill(prompt past P's depth)
    route      queue(H) + load(H's lower-tier hits) + prefill(prompt past H's depth)
    pull       transfer(S's blocks past P's GPU hits) + queue(P) + prefill(prompt past S's end)
- The pull's source S is the dispatchable instance (H or another) that can send the deepest prefix
  past P's depth: `peers(instance_id)` (a `PullPeer`; default: every instance a kvherd agent) says
  whether it has a block server, of which engine kind (blocks move only between two of one kind)
  and which tiers that server sends: an agent its GPU cache alone (`instance_agent.prefix_pull`),
  vLLM's kvherd connector its host store and disk tier, which keep a copy of every full block its
  GPU computed (`kvherd.vllm_connector`), so every tier. S sends at most the blocks it is known to
  hold (`ClusterView.confirmed_depth`: its KV events said so, not blocks only routed there); with
  none past P's depth there is no pull plan. Nothing else is priced: a pull the rule picks is one
  the fleet can send.
  queue(X) = max(waiting, pending prefill tokens) + `decode_token_cost` x running, load = tier
  tokens x the instance's load ratio (`cpu_load_ratio`/`storage_load_ratio` where unknown), both
  in prefill tokens over `prefill_tokens_per_s`; transfer = bytes / `bandwidth` + `latency_s`,
  plus S's disk-held blocks read at its storage load ratio. Pulled blocks land on P's GPU, so they
  replace P's own lower-tier hits. The last prompt token is always prefilled.
- Pure: no I/O, no clock. The router asks it (`Router(..., pull=PullSettings(...), peers=...)`);
  the driver (the simulator, the proxy) moves the blocks of a PULL before the request's prefill.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum

import numpy as np

from policies.views import ClusterView, InstanceView, RequestView


class PullAction(StrEnum):
    RECOMPUTE = "recompute"  # run at the preferred instance with what it holds
    ROUTE = "route"  # run at the holder instead
    PULL = "pull"  # copy the holder's blocks to the preferred instance, then run there


@dataclass(frozen=True, slots=True)
class PullPeer:
    """What an instance can do in a pull (module contract)."""

    engine: str  # its engine kind: "kvherd" (an agent) or "vllm" (with kvherd's connector)
    serves: bool = True  # it runs a block server (the proxy knows its `pull_address`)
    lower_tiers: bool = False  # that server sends its host-DRAM and disk blocks too


AGENT = PullPeer("kvherd")  # what the simulator's instances are


def pull_peer(kvherd_agent: bool, pull_address: str | None) -> PullPeer:
    """An instance's `PullPeer` from what the proxy knows of it (module contract)."""
    if kvherd_agent:
        return PullPeer("kvherd", pull_address is not None)
    return PullPeer("vllm", pull_address is not None, lower_tiers=True)


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
    request: RequestView,
    cluster: ClusterView,
    preferred: str,
    settings: PullSettings,
    peers: Callable[[str], PullPeer] | None = None,
) -> PullChoice:
    """Recompute at `preferred`, route to the holder, or pull from a source (module contract)."""
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
    found = _source(request, cluster, p, order, keys, tiers, usable, peers or _agents)
    if found is not None:
        s, end = found
        first = int(min(tiers[0, p], end))
        source = cluster.instances[s]
        transfer = _transfer_s(source, tiers[:, s], first, end, bs, settings)
        estimates[PullAction.PULL] = (
            transfer + (_queue(here, settings) + _rest(request, end)) / rate
        )
    ties = (PullAction.RECOMPUTE, PullAction.PULL, PullAction.ROUTE)  # the contract's order
    best = min((a for a in ties if a in estimates), key=estimates.__getitem__)
    if best is PullAction.PULL:
        assert found is not None
        source_id = cluster.instances[found[0]].instance_id
        return PullChoice(best, preferred, source_id, first, end - first, estimates)
    if best is PullAction.ROUTE:
        return PullChoice(best, holder.instance_id, estimates=estimates)
    return PullChoice(best, preferred, estimates=estimates)


def _agents(instance_id: str) -> PullPeer:
    return AGENT


def _source(
    request: RequestView,
    cluster: ClusterView,
    p: int,
    order: np.ndarray,
    keys: np.ndarray,
    tiers: np.ndarray,
    usable: int,
    peers: Callable[[str], PullPeer],
) -> tuple[int, int] | None:
    """The instance that can send the deepest prefix past P's depth, and that depth in blocks
    (its sendable blocks: the tiers its block server sends, only those it is known to hold)."""
    engine = peers(cluster.instances[p].instance_id).engine
    best: tuple[int, int] | None = None
    floor = int(keys[p])  # a source must send past P's depth (and past the best one found)
    for i in order.tolist():
        if keys[i] <= floor:
            break  # `order` is deepest first: nothing further can send more
        if i == p:
            continue
        instance_id = cluster.instances[i].instance_id
        peer = peers(instance_id)
        if not peer.serves or peer.engine != engine:
            continue
        end = int(keys[i] if peer.lower_tiers else min(tiers[0, i], usable))
        known = cluster.confirmed_depth(request, instance_id)
        if known is not None:  # blocks only routed there are not there to copy yet
            end = min(end, known)
        if end > floor:
            best, floor = (i, end), end
    return best


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
    the ones on its disk (its GPU and host-DRAM blocks go straight out on the link; an agent,
    which sends only GPU blocks, has none of them past its GPU run)."""
    on_disk_from = int(tiers[0] + tiers[1])  # positions past GPU and CPU: the disk's
    disk_blocks = max(0, end - max(first, on_disk_from))
    nbytes = (end - first) * bs * settings.kv_bytes_per_token
    read_s = disk_blocks * bs * _ratios(holder, settings)[1] / settings.prefill_tokens_per_s
    return nbytes / settings.bandwidth + settings.latency_s + read_s
