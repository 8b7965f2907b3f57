"""The fleet's health job: which instances routing may use, from requests and active probes.

Contract:
- `FleetHealth` owns the pure `OutlierDetector` (consecutive failures eject, back-off, half-open
  trials) and the `ActiveProber` (``/health`` of every instance each ``health_interval_s``, its
  timeout excusing the proxy's own loop lag, `lag_owed`). Outcomes come from the request path
  (`succeeded`, `failed`) and from the probes, alike.
- An ejection or a recovery is applied to the scheduler core (`ClusterState.set_healthy`),
  counted (``kvherd_ejections_total``) and handed to `on_change(instance_id, health)`: the fleet
  fails over an ejected instance's requests and resubscribes a recovered one's KV events (it
  may have restarted).
- `add` / `remove` follow membership; `state(id, now)` is what the admin API shows.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from scheduler.core.cluster_state import ClusterState
from scheduler.core.outliers import Health, OutlierDetector
from scheduler.metrics import ProxyMetrics
from scheduler.prober import ActiveProber

log = logging.getLogger("kvherd.fleet")


class FleetHealth:
    def __init__(
        self,
        cluster: Callable[[], ClusterState],
        targets: Callable[[], dict[str, str]],
        metrics: ProxyMetrics,
        on_change: Callable[[str, Health], None],
        clock: Callable[[], float],
        *,
        failure_threshold: int,
        base_ejection_s: float,
        max_ejection_s: float,
        health_interval_s: float,
        health_timeout_s: float,
        lag_owed: Callable[[float], float] | None = None,
    ) -> None:
        self._cluster = cluster  # the fleet's current core (rebuilt when the block size settles)
        self._targets = targets
        self.metrics = metrics
        self._on_change = on_change
        self.clock = clock
        self.outliers = OutlierDetector(failure_threshold, base_ejection_s, max_ejection_s)
        self.prober = ActiveProber(
            targets, self._probed, health_interval_s, health_timeout_s, lag_owed=lag_owed
        )

    def add(self, instance_id: str) -> None:
        self.outliers.remove(instance_id)  # a re-added instance starts healthy
        self.outliers.add(instance_id)

    def remove(self, instance_id: str) -> None:
        self.outliers.remove(instance_id)

    def state(self, instance_id: str, now: float) -> Health:
        return self.outliers.state(instance_id, now)

    def succeeded(self, instance_id: str) -> None:
        self._changed(instance_id, self.outliers.record_success(instance_id, self.clock()))

    def failed(self, instance_id: str) -> None:
        self._changed(instance_id, self.outliers.record_failure(instance_id, self.clock()))

    def _probed(self, instance_id: str, ok: bool) -> None:
        if instance_id not in self._targets():
            return
        if ok:
            self.succeeded(instance_id)
        else:
            self.failed(instance_id)

    def _changed(self, instance_id: str, change: Health | None) -> None:
        if change is None or instance_id not in self._targets():
            return
        if change is Health.EJECTED:
            log.warning("instance %s ejected after repeated failures", instance_id)
            self.metrics.ejected(instance_id)
            self._cluster().set_healthy(instance_id, False)
        elif change is Health.HEALTHY:
            log.info("instance %s is healthy again", instance_id)
            self._cluster().set_healthy(instance_id, True)
        else:
            return
        self._on_change(instance_id, change)
