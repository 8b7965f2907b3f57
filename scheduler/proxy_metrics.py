"""The proxy's Prometheus metrics (``kvherd_`` names), on a registry of its own.

Contract (what ``GET /metrics`` on the proxy exposes):
- ``kvherd_requests_total{status}``: finished client requests by HTTP status (``"client_closed"`` when
  the client went away mid-stream).
- ``kvherd_routing_decision_seconds``: histogram of the routing decision (tokenize + hash + policy).
- ``kvherd_matched_prefix_blocks``: histogram of leading prompt blocks already cached on the chosen
  instance; ``kvherd_prompt_blocks``: histogram of full prompt blocks, for the hit ratio.
- ``kvherd_instance_inflight{instance}``: requests the proxy has in flight per instance.
- ``kvherd_retries_total``: attempts sent to another instance after a failure before the first byte.
- ``kvherd_ejections_total{instance}``: passive or active ejections.
- ``kvherd_admission_queue_depth``: requests waiting for a non-saturated instance;
  ``kvherd_rejected_total{reason}``: requests refused by admission (``queue_full``, ``queue_timeout``).
- ``kvherd_instances{state}``: instance counts per health state.
Label children are cached, so the hot path pays a dict lookup and an increment per metric.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

_DECISION_BUCKETS = (
    0.00005,
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.5,
)
_BLOCK_BUCKETS = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)

CONTENT_TYPE = CONTENT_TYPE_LATEST


class ProxyMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self._requests = Counter(
            "kvherd_requests", "Client requests finished, by HTTP status", ["status"], registry=r
        )
        self.decision_seconds = Histogram(
            "kvherd_routing_decision_seconds",
            "Time to route one request (tokenize, hash, policy)",
            buckets=_DECISION_BUCKETS,
            registry=r,
        )
        self.matched_blocks = Histogram(
            "kvherd_matched_prefix_blocks",
            "Leading prompt blocks cached on the chosen instance",
            buckets=_BLOCK_BUCKETS,
            registry=r,
        )
        self.prompt_blocks = Histogram(
            "kvherd_prompt_blocks", "Full blocks per prompt", buckets=_BLOCK_BUCKETS, registry=r
        )
        self._inflight = Gauge(
            "kvherd_instance_inflight", "Requests in flight per instance", ["instance"], registry=r
        )
        self.retries = Counter("kvherd_retries", "Attempts retried on another instance", registry=r)
        self._ejections = Counter(
            "kvherd_ejections", "Instance ejections (passive or active)", ["instance"], registry=r
        )
        self.queue_depth = Gauge(
            "kvherd_admission_queue_depth", "Requests waiting for admission", registry=r
        )
        self._rejected = Counter(
            "kvherd_rejected", "Requests refused by admission", ["reason"], registry=r
        )
        self._instances = Gauge(
            "kvherd_instances", "Registered instances by health state", ["state"], registry=r
        )
        self._status_children: dict[int | str, Counter] = {}
        self._inflight_children: dict[str, Gauge] = {}

    def request_done(self, status: int | str) -> None:
        child = self._status_children.get(status)
        if child is None:
            child = self._status_children[status] = self._requests.labels(status=str(status))
        child.inc()

    def inflight(self, instance_id: str) -> Gauge:
        child = self._inflight_children.get(instance_id)
        if child is None:
            child = self._inflight_children[instance_id] = self._inflight.labels(
                instance=instance_id
            )
        return child

    def forget_instance(self, instance_id: str) -> None:
        if self._inflight_children.pop(instance_id, None) is not None:
            self._inflight.remove(instance_id)

    def ejected(self, instance_id: str) -> None:
        self._ejections.labels(instance=instance_id).inc()

    def rejected(self, reason: str) -> None:
        self._rejected.labels(reason=reason).inc()

    def set_instance_states(self, counts: dict[str, int]) -> None:
        for state, count in counts.items():
            self._instances.labels(state=state).set(count)

    def render(self) -> bytes:
        return generate_latest(self.registry)
