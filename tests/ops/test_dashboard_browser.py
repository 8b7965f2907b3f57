"""The live page in headless Chromium (Debian's, driven by playwright): it logs in, draws its
charts from a running fleet and keeps updating for 20 s with no error in the browser console.

Needs the ``playwright`` package and a ``chromium`` binary (never a downloaded browser); the
test skips without them, unless ``KVHERD_REQUIRE_BROWSER=1`` (CI), where it fails. The
screenshot is written to ``$KVHERD_SCREENSHOT_DIR`` when set (the README's), else to tmp_path.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path
from typing import Any

import pytest
from live_fleet import LiveFleet
from serve_process import ADMIN_TOKEN

REQUIRE_ENV = "KVHERD_REQUIRE_BROWSER"
WATCH_S = 20.0
POLL_MS = 2000  # dashboard.js's polling period


def _chromium() -> tuple[Any, str]:
    path = shutil.which("chromium")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        sync_playwright = None
    if path and sync_playwright:
        return sync_playwright, path
    reason = "needs the playwright package and Debian's chromium (apt-get install -y chromium)"
    if os.environ.get(REQUIRE_ENV) == "1":
        pytest.fail(f"{reason}, and ${REQUIRE_ENV}=1")
    pytest.skip(reason)


def _polls(page: Any) -> int:
    return int(page.get_attribute("#status", "data-polls"))


def test_the_page_draws_and_keeps_updating(fleet: LiveFleet, tmp_path: Path) -> None:
    sync_playwright, chromium = _chromium()
    problems: list[str] = []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
        try:
            page = browser.new_page(viewport={"width": 1500, "height": 1300})
            page.on("console", lambda m: m.type in ("error", "warning") and problems.append(m.text))
            page.on("pageerror", lambda e: problems.append(str(e)))
            page.on("requestfailed", lambda r: problems.append(f"{r.url}: {r.failure}"))
            page.goto(f"{fleet.served.admin_url}/dashboard?token={ADMIN_TOKEN}")
            assert page.url == f"{fleet.served.admin_url}/dashboard"  # the token left the URL
            page.wait_for_selector('#status[data-polls="3"]')  # no eval: the page's CSP forbids it
            row = page.inner_text("#instances tbody tr")
            assert f"vm:{fleet.agent.port}" in row and "mixed" in row and "GPU" in row
            start, seen = _polls(page), []
            deadline = time.monotonic() + WATCH_S
            while time.monotonic() < deadline:
                page.wait_for_timeout(POLL_MS)
                seen.append(_polls(page))
            assert seen[-1] - start >= WATCH_S * 1000 / POLL_MS - 3, seen  # it kept polling
            assert seen == sorted(seen) and len(set(seen)) > len(seen) // 2, seen
            charts = page.eval_on_selector_all(".chart canvas", "cs => cs.length")
            assert charts >= 11, "every chart draws on a canvas"
            legends = page.inner_text("#chart-requests")
            assert "Requests by status" in legends and "200" in legends
            shots = Path(os.environ.get("KVHERD_SCREENSHOT_DIR", tmp_path))
            page.screenshot(path=str(shots / "dashboard.png"), full_page=True)
        finally:
            browser.close()
    assert not problems, problems
