"""Which form of the hot pure modules runs: mypyc's compiled build or the plain .py source.

`MODULES` (the hot pure modules that pay and whose classes nothing patches, subclasses, pickles
or reads `__slots__` of: see README) are compiled by setup.py into extension modules beside
their sources, and Python's import prefers those. `select_form()`, called by each top-level
package's `__init__` before any of them loads, makes every one of them load from its .py
instead when KVHERD_PURE_PYTHON=1 is set, when none is built, or when one is missing or older
than its source (an edit since the last build; a warning says so): all or none, since compiled
modules call each other natively. `FORM` is "compiled" or "plain".
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
import warnings
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

MODULES = (
    "instance_agent.engine.core.load",
    "kvherd.block_hash",
    "scheduler.core.approx_index",
    "scheduler.core.cluster_state",
    "scheduler.core.instance_state",
    "scheduler.core.prefix_index",
    "scheduler.core.router",
    "simulator.fast_forward",
    "simulator.loop",
    "simulator.metrics",
    "simulator.prompts",
)

ROOT = Path(__file__).resolve().parents[1]  # the folder holding kvherd/, simulator/, ...
FORM = ""  # set once, by the first `select_form()`


def source(module: str) -> Path:
    return ROOT.joinpath(*module.split(".")).with_suffix(".py")


def built(module: str) -> Path | None:
    """The module's compiled extension beside its source, if there is one."""
    stem = source(module).with_suffix("")
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        path = stem.with_name(stem.name + suffix)
        if path.is_file():
            return path
    return None


class _FromSource(importlib.abc.MetaPathFinder):
    """Finds `MODULES` at their .py files, ahead of the extension modules beside them."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in MODULES or not path:
            return None
        leaf = fullname.rpartition(".")[2] + ".py"
        return importlib.util.spec_from_file_location(fullname, Path(path[0]) / leaf)


def _plain_reason() -> str | None:
    """Why the plain form must run (None: the compiled build is whole and up to date)."""
    if os.environ.get("KVHERD_PURE_PYTHON") == "1":
        return "KVHERD_PURE_PYTHON=1"
    extensions = {m: built(m) for m in MODULES}
    if not any(extensions.values()):
        return "not built"
    for module, ext in extensions.items():
        if ext is None or ext.stat().st_mtime < source(module).stat().st_mtime:
            state = "missing" if ext is None else "older than its source"
            reason = f"{module}'s compiled build is {state}"
            warnings.warn(
                f"kvherd: {reason}; running the plain Python form (rebuild: pip install -e .)",
                RuntimeWarning,
                stacklevel=3,
            )
            return reason
    return None


def select_form() -> str:
    global FORM
    if not FORM:
        FORM = "compiled" if _plain_reason() is None else "plain"
        if FORM == "plain":
            sys.meta_path.insert(0, _FromSource())
    return FORM
