"""The admin API's policy loader: only what the operator allowed at start-up loads, nothing else runs."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from policies.pipeline import Pipeline
from policies.registry import PolicyAllowList, PolicyLoadError

PIPELINE = """
plugins:
  - type: queue-scorer
  - type: max-score-picker
schedulingProfiles:
  - name: default
    plugins:
      - pluginRef: queue-scorer
        weight: 1
      - pluginRef: max-score-picker
"""

# A module the operator may allow-list: one policy of its own, plus names it merely imports.
OPERATOR_MODULE = """
import os
from os import system

class MyPolicy:
    name = "mine"

    def __init__(self, weight: int = 1) -> None:
        self.weight = weight

    def choose(self, request, cluster):
        raise NotImplementedError
"""


@pytest.fixture
def modules(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """`operator_policies` (allow-listed in the tests) and `rogue`, which leaves a mark on import."""
    root = tmp_path / "mods"
    root.mkdir()
    (root / "operator_policies.py").write_text(OPERATOR_MODULE)
    (root / "rogue.py").write_text(
        f"open({str(tmp_path / 'imported')!r}, 'w').close()\n"
        "class Policy:\n    name = 'rogue'\n    def choose(self, r, c): ...\n"
    )
    monkeypatch.syspath_prepend(str(root))
    yield root
    for name in ("operator_policies", "rogue"):
        sys.modules.pop(name, None)


def test_builtin_names_load_without_any_allow_list() -> None:
    policy = PolicyAllowList().load_dispatch_policy("round_robin", {})
    assert policy.name == "round_robin"
    mapped = PolicyAllowList().load_dispatch_policy({"name": "llumnix", "parameters": {}}, {})
    assert mapped.name == "llumnix"


def test_arbitrary_callables_are_refused_before_anything_runs(
    tmp_path: Path, modules: Path
) -> None:
    marker = tmp_path / "ran"
    allow = PolicyAllowList.of(["operator_policies"])
    for spec in ("os:system", "subprocess:run", "builtins:exec", "rogue:Policy"):
        with pytest.raises(PolicyLoadError, match="allow-list"):
            allow.load_dispatch_policy(spec, {"command": f"touch {marker}"})
    # A path through an allowed module, or a name it only imported, is refused too.
    with pytest.raises(PolicyLoadError, match="one public name"):
        allow.load_dispatch_policy("operator_policies:os.system", {"command": f"touch {marker}"})
    with pytest.raises(PolicyLoadError, match="neither a policy nor defined"):
        allow.load_dispatch_policy("operator_policies:system", {"command": f"touch {marker}"})
    with pytest.raises(PolicyLoadError, match="one public name"):
        allow.load_dispatch_policy("operator_policies:__class__", {})
    assert not marker.exists()
    assert not (tmp_path / "imported").exists()  # the rogue module was never imported
    assert "rogue" not in sys.modules


def test_allow_listed_module_policies_load(modules: Path) -> None:
    allow = PolicyAllowList.of(["operator_policies"])
    policy = allow.load_dispatch_policy("operator_policies:MyPolicy", {"weight": 3})
    assert policy.name == "mine" and policy.weight == 3  # type: ignore[attr-defined]


def test_pipeline_files_load_only_from_the_policy_dir(tmp_path: Path) -> None:
    policy_dir = tmp_path / "policies"
    policy_dir.mkdir()
    (policy_dir / "queue.yaml").write_text(PIPELINE)
    (tmp_path / "outside.yaml").write_text(PIPELINE)
    (policy_dir / "link.yaml").symlink_to(tmp_path / "outside.yaml")
    allow = PolicyAllowList.of(policy_dir=policy_dir)
    assert isinstance(allow.load_dispatch_policy("queue.yaml", {}), Pipeline)
    assert isinstance(allow.load_dispatch_policy(str(policy_dir / "queue.yaml"), {}), Pipeline)
    for spec in (
        "../outside.yaml",
        str(tmp_path / "outside.yaml"),
        "link.yaml",
        "../../../../../../etc/passwd.yaml",
    ):
        with pytest.raises(PolicyLoadError, match="outside the policy directory"):
            allow.load_dispatch_policy(spec, {})
    with pytest.raises(PolicyLoadError, match="no --policy-dir"):
        PolicyAllowList().load_dispatch_policy("queue.yaml", {})
    # Not a YAML name: an unknown entry point, never a file read.
    with pytest.raises(PolicyLoadError, match="unknown dispatch policy"):
        allow.load_dispatch_policy("../../etc/passwd", {})
