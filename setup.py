"""Build hook beside pyproject.toml (which holds the metadata): mypyc compiles the modules
`kvherd/compiled.py` names, from the very .py files the plain form runs; every other module stays
plain Python. KVHERD_PURE_PYTHON=1 at install time builds no extension at all.
"""

import importlib.util
import os
from pathlib import Path

from setuptools import setup


def compiled_sources() -> list[str]:
    # kvherd/compiled.py alone, not the kvherd package (whose __init__ selects a form).
    spec = importlib.util.spec_from_file_location("kvherd_compiled", Path("kvherd/compiled.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return [name.replace(".", "/") + ".py" for name in module.MODULES]


if os.environ.get("KVHERD_PURE_PYTHON") == "1":
    setup()
else:
    from mypyc.build import mypycify

    setup(ext_modules=mypycify(compiled_sources(), opt_level="3", group_name="kvherd_core"))
