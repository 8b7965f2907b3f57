"""Overload at ten times the fleet's capacity, behind a real ``kvherd serve`` process
(`overload_flood.flood`), with short (32-token) and long (256-token) requests, on agents that queue
most of a flood (batches of 8) and on agents that take it into their batch (64, the default).
What must hold:
- admission by expected wait: every flood request is answered 200 or 429 (never 5xx), each 429
  with ``Retry-After`` and the OpenAI error object, within 50 ms at the median;
- no healthy agent is ejected (``kvherd_ejections_total`` stays absent, both stay healthy);
- normal service returns soon after the flood ends (target 2 s): asserted with room for a shared
  machine (4 s for short requests, 6 s for long ones, which first drain the admitted work, 9 s
  for long ones in batches of 64), and printed.
The other test: idle connections past the connection cap leave the admin API reachable.
"""

from __future__ import annotations

import asyncio
import contextlib
import json

import httpx
import pytest
from overload_flood import flood, poisson
from serve_process import serve_process

pytestmark = pytest.mark.timeout(300)


@pytest.mark.parametrize(
    ("max_tokens", "max_num_seqs"),
    [
        pytest.param(32, 8, id="short"),
        pytest.param(256, 8, id="long"),
        pytest.param(256, 64, id="long-large-batch"),
    ],
)
async def test_flood_is_refused_by_expected_wait_and_service_recovers(
    max_tokens: int, max_num_seqs: int
) -> None:
    report = await flood(max_tokens, max_num_seqs)
    print("\n" + report.summary())
    statuses = report.statuses
    assert set(statuses) <= {200, 429}, statuses
    assert statuses.get(429, 0) > 0, "a flood at several times capacity must be refused in part"
    for headers, data in report.refusals[:20]:
        assert int(headers[b"retry-after"]) >= 1
        error = json.loads(data)["error"]
        assert error["type"] == "rate_limit_error" and error["code"] in {"queue_wait", "queue_full"}
    # A refusal is cheap: answered in milliseconds while the proxy has CPU left (target 50 ms at
    # the median; measured 1 ms on the shared machine).
    assert report.refusal_p50_s is not None and report.refusal_p50_s <= 0.05, report.summary()
    assert not report.ejection_lines, report.ejection_lines
    assert report.health == {"healthy"}, report.health
    # Target 2 s, measured on a shared 2-core machine (bench/HISTORY.md, 2026-12-01): short
    # requests 0.2-0.35 s; long ones first drain what was admitted, 0.7-2.1 s with batches of 8
    # (the running batch and a standing queue of 0.25 s), 1.7-4.5 s with batches of 64 (the flood
    # runs in the batch, which admission does not see as a queue: the known gap). Asserted with
    # room for a loaded machine.
    bound = 4.0 if max_tokens <= 32 else 6.0 if max_num_seqs <= 8 else 9.0
    assert report.recovered_s is not None and report.recovered_s <= bound, (
        report.recovered_s,
        report.probes,
    )


async def test_ordinary_traffic_at_80_percent_of_capacity_is_not_refused() -> None:
    """Admission refuses what the engines would queue, never what they would start: Poisson
    arrivals at 80% of the measured capacity are refused at most 0.5% of the time.

    A run is a sample of a shared machine whose speed swings within a run (closed-loop capacity
    146-234 req/s across nine runs here, 2026-12-02): where the fleet fell behind for a while
    (54 requests outstanding on 16 slots, 0.35 s each) the queue was real and refusing was right
    (1-5% of a run, in 2 of 9 runs). So the test fails only when two runs both refuse more,
    which a rule too strict at 80% does every time."""
    for _ in range(2):
        run = await poisson(32, 8, load=0.8, seconds=8.0)
        statuses = run.statuses
        print(
            f"\nPoisson at {run.arrival_rate:.1f} req/s for 8 s (capacity {run.capacity:.1f} "
            f"before, {run.capacity_after:.1f} after: load {run.load:.2f}): {statuses}"
        )
        assert set(statuses) <= {200, 429}, statuses
        if statuses.get(429, 0) <= 0.005 * sum(statuses.values()):
            return
    raise AssertionError(f"two runs at 80% of capacity refused more than 0.5%: {statuses}")


async def test_idle_connections_leave_the_admin_api_reachable() -> None:
    """Under a low open-file limit, idle client connections past the cap are answered 429 and
    closed (refused cleanly, never reset; no 503, the instances are healthy): the process keeps
    descriptors for its admin API, which stays reachable."""
    with serve_process([], fd_limit=512) as served:  # the connection cap is then 128
        host, port = served.url.removeprefix("http://").split(":")
        idle = [await asyncio.open_connection(host, int(port)) for _ in range(600)]
        refused = 0
        for reader, _ in idle:
            with contextlib.suppress(asyncio.TimeoutError):
                head = await asyncio.wait_for(reader.read(512), 0.05)
                if head.startswith(b"HTTP/1.1 429"):
                    assert b"too_many_connections" in head and b"retry-after: 1" in head
                    refused += 1
        async with httpx.AsyncClient(timeout=10) as http:
            admin = await http.get(
                served.admin_url + "/admin/v1/instances",
                headers=served.admin_headers,
            )
            assert admin.status_code == 200, admin.text
            for _, writer in idle:
                writer.close()
            await asyncio.sleep(0.2)  # the proxy sees the closes
            models = await http.get(served.url + "/v1/models")
            assert models.status_code == 200, models.text
    assert refused >= 600 - 128 - 16, refused  # a few may still be in flight when read
