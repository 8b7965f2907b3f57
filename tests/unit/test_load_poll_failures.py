"""Load-poll failures are counted and logged at WARNING after a few in a row (a slow scrape too)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

import pytest

from scheduler.core.load_report import parse_prometheus
from scheduler.load_poller import LoadPoller

VLLM_METRICS = (
    b'vllm:num_requests_running{engine="0",model_name="m"} 1.0\n'
    b'vllm:cache_config_info{block_size="128",engine="0",num_gpu_blocks="8192"} 1.0\n'
)


@contextlib.asynccontextmanager
async def slow_vllm(delay: dict[str, float]) -> AsyncIterator[str]:
    """A plain HTTP server without the agent state route whose /metrics takes `delay["s"]`."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError):
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                if head.split(b" ")[1] != b"/metrics":
                    writer.write(b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\n\r\n")
                else:
                    await asyncio.sleep(delay["s"])
                    writer.write(
                        b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%s"
                        % (len(VLLM_METRICS), VLLM_METRICS)
                    )
                await writer.drain()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.close()
        await server.wait_closed()


def test_cache_config_info_gives_the_engine_block_size() -> None:
    report = parse_prometheus(VLLM_METRICS.decode(), block_size=16)
    assert (report.block_size, report.num_total_blocks) == (128, 8192)


async def test_slow_scrapes_are_counted_and_warned(caplog: pytest.LogCaptureFixture) -> None:
    delay = {"s": 0.5}
    failed: list[str] = []
    reports = []
    async with slow_vllm(delay) as url:
        poller = LoadPoller(
            lambda: {"v": url},
            lambda i, r: reports.append(r),
            lambda i: 16,
            timeout_s=0.1,
            on_failure=failed.append,
            warn_after=3,
        )
        try:
            with caplog.at_level(logging.DEBUG, logger="kvherd.load"):
                for _ in range(2):
                    await poller.poll_all()
                assert failed == ["v", "v"] and reports == []
                assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
                await poller.poll_all()
                warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
                assert len(warnings) == 1
                assert "3 times in a row" in warnings[0].getMessage()
                assert "no answer within 0.1 s" in warnings[0].getMessage()
                assert poller.failures_total == {"v": 3}
                delay["s"] = 0.0
                await poller.poll_all()
                assert reports[-1].block_size == 128
                assert any("succeeds again" in r.getMessage() for r in caplog.records)
                assert poller.failures_total == {"v": 3}  # the total stays; the run ends
        finally:
            await poller.stop()
