"""Loading policies by name: built-ins, ``module:attr``, the `kvherd.policies` entry points, YAML.

Contract:
- ``load_dispatch_policy(spec, **params)`` / ``load_migration_policy(spec, **params)`` /
  ``load_pd_policy(spec, **params)`` return a ready policy object. `spec` is, in order of lookup:
  1. a built-in name (`DISPATCH_POLICIES` / `MIGRATION_POLICIES` / `PD_POLICIES`);
  2. a path ending in ``.yaml``/``.yml``: a pipeline declaration (see `policies.pipeline`);
     for dispatch only;
  3. ``package.module:attr``;
  4. a name registered by an installed distribution in the ``kvherd.policies`` entry-point group,
     e.g. ``[project.entry-points."kvherd.policies"] my_policy = "my_pkg.mod:MyPolicy"``.
  The loaded attribute may be a class or factory (called with `params`) or a ready policy object
  (then `params` must be empty).
- The result is checked against the protocol (`choose` for dispatch, `plan` for migration, `pair`
  for P/D); a spec
  that names nothing, or the wrong kind, raises `PolicyLoadError` with a message naming the spec.
- `params` may also come from a mapping spec ``{"name": ..., "parameters": {...}}`` (YAML/CLI).
- Those two loaders trust their caller (the operator's command line and config file). A spec
  from elsewhere (the admin API) goes through `PolicyAllowList.load_dispatch_policy`, which loads
  only built-in names, entry points (code the operator installed), ``module:attr`` of a module
  on the operator's allow-list (``--policy-module``; ``attr`` one public name defined in, or a
  policy exported by, that module, never a path through it such as ``mod:os.system``), and YAML
  files inside the operator's policy directory (``--policy-dir``; symbolic links and ``..``
  resolved first). Anything else raises `PolicyLoadError` before any module is imported, any
  file is read or anything is called.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

import yaml

from policies.base import DispatchPolicy, MigrationPolicy, PDPolicy
from policies.pipeline import Pipeline, PipelineConfigError

ENTRY_POINT_GROUP = "kvherd.policies"

DISPATCH_POLICIES: dict[str, str] = {
    "kvherd": "policies.kvherd:KvherdDispatch",
    "round_robin": "policies.round_robin:RoundRobin",
    "random": "policies.random_choice:RandomChoice",
    "least_requests": "policies.least_requests:LeastRequests",
    "power_of_two": "policies.power_of_two:PowerOfTwo",
    "llumnix": "policies.llumnix:LlumnixDispatch",
    "sglang_cache_aware": "policies.sglang_cache_aware:SGLangCacheAware",
    "dynamo_kv": "policies.dynamo_kv:DynamoKV",
    "llmd": "policies.llmd:Llmd",
}
MIGRATION_POLICIES: dict[str, str] = {
    "none": "policies.migrate_none:NoMigration",
    "llumnix": "policies.migrate_llumnix:LlumnixMigration",
    "defrag": "policies.migrate_defrag:DefragMigration",
    "drain": "policies.migrate_drain:DrainMigration",
}
# Prefill/decode pairing (P/D disaggregation).
PD_POLICIES: dict[str, str] = {
    "kvherd": "policies.pd_kvherd:KvherdPD",
    "llmd": "policies.pd_llmd:LlmdPD",
    "dynamo": "policies.pd_dynamo:DynamoPD",
}
DEFAULT_DISPATCH = "kvherd"
DEFAULT_PD = "kvherd"
DEFAULT_MIGRATION = "none"


class PolicyLoadError(ValueError):
    """A policy spec that names no usable policy."""


def _import_attr(target: str) -> Any:
    module_name, _, attr = target.partition(":")
    try:
        obj: Any = importlib.import_module(module_name)
        for part in attr.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as exc:
        raise PolicyLoadError(f"cannot load policy {target!r}: {exc}") from exc
    return obj


def _entry_point(name: str) -> Any | None:
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        if ep.name == name:
            try:
                return ep.load()
            except Exception as exc:  # a broken plug-in must not look like "not found"
                raise PolicyLoadError(f"entry point {name!r} ({ep.value}) failed: {exc}") from exc
    return None


def _instantiate(obj: Any, params: Mapping[str, Any], spec: str) -> Any:
    if isinstance(obj, type) or (
        callable(obj) and not any(hasattr(obj, verb) for verb in ("choose", "plan", "pair"))
    ):
        try:
            return obj(**params)
        except TypeError as exc:
            raise PolicyLoadError(f"bad parameters for policy {spec!r}: {exc}") from exc
    if params:
        raise PolicyLoadError(f"policy {spec!r} is an instance; it takes no parameters")
    return obj


def _resolve(spec: Any, params: Mapping[str, Any], builtins: Mapping[str, str], kind: str) -> Any:
    if isinstance(spec, Mapping):
        params = {**(spec.get("parameters") or {}), **params}
        spec = spec.get("name")
    if not isinstance(spec, str) or not spec:
        raise PolicyLoadError(f"a {kind} policy spec must be a non-empty name, got {spec!r:.80}")
    if spec in builtins:
        return _instantiate(_import_attr(builtins[spec]), params, spec)
    if kind == "dispatch" and spec.endswith((".yaml", ".yml")):
        return load_pipeline_file(spec)
    if ":" in spec:
        return _instantiate(_import_attr(spec), params, spec)
    found = _entry_point(spec)
    if found is None:
        known = ", ".join(sorted(builtins))
        raise PolicyLoadError(
            f"unknown {kind} policy {spec!r}: not built-in ({known}), not module:attr, "
            f"not a {ENTRY_POINT_GROUP!r} entry point"
        )
    return _instantiate(found, params, spec)


_PUBLIC_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_]*")


@dataclass(frozen=True, slots=True)
class PolicyAllowList:
    """What a policy spec from outside the operator's own command line may name."""

    modules: frozenset[str] = frozenset()
    policy_dir: Path | None = None

    @classmethod
    def of(
        cls, modules: Iterable[str] = (), policy_dir: str | Path | None = None
    ) -> PolicyAllowList:
        return cls(frozenset(modules), None if policy_dir is None else Path(policy_dir).resolve())

    def load_dispatch_policy(self, spec: Any, params: Mapping[str, Any]) -> DispatchPolicy:
        """`load_dispatch_policy`, for a spec this allow-list admits (else `PolicyLoadError`)."""
        if isinstance(spec, Mapping):
            params = {**(spec.get("parameters") or {}), **params}
            spec = spec.get("name")
        if not isinstance(spec, str) or not spec:
            raise PolicyLoadError(
                f"a dispatch policy spec must be a non-empty name, got {spec!r:.80}"
            )
        if spec in DISPATCH_POLICIES:
            return load_dispatch_policy(spec, **params)
        if spec.endswith((".yaml", ".yml")):
            return load_dispatch_policy(str(self._pipeline_path(spec)), **params)
        if ":" in spec:
            self._check_module_attr(spec)
        return load_dispatch_policy(spec, **params)  # module:attr checked, an entry point, unknown

    def _pipeline_path(self, spec: str) -> Path:
        if self.policy_dir is None:
            raise PolicyLoadError(
                f"policy file {spec!r:.200} refused: no --policy-dir was given at start-up"
            )
        path = (self.policy_dir / spec).resolve()
        if not path.is_relative_to(self.policy_dir):
            raise PolicyLoadError(f"policy file {spec!r:.200} is outside the policy directory")
        return path

    def _check_module_attr(self, spec: str) -> None:
        module_name, _, attr = spec.partition(":")
        if module_name not in self.modules:
            raise PolicyLoadError(
                f"module {module_name!r:.200} is not on the policy allow-list (--policy-module)"
            )
        if not _PUBLIC_NAME.fullmatch(attr):
            raise PolicyLoadError(f"{spec!r:.200}: the attribute must be one public name")
        obj = _import_attr(spec)
        is_policy = hasattr(obj, "choose") or hasattr(obj, "plan")
        if not is_policy and getattr(obj, "__module__", None) != module_name:
            # A name the module merely imported (``mod:system`` after ``from os import system``).
            raise PolicyLoadError(f"{spec!r:.200} is neither a policy nor defined in {module_name}")


def load_pipeline_file(path: str | Path) -> Pipeline:
    """A `Pipeline` from a YAML declaration file."""
    try:
        config = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise PolicyLoadError(f"cannot read pipeline file {str(path)!r}: {exc}") from exc
    try:
        return Pipeline.from_config(config, name=Path(path).stem)
    except PipelineConfigError as exc:
        raise PolicyLoadError(f"{path}: {exc}") from exc


def load_dispatch_policy(spec: Any = DEFAULT_DISPATCH, **params: Any) -> DispatchPolicy:
    policy = _resolve(spec, params, DISPATCH_POLICIES, "dispatch")
    if not isinstance(policy, DispatchPolicy):
        raise PolicyLoadError(f"{spec!r} is not a dispatch policy (needs name and choose())")
    return policy


def load_migration_policy(spec: Any = DEFAULT_MIGRATION, **params: Any) -> MigrationPolicy:
    policy = _resolve(spec, params, MIGRATION_POLICIES, "migration")
    if not isinstance(policy, MigrationPolicy):
        raise PolicyLoadError(f"{spec!r} is not a migration policy (needs name and plan())")
    return policy


def load_pd_policy(spec: Any = DEFAULT_PD, **params: Any) -> PDPolicy:
    policy = _resolve(spec, params, PD_POLICIES, "pd")
    if not isinstance(policy, PDPolicy):
        raise PolicyLoadError(f"{spec!r} is not a P/D policy (needs name and pair())")
    return policy
