"""Pipeline filters: drop instances that must not take the request.

Contract: ``filter(request, cluster, instances) -> list[InstanceView]`` returns a subset of
`instances`, in order. A filter that would drop *every* instance returns its input unchanged
(a soft constraint), except `healthy-filter`, which is hard and always runs first in a pipeline,
and the role filters `prefill-filter` / `decode-filter` (llm-d's names), which are hard too: a
decode-only instance must never be asked to prefill a disaggregated request, nor the reverse.
"""

from __future__ import annotations

from collections.abc import Sequence

from policies.views import ClusterView, InstanceView, RequestView


class HealthyFilter:
    """`healthy-filter`: healthy and not draining instances only."""

    type_name = "healthy-filter"

    def filter(
        self, request: RequestView, cluster: ClusterView, instances: Sequence[InstanceView]
    ) -> list[InstanceView]:
        return [inst for inst in instances if inst.dispatchable]


class PrefillFilter:
    """`prefill-filter`: instances that prefill (role ``prefill`` or ``mixed``)."""

    type_name = "prefill-filter"

    def filter(
        self, request: RequestView, cluster: ClusterView, instances: Sequence[InstanceView]
    ) -> list[InstanceView]:
        return [inst for inst in instances if inst.prefills]


class DecodeFilter:
    """`decode-filter`: instances that decode (role ``decode`` or ``mixed``)."""

    type_name = "decode-filter"

    def filter(
        self, request: RequestView, cluster: ClusterView, instances: Sequence[InstanceView]
    ) -> list[InstanceView]:
        return [inst for inst in instances if inst.decodes]


class KVCapacityFilter:
    """`kv-capacity-filter`: instances with room for the request's uncached blocks right now.

    Avoids sending a long prompt where it would queue for memory or force a preemption. Instances
    with unknown capacity (0) are kept, since nothing is known against them.
    """

    type_name = "kv-capacity-filter"

    def filter(
        self, request: RequestView, cluster: ClusterView, instances: Sequence[InstanceView]
    ) -> list[InstanceView]:
        matched = cluster.prefix_match(request)
        fits = [
            inst
            for inst in instances
            if inst.capacity == 0
            or inst.free_blocks >= request.num_blocks - matched.get(inst.instance_id, 0)
        ]
        return fits or list(instances)


class LowQueueFilter:
    """`low-queue-filter`: instances whose waiting queue is at most `threshold` requests.

    Parameter `threshold` (default 128, llm-d's queueing threshold order of magnitude).
    """

    type_name = "low-queue-filter"

    def __init__(self, threshold: int = 128) -> None:
        self.threshold = threshold

    def filter(
        self, request: RequestView, cluster: ClusterView, instances: Sequence[InstanceView]
    ) -> list[InstanceView]:
        low = [inst for inst in instances if inst.num_waiting <= self.threshold]
        return low or list(instances)
