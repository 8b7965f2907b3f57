"""DESIGN.md's dependency rules, checked by folder in a fresh interpreter where forbidden packages fail.

- Every module under a ``core/`` folder, under ``policies/`` and under ``simulator/`` (but the trace
  replay client, the real clock's driver), and the shared vocabulary in ``kvherd/`` (but the CLI and
  the vLLM connector, which runs only inside vLLM's own python), imports with torch, fastapi,
  uvicorn, httpx, starlette and transformers unavailable.
- A ``core/`` module imports, of kvherd's own packages, only other ``core/`` modules, ``policies`` and
  ``kvherd`` (the pure vocabulary).
- Nothing outside the simulator (and the tests and benchmarks) imports the simulator, and the
  simulator imports of the other packages only their ``core/`` modules, ``policies`` and ``kvherd``:
  none of the live fleet's I/O modules.
- The live fleet's modules under ``scheduler/`` import nothing from the proxy's request path
  (``scheduler/proxy/``) above them, but the commands that assemble a process.
- kvherd's own modules import each other without a circle.
"""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGES = ("kvherd", "policies", "scheduler", "migration", "instance_agent", "simulator")


def _module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _product_modules() -> dict[str, pathlib.Path]:
    return {
        _module_name(p): p
        for pkg in PACKAGES
        for p in sorted((ROOT / pkg).rglob("*.py"))
        if "__pycache__" not in p.parts
    }


# kvherd/ modules allowed heavy imports: the CLI (and its __main__) dispatches to torch-using
# subcommands; the vLLM connector is loaded by vLLM, with vLLM and torch, and nowhere else.
IMPURE_VOCABULARY = {"kvherd.cli", "kvherd.__main__", "kvherd.vllm_connector"}

# The real-clock side of traces: `kvherd replay` sends a trace to a live endpoint over HTTP.
REAL_CLOCK = {"simulator.replay", "simulator.replay_cli"}


def _is_pure(module: str) -> bool:
    parts = module.split(".")
    if module in REAL_CLOCK:
        return False
    if parts[0] in {"policies", "simulator"} or "core" in parts[:-1] or parts[-1] == "core":
        return True
    return parts[0] == "kvherd" and module not in IMPURE_VOCABULARY


def _imports(path: pathlib.Path) -> set[str]:
    """kvherd-internal modules a file imports (``from a.b import c`` counts ``a.b`` and ``a.b.c``)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names)
    return {m for m in found if m.split(".")[0] in PACKAGES}


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


def test_pure_folders_import_without_torch_or_web_frameworks() -> None:
    pure = [m for m in _product_modules() if _is_pure(m)]
    assert any(m.startswith("scheduler.core.") for m in pure)
    code = BLOCKER + "".join(f"import {m}\n" for m in pure)
    code += "import policies.registry as r\n"
    code += "[r.load_dispatch_policy(n) for n in r.DISPATCH_POLICIES]\n"
    code += "[r.load_migration_policy(n) for n in r.MIGRATION_POLICIES]\n"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-2000:]


def test_core_folders_import_only_cores_policies_and_the_vocabulary() -> None:
    modules = _product_modules()
    offenders = []
    for name, path in modules.items():
        parts = name.split(".")
        if "core" not in parts:
            continue
        for imported in _imports(path):
            if imported not in modules:
                continue  # ``from pkg.module import Name``: the name, not a module
            ok = (
                imported.split(".")[0] in {"policies", "kvherd"} and imported != "kvherd.cli"
            ) or "core" in imported.split(".")
            if not ok:
                offenders.append(f"{name} -> {imported}")
    assert offenders == []


def test_nothing_imports_the_simulator() -> None:
    offenders = [
        f"{name} -> {imported}"
        for name, path in _product_modules().items()
        if not name.startswith("simulator")
        for imported in _imports(path)
        if imported.split(".")[0] == "simulator"
    ]
    assert offenders == []


def test_the_simulator_imports_no_module_of_the_live_fleet() -> None:
    modules = _product_modules()
    offenders = [
        f"{name} -> {imported}"
        for name, path in modules.items()
        if name.startswith("simulator")
        for imported in _imports(path)
        if imported in modules
        and imported.split(".")[0] in {"scheduler", "instance_agent", "migration"}
        and "core" not in imported.split(".")
    ]
    assert offenders == []


# The commands that assemble a process: the proxy's parts and the fleet under them.
ASSEMBLERS = {"scheduler.serve_cli", "scheduler.up_cli"}


def test_the_fleet_imports_nothing_of_the_proxy_above_it() -> None:
    modules = _product_modules()
    offenders = [
        f"{name} -> {imported}"
        for name, path in modules.items()
        if name.startswith("scheduler.")
        and not name.startswith("scheduler.proxy")
        and name not in ASSEMBLERS
        for imported in _imports(path)
        if imported in modules and imported.startswith("scheduler.proxy")
    ]
    assert offenders == []


def test_no_import_circles() -> None:
    modules = _product_modules()
    graph = {
        name: {m for m in _imports(path) if m in modules and m != name}
        for name, path in modules.items()
    }
    # A package's __init__ is imported on the way to its modules; only module-to-module edges count.
    circles: list[list[str]] = []
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                circles.append([*stack[stack.index(nxt) :], nxt])
            elif nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name)
    assert circles == []
