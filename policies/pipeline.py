"""Composable dispatch: filters -> weighted scorers -> picker, declared in YAML like llm-d.

Contract:
- `Pipeline(filters, scorers=[(scorer, weight), ...], picker, seed)` is a `DispatchPolicy`.
  `healthy-filter` always runs first; then the configured filters, in order; then each scorer
  scores every remaining instance in [0, 1] (values outside are clipped) and the weighted sum is
  the instance's total; the picker chooses from the totals with the pipeline's seeded RNG.
- `Decision.scores` holds the totals and `Decision.reason` each scorer's contribution to the winner.
- `Pipeline.from_config(mapping)` reads llm-d's EndpointPickerConfig shape::

      seed: 0
      plugins:
        - {type: prefix-cache-scorer}
        - {type: queue-scorer, name: queue}
        - {type: max-score-picker}
      schedulingProfiles:
        - name: default
          plugins:
            - {pluginRef: prefix-cache-scorer, weight: 3}
            - {pluginRef: queue, weight: 2}
            - {pluginRef: max-score-picker}

  or the short form ``{filters: [type, ...], scorers: [{type, weight, parameters}], picker: type}``.
  A plug-in `type` is a built-in name (see `PLUGIN_TYPES`) or ``module:attr``; `parameters` are
  passed to its constructor. Only the first scheduling profile is used. Without a picker the
  pipeline uses `max-score-picker`. Errors name the offending entry.
"""

from __future__ import annotations

import importlib
import random
from collections.abc import Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

from policies.lora_affinity import LoraAffinityScorer
from policies.plugins.filters import (
    DecodeFilter,
    HealthyFilter,
    KVCapacityFilter,
    LowQueueFilter,
    PrefillFilter,
)
from policies.plugins.pickers import MaxScorePicker, RandomPicker, WeightedRandomPicker
from policies.plugins.scorers import (
    ActiveRequestScorer,
    FreenessScorer,
    KVCacheUtilizationScorer,
    PrefixCacheScorer,
    QueueScorer,
)
from policies.views import ClusterView, Decision, InstanceView, NoInstanceError, RequestView


@runtime_checkable
class Filter(Protocol):
    def filter(
        self, request: RequestView, cluster: ClusterView, instances: Sequence[InstanceView]
    ) -> list[InstanceView]: ...


@runtime_checkable
class Scorer(Protocol):
    def score(
        self, request: RequestView, cluster: ClusterView, instances: Sequence[InstanceView]
    ) -> dict[str, float]: ...


@runtime_checkable
class Picker(Protocol):
    def pick(self, scores: Mapping[str, float], rng: random.Random) -> str: ...


PLUGIN_TYPES: dict[str, type] = {
    cls.type_name: cls
    for cls in (
        HealthyFilter,
        PrefillFilter,
        DecodeFilter,
        KVCapacityFilter,
        LowQueueFilter,
        PrefixCacheScorer,
        QueueScorer,
        KVCacheUtilizationScorer,
        ActiveRequestScorer,
        FreenessScorer,
        LoraAffinityScorer,
        MaxScorePicker,
        RandomPicker,
        WeightedRandomPicker,
    )
}


class PipelineConfigError(ValueError):
    """A pipeline declaration that cannot be built."""


def _make_plugin(spec: Any, where: str) -> object:
    if isinstance(spec, str):
        spec = {"type": spec}
    if not isinstance(spec, Mapping) or not isinstance(spec.get("type"), str):
        raise PipelineConfigError(f"{where}: a plug-in needs a string 'type', got {spec!r:.80}")
    type_name = spec["type"]
    params = spec.get("parameters") or {}
    if not isinstance(params, Mapping):
        raise PipelineConfigError(f"{where}: 'parameters' must be a mapping")
    factory: Any = PLUGIN_TYPES.get(type_name)
    if factory is None and ":" in type_name:
        module_name, _, attr = type_name.partition(":")
        try:
            factory = getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError) as exc:
            raise PipelineConfigError(f"{where}: cannot load {type_name!r}: {exc}") from exc
    if factory is None:
        known = ", ".join(sorted(PLUGIN_TYPES))
        raise PipelineConfigError(f"{where}: unknown plug-in type {type_name!r} (known: {known})")
    try:
        return factory(**params)
    except TypeError as exc:
        raise PipelineConfigError(f"{where}: bad parameters for {type_name!r}: {exc}") from exc


class Pipeline:
    """Filters -> weighted scorers -> picker (see the module docstring)."""

    def __init__(
        self,
        filters: Sequence[Filter] = (),
        scorers: Sequence[tuple[Scorer, float]] = (),
        picker: Picker | None = None,
        seed: int = 0,
        name: str = "pipeline",
    ) -> None:
        self.name = name
        self.filters: list[Filter] = [HealthyFilter(), *filters]
        self.scorers = [(scorer, float(weight)) for scorer, weight in scorers]
        self.picker: Picker = picker or MaxScorePicker()
        self._rng = random.Random(seed)

    def explain_scores(
        self, request: RequestView, cluster: ClusterView
    ) -> dict[str, dict[str, float]]:
        """Per instance, each scorer's weighted contribution (after filters)."""
        pool = self._filtered(request, cluster)
        table: dict[str, dict[str, float]] = {inst.instance_id: {} for inst in pool}
        for scorer, weight in self.scorers:
            label = getattr(scorer, "type_name", type(scorer).__name__)
            raw = scorer.score(request, cluster, pool)
            for inst in pool:
                value = min(1.0, max(0.0, float(raw.get(inst.instance_id, 0.0))))
                table[inst.instance_id][label] = weight * value
        return table

    def _filtered(self, request: RequestView, cluster: ClusterView) -> list[InstanceView]:
        pool: list[InstanceView] = list(cluster.instances)
        for flt in self.filters:
            pool = flt.filter(request, cluster, pool)
            if not pool:
                raise NoInstanceError(
                    f"no dispatchable instance among {len(cluster)} after {type(flt).__name__}"
                )
        return pool

    def choose(self, request: RequestView, cluster: ClusterView) -> Decision:
        table = self.explain_scores(request, cluster)
        totals = {inst: sum(parts.values()) for inst, parts in table.items()}
        chosen = self.picker.pick(totals, self._rng)
        parts = ", ".join(f"{label}={value:.3f}" for label, value in table[chosen].items())
        return Decision(chosen, totals, parts or "no scorers")

    @classmethod
    def from_config(cls, config: Mapping[str, Any], name: str = "pipeline") -> Pipeline:
        if not isinstance(config, Mapping):
            raise PipelineConfigError("a pipeline config must be a mapping")
        seed = config.get("seed", 0)
        if not isinstance(seed, int):
            raise PipelineConfigError("'seed' must be an integer")
        entries = (
            _profile_entries(config) if "schedulingProfiles" in config else _short_entries(config)
        )
        filters: list[Filter] = []
        scorers: list[tuple[Scorer, float]] = []
        picker: Picker | None = None
        for where, plugin, weight in entries:
            if isinstance(plugin, Picker):
                if picker is not None:
                    raise PipelineConfigError(f"{where}: a profile has exactly one picker")
                picker = plugin
            elif isinstance(plugin, Scorer):
                if not isinstance(weight, int | float) or weight < 0:
                    raise PipelineConfigError(f"{where}: a scorer weight must be a number >= 0")
                scorers.append((plugin, float(weight)))
            elif isinstance(plugin, Filter):
                filters.append(plugin)
            else:
                raise PipelineConfigError(f"{where}: not a filter, scorer or picker")
        return cls(filters, scorers, picker, seed=seed, name=str(config.get("name", name)))


def _profile_entries(config: Mapping[str, Any]) -> list[tuple[str, object, Any]]:
    declared: dict[str, object] = {}
    for index, spec in enumerate(config.get("plugins") or []):
        where = f"plugins[{index}]"
        plugin = _make_plugin(spec, where)
        ref = spec.get("name", spec.get("type")) if isinstance(spec, Mapping) else spec
        declared[str(ref)] = plugin
    profiles = config["schedulingProfiles"]
    if not isinstance(profiles, list) or not profiles or not isinstance(profiles[0], Mapping):
        raise PipelineConfigError("'schedulingProfiles' must be a non-empty list of mappings")
    entries: list[tuple[str, object, Any]] = []
    for index, ref in enumerate(profiles[0].get("plugins") or []):
        where = f"schedulingProfiles[0].plugins[{index}]"
        if not isinstance(ref, Mapping) or "pluginRef" not in ref:
            raise PipelineConfigError(f"{where}: needs a 'pluginRef'")
        if ref["pluginRef"] not in declared:
            raise PipelineConfigError(f"{where}: pluginRef {ref['pluginRef']!r} is not declared")
        entries.append((where, declared[ref["pluginRef"]], ref.get("weight", 1)))
    return entries


def _short_entries(config: Mapping[str, Any]) -> list[tuple[str, object, Any]]:
    entries: list[tuple[str, object, Any]] = []
    for index, spec in enumerate(config.get("filters") or []):
        entries.append((f"filters[{index}]", _make_plugin(spec, f"filters[{index}]"), None))
    for index, spec in enumerate(config.get("scorers") or []):
        where = f"scorers[{index}]"
        weight = spec.get("weight", 1) if isinstance(spec, Mapping) else 1
        entries.append((where, _make_plugin(spec, where), weight))
    if config.get("picker") is not None:
        entries.append(("picker", _make_plugin(config["picker"], "picker"), None))
    return entries
