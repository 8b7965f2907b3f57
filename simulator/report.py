"""Reports for simulated and replayed runs: markdown to stdout, JSON and CSV files, PNG plots.

Contract:
- One format for `kvherd sim` and `kvherd replay`: `summary.json` is
  ``{"meta": {...}, "results": {label: summary}}`` (a label per policy, or the replay's label),
  `summary.csv` holds one row per label with the same keys, and `requests_<label>.csv` one row per
  request. A simulated and a real run therefore compare column by column.
- `markdown_table` puts runs side by side (one column per label, one row per metric); the P/D
  rows (handoffs ok/fallback, GB moved and deduplicated, handoff downtime), like the admission,
  prefix-pull and LoRA adapter rows, only when some run has them.
- Plots use matplotlib's Agg backend (no display): `ttft_cdf.png` (TTFT CDF per label) and
  `load_<label>.png` (per-instance running + waiting requests over time) when load samples exist.
- NaN values are written as JSON null and as empty CSV cells.
"""

from __future__ import annotations

import csv
import json
import math
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from simulator.metrics import PERCENTILES

_LATENCIES = (
    ("ttft", "TTFT"),
    ("tpot", "TPOT"),
    ("itl", "ITL"),
    ("e2e", "E2E"),
    ("queue", "queueing"),
)
_SCALARS = (
    ("completed", "completed requests", "{:.0f}"),
    ("failed", "failed requests", "{:.0f}"),
    ("request_throughput", "throughput (req/s)", "{:.3f}"),
    ("output_throughput", "throughput (output tok/s)", "{:.1f}"),
    ("goodput", "goodput (req/s within SLOs)", "{:.3f}"),
    ("slo_attainment", "SLO attainment", "{:.1%}"),
    ("prefix_hit_rate", "prefix hit rate (tokens)", "{:.1%}"),
    ("preemptions", "preemptions", "{:.0f}"),
    ("migrations", "migrations", "{:.0f}"),
)


_PD_ROWS = (
    ("handoffs_ok", "P/D handoffs ok", "{:.0f}"),
    ("handoffs_fallback", "P/D handoffs fallback", "{:.0f}"),
    ("handoff_gbytes", "P/D KV moved (GB)", "{:.2f}"),
    ("handoff_dedup_gbytes", "P/D KV deduplicated (GB)", "{:.2f}"),
    ("handoff_downtime_ms_mean", "P/D handoff downtime mean (ms)", "{:.2f}"),
)

_PULL_ROWS = (
    ("pulls", "prefix pulls", "{:.0f}"),
    ("pulls_fallback", "prefix pulls fallen back to recompute", "{:.0f}"),
    ("pull_decided_route", "routed to the prefix holder", "{:.0f}"),
    ("pull_gbytes", "KV pulled (GB)", "{:.2f}"),
    ("pull_ms_mean", "pull time mean (ms)", "{:.1f}"),
    ("hit_rate_pulled", "prefix hit rate from pulled blocks", "{:.1%}"),
)

_LORA_ROWS = (
    ("lora_loads", "LoRA adapter loads", "{:.0f}"),
    ("lora_evictions", "LoRA adapter evictions", "{:.0f}"),
    ("lora_slot_waits", "requests waiting for an adapter slot", "{:.0f}"),
)

_SCALE_ROWS = (
    ("instance_hours", "instance-hours held", "{:.2f}"),
    ("instances_max", "instances at most", "{:.0f}"),
    ("scale_outs", "scale-outs", "{:.0f}"),
    ("scale_ins", "scale-ins", "{:.0f}"),
)

_ADMISSION_ROWS = (
    ("refused", "refused (429)", "{:.0f}"),
    ("refused_queue_wait", "refused: expected wait", "{:.0f}"),
    ("refused_queue_full", "refused: queue full", "{:.0f}"),
    ("refused_queue_timeout", "refused: queue timeout", "{:.0f}"),
    ("admission_queued", "admission-queued requests", "{:.0f}"),
    ("admission_wait_ms_mean", "admission queue wait mean (ms)", "{:.1f}"),
    ("admission_wait_ms_p99", "admission queue wait p99 (ms)", "{:.1f}"),
)


def metric_rows() -> list[tuple[str, str, str]]:
    """(key, label, format) of every row the markdown table shows, in order."""
    rows: list[tuple[str, str, str]] = []
    for key, label in _LATENCIES:
        for stat in ("mean", *(f"p{q}" for q in PERCENTILES)):
            rows.append((f"{key}_ms_{stat}", f"{label} {stat} (ms)", "{:.1f}"))
    rows.extend(_SCALARS)
    return rows


def _fmt(value: Any, fmt: str) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return fmt.format(value)


def markdown_table(results: Mapping[str, Mapping[str, Any]]) -> str:
    labels = list(results)
    lines = [
        "| metric | " + " | ".join(labels) + " |",
        "|---|" + "---:|" * len(labels),
    ]
    rows = metric_rows()
    # Shown when some run has them.
    for extra in (_SCALE_ROWS, _ADMISSION_ROWS, _PD_ROWS, _PULL_ROWS, _LORA_ROWS):
        rows.extend(row for row in extra if any(row[0] in r for r in results.values()))
    for key, label, fmt in rows:
        cells = [_fmt(results[name].get(key), fmt) for name in labels]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _clean(value: Any) -> Any:
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_clean(v) for v in value]
    if isinstance(value, np.integer):
        return int(value)
    if isinstance(value, np.floating):
        return _clean(float(value))
    return value


def safe_label(label: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", label) or "run"


def write_json(
    out_dir: Path, meta: Mapping[str, Any], results: Mapping[str, Mapping[str, Any]]
) -> Path:
    path = out_dir / "summary.json"
    payload = {
        "meta": _clean(dict(meta)),
        "results": _clean({k: dict(v) for k, v in results.items()}),
    }
    path.write_text(json.dumps(payload, indent=2, sort_keys=True) + "\n")
    return path


def write_summary_csv(out_dir: Path, results: Mapping[str, Mapping[str, Any]]) -> Path:
    path = out_dir / "summary.csv"
    keys: list[str] = []
    for summary in results.values():
        keys.extend(k for k in summary if k not in keys)
    with path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["label", *keys])
        for label, summary in results.items():
            writer.writerow([label, *(_csv_cell(summary.get(k)) for k in keys)])
    return path


def _csv_cell(value: Any) -> Any:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return ""
    return value


def write_requests_csv(out_dir: Path, label: str, columns: Mapping[str, np.ndarray]) -> Path:
    """Per-request timelines (seconds), plus derived TTFT/E2E in milliseconds."""
    path = out_dir / f"requests_{safe_label(label)}.csv"
    names = list(columns)
    derived = {
        "ttft_ms": (columns["first_token"] - columns["arrival"]) * 1000.0,
        "e2e_ms": (columns["last_token"] - columns["arrival"]) * 1000.0,
    }
    with path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow([*names, *derived])
        n = len(columns["index"])
        for i in range(n):
            row = [_csv_value(columns[name][i]) for name in names]
            row += [_csv_value(values[i]) for values in derived.values()]
            writer.writerow(row)
    return path


def _csv_value(value: Any) -> Any:
    if isinstance(value, float | np.floating):
        number = float(value)
        if math.isnan(number):
            return ""
        return int(number) if number.is_integer() and abs(number) < 2**53 else number
    return value


def plot_ttft_cdf(out_dir: Path, ttfts_ms: Mapping[str, np.ndarray]) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, values in ttfts_ms.items():
        values = np.sort(values[~np.isnan(values)])
        if not len(values):
            continue
        ax.plot(values / 1000.0, np.arange(1, len(values) + 1) / len(values), label=label)
    ax.set_xscale("log")
    ax.set_xlabel("TTFT (s)")
    ax.set_ylabel("fraction of requests")
    ax.set_title("Time to first token, CDF")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    path = out_dir / "ttft_cdf.png"
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_load(
    out_dir: Path,
    label: str,
    times: Sequence[float],
    loads: Mapping[str, Sequence[int]],
) -> Path:
    """Per-instance requests (running + waiting) over time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    many = len(loads) > 16
    for instance_id, values in loads.items():
        ax.plot(times, values, linewidth=0.6 if many else 1.0, label=None if many else instance_id)
    ax.set_xlabel("time (s)")
    ax.set_ylabel("requests on instance (running + waiting)")
    ax.set_title(f"Per-instance load: {label}")
    ax.grid(True, alpha=0.3)
    if not many:
        ax.legend(fontsize="small", ncol=2)
    path = out_dir / f"load_{safe_label(label)}.png"
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
