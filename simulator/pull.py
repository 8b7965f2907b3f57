"""Cross-instance prefix pulls in the simulator: the links they queue on, the blocks they hold,
and what they did.

Contract:
- `PullConfig` turns pulls on in a fleet (`ClusterConfig.prefix_pull`): the rule's minimum gain
  and the link's bandwidth and latency. `pull_settings` gives the router its
  `scheduler.core.prefix_pull.PullSettings` from the latency model (prefill rate of one
  4k-token chunk, KV bytes per token).
- `PullLinks`: each instance has one NIC, egress and ingress; a pull of `seconds` starts once
  both the holder's egress and the destination's ingress are free, and holds both until it
  lands (first come, first served: contention between pulls). Engine steps never wait on it.
- The destination holds a pull's blocks under the engine core's `pull_carrier` (the agents'
  pulls do too), so caching them once landed is the block manager's own `cache_full_blocks`.
- `PullStats`: decisions by action, pulls started, landed, and fallbacks by reason (``no_room``:
  the destination could not reserve the blocks; ``holder_lost``: the holder's GPU no longer held
  the first of them; ``nothing_to_pull``: the destination's GPU held them all by then), bytes and
  seconds on the links, tokens landed and tokens the request then hit.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from scheduler.core.prefix_pull import PullSettings
from simulator.latency.base import LatencyModel

NO_ROOM = "no_room"
HOLDER_LOST = "holder_lost"
NOTHING_TO_PULL = "nothing_to_pull"


@dataclass(frozen=True, slots=True)
class PullConfig:
    min_gain_tokens: int = 2048  # llm-d's threshold
    bandwidth: float = 50e9  # bytes/s per NIC (400 Gb/s RDMA)
    latency_s: float = 50e-6  # per pull

    def __post_init__(self) -> None:
        if not (self.bandwidth > 0 and self.latency_s >= 0 and self.min_gain_tokens >= 0):
            raise ValueError("pull bandwidth > 0, latency >= 0 and min gain >= 0 are required")

    def time(self, nbytes: float) -> float:
        return nbytes / self.bandwidth + self.latency_s


def pull_settings(config: PullConfig, latency: LatencyModel) -> PullSettings:
    """The router's rule, priced with the fleet's latency model."""
    return PullSettings(
        prefill_tokens_per_s=4096 / latency.step_time([(4096, 0)], []),
        kv_bytes_per_token=latency.kv_bytes_per_token or 0.0,
        bandwidth=config.bandwidth,
        latency_s=config.latency_s,
        min_gain_tokens=config.min_gain_tokens,
    )


@dataclass(slots=True)
class PullStats:
    decided: dict[str, int] = field(default_factory=dict)  # by `PullAction` value
    started: int = 0
    landed: int = 0
    fallback: dict[str, int] = field(default_factory=dict)
    bytes_pulled: float = 0.0
    link_s: float = 0.0  # queueing on the NICs included
    tokens_landed: int = 0
    tokens_hit: int = 0  # of those, tokens the request was served from

    def count(self, table: dict[str, int], key: str) -> None:
        table[key] = table.get(key, 0) + 1


class PullLinks:
    """One NIC per instance: when its egress and its ingress are next free."""

    def __init__(self) -> None:
        self._egress_free: dict[str, float] = {}
        self._ingress_free: dict[str, float] = {}

    def reserve(self, src: str, dst: str, now: float, seconds: float) -> float:
        """Queue a pull of `seconds` from `src` to `dst`; returns when it lands."""
        start = max(now, self._egress_free.get(src, now), self._ingress_free.get(dst, now))
        end = start + seconds
        self._egress_free[src] = end
        self._ingress_free[dst] = end
        return end
