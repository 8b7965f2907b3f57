"""The live page in headless Chromium (Debian's, driven by playwright): it logs in, draws its
charts from a running fleet and keeps updating for 20 s with no error in the browser console.

Needs the ``playwright`` package and a ``chromium`` binary (never a downloaded browser); the
test skips without them, unless ``KVHERD_REQUIRE_BROWSER=1`` (CI), where it fails
(`browser.chromium`). Its screenshot is an artifact: ``$KVHERD_ARTIFACTS/dashboard.png``
(default ``.ci/artifacts/``).
"""

from __future__ import annotations

import time
from typing import Any

from browser import LAUNCH_ARGS, artifact, chromium
from live_fleet import LiveFleet
from serve_process import ADMIN_TOKEN

WATCH_S = 20.0
POLL_MS = 2000  # dashboard.js's polling period


def _polls(page: Any) -> int:
    return int(page.get_attribute("#status", "data-polls"))


def test_the_page_draws_and_keeps_updating(fleet: LiveFleet) -> None:
    sync_playwright, executable = chromium()
    problems: list[str] = []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=executable, args=LAUNCH_ARGS)
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
            page.screenshot(path=str(artifact("dashboard.png")), full_page=True)
        finally:
            browser.close()
    assert not problems, problems
