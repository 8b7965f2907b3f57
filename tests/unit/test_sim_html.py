"""`kvherd sim --html`: one self-contained page with the report's charts, drawn without errors.

The drawing is checked in headless Chromium (`browser.chromium`: skipped without playwright and
Debian's chromium, failed under ``KVHERD_REQUIRE_BROWSER=1``); its screenshot is an artifact,
``$KVHERD_ARTIFACTS/sim-report.png`` (default ``.ci/artifacts/``).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from browser import LAUNCH_ARGS, artifact, chromium

from kvherd.cli import main


@pytest.fixture(scope="module")
def page(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("sim")
    trace = "synthetic:requests=120,rate=40,input_mean=1024,output_mean=32,num_groups=4,seed=1"
    argv = ["sim", trace, "--instances", "3", "--policy", "kvherd,round_robin", "--admission"]
    argv += ["--out", str(out), "--no-plots", "--quiet", "--html", str(out / "report.html")]
    assert main(argv) == 0
    return out / "report.html"


def test_the_page_is_self_contained_and_has_every_series(page: Path) -> None:
    text = page.read_text()
    tags = re.findall(r"<(?:script|link)\b[^>]*>", text)
    assert not [t for t in tags if re.search(r"https?:", t)], tags
    assert "uPlot" in text and ".uplot" in text  # the library and its CSS, inlined
    data = json.loads(re.search(r"const DATA = (.*?);</script>", text, re.S).group(1))  # type: ignore[union-attr]
    titles = [chart["title"] for chart in data["charts"]]
    for fleet in ("TTFT p99", "TPOT p50", "Arrivals", "Prefix hit rate", "Refusals", "Migrated"):
        chart = next(c for c in data["charts"] if c["title"].startswith(fleet))
        assert set(chart["lines"]) == {"kvherd", "round_robin"}
        assert all(len(v) == len(chart["time"]) for v in chart["lines"].values())
    for run in ("kvherd", "round_robin"):
        for per_instance in ("running", "waiting", "GPU KV blocks in use"):
            assert f"{run}: {per_instance}" in titles
    kv = next(c for c in data["charts"] if c["title"] == "kvherd: GPU KV blocks in use")
    assert len(kv["lines"]) == 3 and max(max(v) for v in kv["lines"].values()) > 0
    arrivals = next(c for c in data["charts"] if c["title"] == "Arrivals")["lines"]["kvherd"]
    assert sum(arrivals) > 0
    assert "<td>refused (429)</td>" in text  # the summary table, admission rows included


def test_the_page_draws_in_a_browser(page: Path) -> None:
    sync_playwright, executable = chromium()
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=executable, args=LAUNCH_ARGS)
        try:
            tab = browser.new_page()
            errors: list[str] = []
            tab.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
            tab.on("pageerror", lambda e: errors.append(str(e)))
            tab.goto(page.as_uri())
            tab.wait_for_selector("canvas")
            charts = len(json.loads(tab.evaluate("JSON.stringify(DATA.charts.map(c => c.title))")))
            assert tab.locator(".uplot canvas").count() == charts == 9 + 2 * 3
            tab.screenshot(path=str(artifact("sim-report.png")), full_page=True)
            assert errors == []
        finally:
            browser.close()
