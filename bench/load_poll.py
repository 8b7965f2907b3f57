"""The proxy's CPU for polling two vLLM servers' /metrics: its pool and scanner against before.

What it does: serves the page a real vLLM 0.32 served (``tests/support/vllm_metrics_0.32.txt``,
614 lines) from a separate keep-alive HTTP/1.1 process, and runs kvherd's `LoadPoller` against it
as two instances at the default interval (0.25 s) for ``--seconds`` per round, measuring this
process's CPU time. Each round runs three forms in a rotating order: ``pool + scanner`` (kvherd
now: its own keep-alive pool, ``scheduler.core.prom_text``), ``httpx + scanner`` (the pages
fetched with ``httpx.AsyncClient``, as before) and ``httpx + prometheus_client`` (every family of
the page built first, as before that: the baseline). Prints, per form, the median share of a core
the polling takes and its median ratio to the baseline in the same round; ``--json FILE`` keeps
them.

Run: ``python bench/load_poll.py [--rounds 5] [--seconds 5]``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "support"))

import httpx  # noqa: E402
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


class _HttpxPoller(load_poller.LoadPoller):
    """As before the pool: each page fetched with one shared ``httpx.AsyncClient``."""

    _client: httpx.AsyncClient | None = None

    async def _get(self, url: str, path: bytes) -> tuple[int, bytes]:
        if self._client is None:
            self._client = httpx.AsyncClient(timeout=self.timeout_s, trust_env=False)
        response = await self._client.get(url + path.decode())
        return response.status_code, response.content


SERVER = """
import http.server, sys
page = open(sys.argv[1], "rb").read()
class Page(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as vLLM's uvicorn
    def do_GET(self):
        if self.path != "/metrics":  # a vLLM server has no kvherd state endpoint
            self.send_response(404)
            self.send_header("content-length", "0")
            self.end_headers()
            return
        self.send_response(200)
        self.send_header("content-type", "text/plain; version=0.0.4; charset=utf-8")
        self.send_header("content-length", str(len(page)))
        self.end_headers()
        self.wfile.write(page)
    def log_message(self, *args):
        pass
http.server.ThreadingHTTPServer(("127.0.0.1", int(sys.argv[2])), Page).serve_forever()
"""

FORMS = ("pool + scanner", "httpx + scanner", "httpx + prometheus_client")


async def _poll_for(url: str, seconds: float, form: str) -> tuple[float, int]:
    reports = 0

    def count(_instance: str, _report: LoadReport) -> None:
        nonlocal reports
        reports += 1

    kind = load_poller.LoadPoller if form == "pool + scanner" else _HttpxPoller
    poller = kind(lambda: {"vllm-a": url, "vllm-b": url}, count, lambda _instance: 128)
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
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-c", SERVER, str(PAGE), str(port)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    shares: dict[str, list[float]] = {form: [] for form in FORMS}
    try:
        time.sleep(1.0)
        for k in range(args.rounds):
            for form in FORMS[k % 3 :] + FORMS[: k % 3]:
                load_poller.parse_prometheus = (
                    _baseline if form == "httpx + prometheus_client" else parse_prometheus
                )
                share, reports = asyncio.run(_poll_for(url, args.seconds, form))
                assert reports > 0, "no poll succeeded"
                shares[form].append(share)
    finally:
        server.terminate()
        server.wait()
    base = shares[FORMS[-1]]
    ratios = {
        form: statistics.median(s / b for s, b in zip(v, base, strict=True))
        for form, v in shares.items()
    }
    medians = {form: statistics.median(v) for form, v in shares.items()}
    result = {
        "core_share_median": medians,
        "ratio_to_baseline_median": ratios,
        "rounds": args.rounds,
        "seconds": args.seconds,
    }
    print("| form | share of a core, median | to the baseline, median of rounds |")
    print("|---|---:|---:|")
    for form, value in medians.items():
        print(f"| {form} | {100 * value:.1f}% | {ratios[form]:.2f} |")
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
