"""KV transfer time between two simulated instances: a bandwidth and a per-transfer latency per link.

Contract:
- `TransferLink(name, bandwidth, latency_s)`: `time(nbytes)` = nbytes / bandwidth (bytes/s) +
  latency_s, for one copy (one migration stage: its control round trip and its blocks). Every KV
  copy in the simulator is timed by one: live migrations by the fleet's migration link
  (`ClusterConfig.migration_bandwidth`, `migration_stage_latency_s`), P/D handoffs by the link
  between their prefill and decode instances.
- `LINKS` holds the presets (`link(name)`): ``nvlink`` 450 GB/s per direction (H100 NVLink 4, 900
  GB/s both ways), ``rdma400`` 400 Gb/s = 50 GB/s, ``rdma100`` 100 Gb/s = 12.5 GB/s, each with a
  per-transfer latency (a GPU-direct copy's set-up plus the stage's control message).
- `TransferModel(default, pairs)`: the link between two instances, `pairs[(src, dst)]` where given,
  else `default`.
- KV bytes per block come from the latency model (`LatencyModel.kv_bytes_per_token` x block size);
  this module only times bytes.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace


@dataclass(frozen=True, slots=True)
class TransferLink:
    name: str
    bandwidth: float  # bytes/s, one direction
    latency_s: float = 0.0  # per transfer (one stage)

    def __post_init__(self) -> None:
        if not self.bandwidth > 0 or not self.latency_s >= 0:
            raise ValueError(f"link {self.name!r}: bandwidth > 0 and latency >= 0 are required")

    def time(self, nbytes: float) -> float:
        """Seconds one transfer of `nbytes` takes on this link."""
        return nbytes / self.bandwidth + self.latency_s

    def describe(self) -> dict[str, object]:
        return {
            "name": self.name,
            "gbytes_per_s": self.bandwidth / 1e9,
            "latency_ms": self.latency_s * 1e3,
        }


LINKS: dict[str, TransferLink] = {
    "nvlink": TransferLink("nvlink", 450e9, 20e-6),
    "rdma400": TransferLink("rdma400", 400e9 / 8, 50e-6),
    "rdma100": TransferLink("rdma100", 100e9 / 8, 50e-6),
}
DEFAULT_LINK = "rdma400"


def link(name: str, bandwidth: float | None = None, latency_s: float | None = None) -> TransferLink:
    """The preset `name`, its bandwidth (bytes/s) or latency overridden where given."""
    if name not in LINKS:
        raise ValueError(f"unknown transfer link {name!r}; presets: {', '.join(sorted(LINKS))}")
    preset = LINKS[name]
    return replace(
        preset,
        bandwidth=preset.bandwidth if bandwidth is None else bandwidth,
        latency_s=preset.latency_s if latency_s is None else latency_s,
    )


@dataclass(frozen=True, slots=True)
class TransferModel:
    default: TransferLink = field(default_factory=lambda: LINKS[DEFAULT_LINK])
    pairs: Mapping[tuple[str, str], TransferLink] = field(default_factory=dict)

    def link(self, src: str, dst: str) -> TransferLink:
        return self.pairs.get((src, dst), self.default)
