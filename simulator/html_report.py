"""`kvherd sim --html FILE`: the run's report as one self-contained HTML page of uPlot charts.

Contract: `write_html(path, meta, runs)` writes one file that needs nothing else: uPlot (the copy
the live dashboard vendors, read from `scheduler.proxy`'s `dashboard_assets/` as a data file, no
module of it imported), its CSS, the data (JSON) and the drawing script are inlined; no URL is
fetched. Fleet charts put the runs (policies) side by side over time buckets of the trace (about
120): TTFT and TPOT p50/p99 by arrival, arrivals and completions per second, prefix hit rate by
arrival, refusals (429) per second, migrated requests by completion. Each run then has its
per-instance charts at the simulator's load samples (thinned evenly to 600): running, waiting,
share of GPU KV blocks in use. Above them, `report.markdown_table`'s rows (pulls, P/D, admission
totals with them) as a table. Empty buckets are gaps (null); the page is a function of its input.
"""

from __future__ import annotations

import html
import json
import math
from collections.abc import Mapping
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np

from simulator import report
from simulator.experiment import SimResult

_BUCKETS = 120
_MAX_SAMPLES = 600  # per-instance points per chart; more samples are thinned evenly
_ASSETS = ("uPlot.min.css", "uPlot.iife.min.js")


def _asset(name: str) -> str:
    return (resources.files("scheduler.proxy") / "dashboard_assets" / name).read_text()


def _per_bucket(
    edges: np.ndarray, times: np.ndarray, values: np.ndarray, reduce: Any
) -> list[float | None]:
    """`reduce(values in bucket)` per bucket of `times`; None where a bucket has no value."""
    keep = ~(np.isnan(times) | np.isnan(values))
    which = np.digitize(times[keep], edges[1:-1])
    kept = values[keep]
    out: list[float | None] = []
    for b in range(len(edges) - 1):
        chunk = kept[which == b]
        out.append(round(float(reduce(chunk)), 4) if len(chunk) else None)
    return out


def _rate(edges: np.ndarray, times: np.ndarray) -> list[float]:
    counts, _ = np.histogram(times[~np.isnan(times)], bins=edges)
    return np.round(counts / np.diff(edges), 4).tolist()


def _fleet_series(result: SimResult, edges: np.ndarray) -> dict[str, list[Any]]:
    cols = result.columns
    arrival, first, last = cols["arrival"], cols["first_token"], cols["last_token"]
    ttft = (first - arrival) * 1000.0
    tokens = cols["output_tokens"]
    tpot = np.where(tokens > 1, (last - first) * 1000.0 / np.maximum(tokens - 1, 1), np.nan)
    prompt = cols["prompt_tokens"]
    hit = np.where(prompt > 0, cols["cached_tokens"] / np.maximum(prompt, 1), np.nan)
    migrated = np.where(cols["migrations"] > 0, last, np.nan)
    out: dict[str, list[Any]] = {}
    for q in (50, 99):
        pct = lambda v, q=q: np.percentile(v, q)  # noqa: E731
        out[f"ttft_p{q}"] = _per_bucket(edges, arrival, ttft, pct)
        out[f"tpot_p{q}"] = _per_bucket(edges, arrival, tpot, pct)
    out["arrivals"] = _rate(edges, np.concatenate([arrival, result.refused_arrivals]))
    out["completions"] = _rate(edges, last)
    out["hit_rate"] = _per_bucket(edges, arrival, hit, np.mean)
    out["refusals"] = _rate(edges, np.asarray(result.refused_arrivals, dtype=float))
    out["migrated"] = _rate(edges, migrated)
    return out


_FLEET_CHARTS = (  # (title, unit, series key of each run; one line per run and key)
    ("TTFT p50", "ms", "ttft_p50"),
    ("TTFT p99", "ms", "ttft_p99"),
    ("TPOT p50", "ms", "tpot_p50"),
    ("TPOT p99", "ms", "tpot_p99"),
    ("Arrivals", "req/s", "arrivals"),
    ("Completions", "req/s", "completions"),
    ("Prefix hit rate, by arrival", "share of prompt tokens", "hit_rate"),
    ("Refusals (429)", "req/s", "refusals"),
    ("Migrated requests, by completion", "req/s", "migrated"),
)


def _charts(runs: Mapping[str, SimResult]) -> list[dict[str, Any]]:
    end = max(
        (
            float(np.nanmax(r.columns["last_token"]))
            for r in runs.values()
            if len(r.columns["index"])
        ),
        default=1.0,
    )
    edges = np.linspace(0.0, max(end, 1e-3), _BUCKETS + 1)
    mids = np.round((edges[:-1] + edges[1:]) / 2, 3).tolist()
    series = {label: _fleet_series(result, edges) for label, result in runs.items()}
    charts = [
        {
            "title": title,
            "unit": unit,
            "time": mids,
            "lines": {label: s[key] for label, s in series.items()},
        }
        for title, unit, key in _FLEET_CHARTS
    ]
    for label, result in runs.items():
        step = max(1, math.ceil(len(result.load_times) / _MAX_SAMPLES))  # every step-th sample
        waiting = {iid: np.asarray(v[::step]) for iid, v in result.waiting_samples.items()}
        running = {
            iid: np.asarray(v[::step]) - waiting[iid] for iid, v in result.load_samples.items()
        }
        kv_use = {iid: np.round(v[::step], 4) for iid, v in result.kv_use_samples.items()}
        for title, unit, lines in (
            ("running", "requests", running),
            ("waiting", "requests", waiting),
            ("GPU KV blocks in use", "share", kv_use),
        ):
            charts.append(
                {
                    "title": f"{label}: {title}",
                    "unit": unit,
                    "time": np.round(result.load_times[::step], 3).tolist(),
                    "lines": {iid: values.tolist() for iid, values in lines.items()},
                }
            )
    return charts


def _table(runs: Mapping[str, SimResult]) -> str:
    results = {label: r.summary for label, r in runs.items()}
    lines = report.markdown_table(results).splitlines()
    rows = [[cell.strip() for cell in line.strip("|").split("|")] for line in lines]
    head = "".join(f"<th>{html.escape(c)}</th>" for c in rows[0])
    body = "".join(
        "<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>" for row in rows[2:]
    )
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def _json(value: Any) -> str:
    """JSON for inside a <script>: no `</` to end the element early."""
    return json.dumps(value, allow_nan=False).replace("</", "<\\/")


_SCRIPT = """
const COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2",
                "#7f7f7f", "#bcbd22", "#17becf"];
for (const spec of DATA.charts) {
  const labels = Object.keys(spec.lines);
  const box = document.createElement("div");
  box.className = "chart";
  document.getElementById("charts").appendChild(box);
  new uPlot({
    title: `${spec.title} (${spec.unit})`,
    width: 470,
    height: 220,
    scales: { x: { time: false } },
    axes: [{ label: "time (s)" }, { size: 70 }],
    series: [{ label: "t (s)" }, ...labels.map((l, i) => ({
      label: l, stroke: COLORS[i % COLORS.length], width: 1.5, spanGaps: false }))],
  }, [spec.time, ...labels.map((l) => spec.lines[l])], box);
}
"""

_STYLE = """
body { font-family: system-ui, sans-serif; margin: 1.5em; color: #222; }
table { border-collapse: collapse; margin-bottom: 1.5em; font-size: 0.9em; }
td, th { border: 1px solid #ccc; padding: 2px 8px; text-align: right; }
td:first-child, th:first-child { text-align: left; }
#charts { display: flex; flex-wrap: wrap; gap: 12px; }
"""


def write_html(path: Path, meta: Mapping[str, Any], runs: Mapping[str, SimResult]) -> Path:
    css, uplot = (_asset(name) for name in _ASSETS)
    title = f"kvherd sim: {Path(str(meta.get('trace', ''))).name}"
    facts = ", ".join(
        f"{k} {v}"
        for k, v in meta.items()
        if k in ("requests", "instances", "rate_scale", "seed") and v is not None
    )
    page = f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>
<style>{css}</style><style>{_STYLE}</style></head>
<body><h1>{html.escape(title)}</h1>
<p>{html.escape(facts)}; latency model {html.escape(str(meta["latency_model"]["name"]))}</p>
{_table(runs)}
<div id="charts"></div>
<script>{uplot}</script>
<script>const DATA = {_json({"charts": _charts(runs)})};</script>
<script>{_SCRIPT}</script>
</body></html>
"""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(page)
    return path
