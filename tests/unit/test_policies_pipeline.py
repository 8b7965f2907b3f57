"""Pipelines declared in YAML (llm-d profile shape and short form), and a plug-in entry point."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest
import yaml

from policies import (
    ClusterView,
    InstanceView,
    NoInstanceError,
    Pipeline,
    PipelineConfigError,
    PolicyLoadError,
    RequestView,
    load_dispatch_policy,
)

PLUGIN_DIR = Path(__file__).resolve().parents[1] / "plugin_pkg"

LLMD_STYLE = """
seed: 3
plugins:
  - type: kv-capacity-filter
  - type: prefix-cache-scorer
  - type: queue-scorer
    name: queue
  - type: kv-cache-utilization-scorer
  - type: max-score-picker
schedulingProfiles:
  - name: default
    plugins:
      - pluginRef: kv-capacity-filter
      - pluginRef: prefix-cache-scorer
        weight: 3
      - pluginRef: queue
        weight: 2
      - pluginRef: kv-cache-utilization-scorer
        weight: 2
      - pluginRef: max-score-picker
"""


def view(matched: dict[str, int]) -> ClusterView:
    return ClusterView(
        [
            InstanceView("a", capacity=100, free_blocks=2, num_waiting=0, kv_usage=0.98),
            InstanceView("b", capacity=100, free_blocks=60, num_waiting=4, kv_usage=0.4),
            InstanceView("c", capacity=100, free_blocks=90, num_waiting=2, kv_usage=0.1),
            InstanceView("down", capacity=100, free_blocks=100, healthy=False),
        ],
        now=0.0,
        matcher=lambda request: matched,
    )


REQ = RequestView("r", 160, tuple(range(10)), 16)  # 10 blocks


def test_llmd_style_yaml_pipeline(tmp_path: Path) -> None:
    path = tmp_path / "profile.yaml"
    path.write_text(LLMD_STYLE)
    policy = load_dispatch_policy(str(path))
    assert isinstance(policy, Pipeline) and policy.name == "profile"
    decision = policy.choose(REQ, view({"a": 10, "b": 8}))
    # a needs no new block (full hit), so the capacity filter keeps it; "down" is unhealthy.
    # a: 3*1.0 + 2*1.0 + 2*0.02 = 5.04; b: 3*0.8 + 0 + 2*0.6 = 3.6; c: 0 + 2*0.5 + 2*0.9 = 2.8
    assert decision.scores == pytest.approx({"a": 5.04, "b": 3.6, "c": 2.8})
    assert decision.instance_id == "a"
    assert "prefix-cache-scorer=3.000" in decision.reason
    # Without the hit on a, a needs 10 blocks and has 2: the capacity filter drops it, and the
    # queue is re-normalised over b and c: b = 2.4 + 0 + 1.2 = 3.6, c = 0 + 2 + 1.8 = 3.8.
    cold = policy.choose(REQ, view({"b": 8}))
    assert cold.scores == pytest.approx({"b": 3.6, "c": 3.8}) and cold.instance_id == "c"


def test_short_form_pipeline_and_weighted_random_is_seeded() -> None:
    config = {
        "seed": 5,
        "filters": ["low-queue-filter"],
        "scorers": [{"type": "active-request-scorer", "weight": 1}],
        "picker": "weighted-random-picker",
    }
    runs = []
    for _ in range(2):
        policy = Pipeline.from_config(config)
        runs.append([policy.choose(REQ, view({})).instance_id for _ in range(40)])
    assert runs[0] == runs[1]
    assert "down" not in runs[0] and len(set(runs[0])) >= 2


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"scorers": [{"type": "nope-scorer"}]}, "unknown plug-in type 'nope-scorer'"),
        ({"scorers": [{"type": "queue-scorer", "weight": -1}]}, "weight must be a number"),
        ({"scorers": [{"type": "queue-scorer", "parameters": {"x": 1}}]}, "bad parameters"),
        ({"schedulingProfiles": [{"plugins": [{"pluginRef": "ghost"}]}]}, "not declared"),
        ({"schedulingProfiles": []}, "non-empty list"),
        ({"picker": "max-score-picker", "filters": ["max-score-picker"]}, "exactly one picker"),
        ({"seed": "x"}, "'seed' must be an integer"),
    ],
)
def test_bad_pipeline_configs_name_the_problem(config: dict, message: str) -> None:
    with pytest.raises(PipelineConfigError, match=message):
        Pipeline.from_config(config)


def test_unreadable_yaml_is_a_load_error(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("plugins: [unclosed")
    with pytest.raises(PolicyLoadError, match="cannot read pipeline file"):
        load_dispatch_policy(str(path))


def test_pipeline_with_nothing_dispatchable_raises() -> None:
    only_down = ClusterView([InstanceView("down", healthy=False)], now=0.0)
    with pytest.raises(NoInstanceError):
        Pipeline.from_config(yaml.safe_load(LLMD_STYLE)).choose(REQ, only_down)


def test_entry_point_plugin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The test package is found through its `kvherd.policies` entry point.

    If `pip install tests/plugin_pkg` was run the installed distribution answers; otherwise the
    test makes the package discoverable exactly as an installed wheel would be: the source on
    sys.path plus a dist-info directory holding its entry_points.txt.
    """
    try:
        import kvherd_test_plugin  # noqa: F401
    except ImportError:
        site = tmp_path / "site"
        shutil.copytree(PLUGIN_DIR / "kvherd_test_plugin", site / "kvherd_test_plugin")
        info = site / "kvherd_test_plugin-0.1.0.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(
            "Metadata-Version: 2.1\nName: kvherd-test-plugin\nVersion: 0.1.0\n"
        )
        (info / "entry_points.txt").write_text(
            "[kvherd.policies]\nfewest_waiting = kvherd_test_plugin:FewestWaiting\n"
        )
        monkeypatch.syspath_prepend(str(site))
        monkeypatch.delitem(sys.modules, "kvherd_test_plugin", raising=False)
    policy = load_dispatch_policy("fewest_waiting", bias=1.5)
    decision = policy.choose(REQ, view({}))
    assert decision.instance_id == "a" and decision.scores["a"] == 1.5
    assert decision.reason == "fewest waiting (plug-in)"
