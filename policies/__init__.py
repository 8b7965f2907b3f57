"""Policy plug-in API: read-only views, dispatch and migration policies, and the built-ins.

Usage::

    from policies import ClusterView, InstanceView, RequestView, load_dispatch_policy

    policy = load_dispatch_policy("llumnix")            # or "pkg.mod:Cls", an entry point, a .yaml
    cluster = ClusterView([InstanceView("a", capacity=100, free_blocks=80, num_running=2,
                                        freeness=40.0)], now=0.0)
    decision = policy.choose(RequestView("r1", num_tokens=100), cluster)
    print(decision.explain())

This package imports nothing else of kvherd (so plug-ins can depend on it alone).
"""

from policies.base import DispatchPolicy, MigrationPolicy, argbest, candidates
from policies.pipeline import Filter, Picker, Pipeline, PipelineConfigError, Scorer
from policies.registry import (
    DISPATCH_POLICIES,
    ENTRY_POINT_GROUP,
    MIGRATION_POLICIES,
    PolicyLoadError,
    load_dispatch_policy,
    load_migration_policy,
    load_pipeline_file,
)
from policies.views import (
    ClusterView,
    Decision,
    InstanceView,
    MigrationOrder,
    NoInstanceError,
    RequestView,
    RunningRequestView,
)

__all__ = [
    "DISPATCH_POLICIES",
    "ENTRY_POINT_GROUP",
    "MIGRATION_POLICIES",
    "ClusterView",
    "Decision",
    "DispatchPolicy",
    "Filter",
    "InstanceView",
    "MigrationOrder",
    "MigrationPolicy",
    "NoInstanceError",
    "Picker",
    "Pipeline",
    "PipelineConfigError",
    "PolicyLoadError",
    "RequestView",
    "RunningRequestView",
    "Scorer",
    "argbest",
    "candidates",
    "load_dispatch_policy",
    "load_migration_policy",
    "load_pipeline_file",
]
