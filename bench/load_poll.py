"""The proxy's CPU for polling two vLLM servers' /metrics, scanner against prometheus_client.

What it does: serves the page a real vLLM 0.32 served (``tests/support/vllm_metrics_0.32.txt``,
614 lines) from a separate process, and runs kvherd's `LoadPoller` against it as two instances
at the default interval (0.25 s) for ``--seconds`` per round, measuring this process's CPU time.
Rounds alternate the load report's scanner (``scheduler.core.prom_text``) with the page parsed
by ``prometheus_client`` first, as kvherd did before (the baseline). Prints, per form, the median
share of a core the polling takes and the median ratio of the pairs; ``--json FILE`` keeps them.

Run: ``python bench/load_poll.py [--rounds 5] [--seconds 5]``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "support"))

from agent_process import free_port  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

import scheduler.load_poller as load_poller  # noqa: E402
from scheduler.core.load_report import LoadReport, parse_prometheus  # noqa: E402

PAGE = ROOT / "tests" / "support" / "vllm_metrics_0.32.txt"


def _baseline(text: str, block_size: int = 16) -> LoadReport:
    """As before the scanner: prometheus_client builds every family of the page."""
    for _family in text_string_to_metric_families(text):
        pass
    return parse_prometheus(text, block_size)


async def _poll_for(url: str, seconds: float) -> tuple[float, int]:
    reports = 0

    def count(_instance: str, _report: LoadReport) -> None:
        nonlocal reports
        reports += 1

    poller = load_poller.LoadPoller(
        lambda: {"vllm-a": url, "vllm-b": url}, count, lambda _instance: 128
    )
    await poller.poll_all()  # the 404 on the agent state route: scrape-only from here on
    cpu = time.process_time()
    poller.start()
    await asyncio.sleep(seconds)
    await poller.stop()
    return (time.process_time() - cpu) / seconds, reports


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="kvherd-load-poll-"))
    shutil.copy(PAGE, root / "metrics")
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1"],
        cwd=root, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    shares: dict[str, list[float]] = {"scanner": [], "prometheus_client": []}
    try:
        time.sleep(1.0)
        for k in range(args.rounds):
            forms = ["scanner", "prometheus_client"]
            for form in forms if k % 2 == 0 else forms[::-1]:
                load_poller.parse_prometheus = (
                    parse_prometheus if form == "scanner" else _baseline
                )
                share, reports = asyncio.run(_poll_for(url, args.seconds))
                assert reports > 0, "no poll succeeded"
                shares[form].append(share)
    finally:
        server.terminate()
        server.wait()
        shutil.rmtree(root, ignore_errors=True)
    ratios = [
        s / b for s, b in zip(shares["scanner"], shares["prometheus_client"], strict=True)
    ]
    medians = {form: statistics.median(v) for form, v in shares.items()}
    result = {
        "core_share_median": medians,
        "ratio_median": statistics.median(ratios),
        "rounds": args.rounds,
        "seconds": args.seconds,
    }
    print("| form | share of a core, median |\n|---|---:|")
    for form, value in medians.items():
        print(f"| {form} | {100 * value:.1f}% |")
    print(f"scanner / prometheus_client, median of {args.rounds} pairs: {result['ratio_median']:.2f}")
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
