"""Headless Chromium for the page tests: Debian's ``chromium`` driven by the ``playwright`` package.

Contract:
- `chromium()` gives playwright's ``sync_playwright`` and the ``chromium`` found on PATH
  (playwright's own browser download is never used: ``executable_path`` is always that binary).
  Without either the test skips and says why, unless ``KVHERD_REQUIRE_BROWSER=1`` (CI), where it
  fails instead.
- `artifact(name)` is where a test writes what a person should look at after the run (a
  screenshot): ``$KVHERD_ARTIFACTS/name``, by default ``.ci/artifacts/name`` in the repository
  (git-ignored); the folder is created.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import pytest

REQUIRE_ENV = "KVHERD_REQUIRE_BROWSER"
ARTIFACTS_ENV = "KVHERD_ARTIFACTS"
ROOT = Path(__file__).resolve().parents[2]
LAUNCH_ARGS = ["--no-sandbox"]  # CI runs as root, where Chromium's sandbox refuses to start


def chromium() -> tuple[Any, str]:
    """(``sync_playwright``, the path of ``chromium``), or the test skips (fails under CI)."""
    path = shutil.which("chromium")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        sync_playwright = None
    if path and sync_playwright:
        return sync_playwright, path
    missing = [
        what for what, found in (("playwright", sync_playwright), ("chromium", path)) if not found
    ]
    reason = f"no {' and no '.join(missing)}: pip install playwright; apt-get install -y chromium"
    if os.environ.get(REQUIRE_ENV) == "1":
        pytest.fail(f"{reason} (${REQUIRE_ENV}=1)", pytrace=False)
    pytest.skip(reason)


def artifact(name: str) -> Path:
    folder = Path(os.environ.get(ARTIFACTS_ENV) or ROOT / ".ci" / "artifacts")
    folder.mkdir(parents=True, exist_ok=True)
    return folder / name
