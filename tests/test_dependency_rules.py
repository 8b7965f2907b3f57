"""DESIGN.md's dependency rules, checked in a fresh interpreter where the forbidden packages fail.

The pure cores (engine core, policies, scheduler core, simulator) must import with torch, fastapi,
uvicorn and httpx unavailable, and nothing may import the simulator.
"""

from __future__ import annotations

import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]

PURE_MODULES = [
    "instance_agent.engine.block_hash",
    "instance_agent.engine.kv_events",
    "instance_agent.engine.request",
    "instance_agent.engine.block_manager",
    "instance_agent.engine.batch_scheduler",
    "instance_agent.engine.tokenizer",
    "instance_agent.engine.step_features",
    "policies.registry",
    "scheduler.cluster_state",
    "scheduler.prefix_index",
    "scheduler.approx_index",
    "scheduler.router",
    "scheduler.migration_loop",
    "scheduler.load_report",
    "migration.stages",
    "simulator.cluster",
    "simulator.experiment",
    "simulator.traces",
    "simulator.report",
]

BLOCKER = """
import importlib.abc, sys
FORBIDDEN = {"torch", "fastapi", "uvicorn", "httpx", "starlette", "transformers"}
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in FORBIDDEN:
            raise ImportError(f"forbidden import of {name}")
        return None
sys.meta_path.insert(0, Block())
"""


def test_pure_cores_import_without_torch_or_web_frameworks() -> None:
    code = BLOCKER + "".join(f"import {m}\n" for m in PURE_MODULES)
    code += "import policies.registry as r\n"
    code += "[r.load_dispatch_policy(n) for n in r.DISPATCH_POLICIES]\n"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]


def test_nothing_imports_the_simulator() -> None:
    offenders = []
    for path in ROOT.glob("*/**/*.py"):
        rel = path.relative_to(ROOT)
        if rel.parts[0] in {"simulator", "tests", "bench"} or rel.parts[0].startswith("."):
            continue
        text = path.read_text()
        if "import simulator" in text or "from simulator" in text:
            offenders.append(str(rel))
    assert offenders == []
