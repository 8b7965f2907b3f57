"""Overload at ten times a fleet's capacity, behind a real ``kvherd serve`` process (shared by
``tests/chaos/test_overload.py`` and ``bench/chaos_bench.py``).

Contract:
- `flood(max_tokens, max_num_seqs=8)` starts two agents (``--max-num-seqs``: 8 queues most of a
  flood in the engines; 64 runs it in their batches) and ``kvherd serve`` (its event loop
  is the one a flood saturates) with the shipped admission defaults (``--max-queue-wait`` 1 s,
  ``--standing-queue-wait`` 0.25 s),
  measures the fleet's capacity (closed loop, 32 clients), sends normal load for `BASELINE_S`
  seconds (a request every 0.1 s, or at half the fleet's capacity where that is less), floods it
  open-loop at `FLOOD_FACTOR`x capacity for `FLOOD_S` seconds, then sends the normal load again
  for 10 s.
- Every request is a completion of `max_tokens` tokens with a distinct first token (no prefix
  shared). The `FloodReport` holds what was answered (statuses, sample refusals), the proxy's
  ejection metric lines and instance health afterwards, and `recovered_s`
  (`simulator.overload.recovered_s`, the rule `kvherd sim`'s flood bench uses too): seconds from
  the flood's end until the end of the first probe from which every probe is served (200, to the
  last) and 90% of those sent in the next `RECOVERY_WINDOW_S` at normal latency (at most twice
  the median latency of the same load before the flood, or 0.25 s more), so one scheduling
  hiccup of a shared machine is not read as a relapse; None when service never recovered.
  Normal latency is measured at the normal load, not one request at a time: long requests
  batched on shared CPUs take 1.5-4x longer at half capacity than alone, flood or no flood.
  Latency later than the window is not judged: what a flood left queued delays the probes right
  after it, where the window sees it, while the shared machine's own speed swings (by 2-3x
  within a run, measured) would read as a relapse. Each 429's latency is kept too.
- `poisson(max_tokens, max_num_seqs, load, seconds)`: ordinary Poisson traffic at `load` x the
  capacity measured the same way, on the same kind of fleet: its statuses, and the capacity
  measured again after it (`PoissonRun.load`: the load the fleet really had).
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import time
from dataclasses import dataclass, field

import httpx
from agent_process import agent_processes
from serve_process import serve_process

from simulator.overload import recovered_s

FLOOD_FACTOR = 10
FLOOD_S = 4.0
BASELINE_S = 3.0
RECOVERY_WINDOW_S = 2.0


@dataclass
class FloodReport:
    max_tokens: int
    max_num_seqs: int
    capacity: float = 0.0  # requests/s the fleet completes
    baseline_s: float = 0.0  # a request's median latency at the normal load before the flood
    sent: int = 0
    statuses: dict[int, int] = field(default_factory=dict)
    refusals: list[tuple[dict[bytes, bytes], bytes]] = field(default_factory=list)
    refusal_latencies: list[float] = field(default_factory=list)  # seconds to each 429
    ejection_lines: list[str] = field(default_factory=list)
    health: set[str] = field(default_factory=set)
    probes: list[tuple[float, float, int]] = field(default_factory=list)  # sent, latency, status
    recovered_s: float | None = None

    @property
    def refusal_p50_s(self) -> float | None:
        latencies = self.refusal_latencies
        return statistics.median(latencies) if latencies else None

    def summary(self) -> str:
        recovered = None if self.recovered_s is None else round(self.recovered_s, 2)
        refusal = self.refusal_p50_s
        answered = "-" if refusal is None else f"{refusal * 1000:.0f} ms"
        return (
            f"{self.max_tokens}-token requests, batches of {self.max_num_seqs}: capacity "
            f"{self.capacity:.1f} req/s, flood "
            f"{FLOOD_FACTOR}x for {FLOOD_S}s ({self.sent} requests): {self.statuses}, 429s "
            f"answered in {answered} (median); baseline latency {self.baseline_s * 1000:.0f} ms; "
            f"normal service {recovered} s after the flood"
        )


class RawClient:
    """HTTP/1.1 keep-alive POSTs on raw asyncio streams: a flood from this process must cost the
    test's own loop little (an HTTP client library's per-request CPU would make it the bottleneck
    and its backlog would show up as latency)."""

    def __init__(self, url: str, api_key: str | None = None) -> None:
        host, port = url.removeprefix("http://").split(":")
        self.host, self.port = host, int(port)
        self.auth = b"" if api_key is None else b"authorization: Bearer %s\r\n" % api_key.encode()
        self.idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []

    async def post(self, path: str, body: bytes) -> tuple[int, dict[bytes, bytes], bytes]:
        reader, writer = (
            self.idle.pop() if self.idle else await asyncio.open_connection(self.host, self.port)
        )
        writer.write(
            b"POST %s HTTP/1.1\r\nhost: %s\r\ncontent-type: application/json\r\n%s"
            b"content-length: %d\r\n\r\n%s"
            % (path.encode(), self.host.encode(), self.auth, len(body), body)
        )
        head = await reader.readuntil(b"\r\n\r\n")
        lines = head.split(b"\r\n")
        status = int(lines[0].split()[1])
        headers = {}
        for line in lines[1:]:
            if line:
                name, _, value = line.partition(b":")
                headers[name.strip().lower()] = value.strip()
        data = await reader.readexactly(int(headers[b"content-length"]))
        if headers.get(b"connection") == b"close":
            writer.close()
        else:
            self.idle.append((reader, writer))
        return status, headers, data

    def close(self) -> None:
        for _, writer in self.idle:
            writer.close()


PROMPT = [(i * 37 + 11) % 250 for i in range(24)]


def payload(i: int, max_tokens: int) -> bytes:
    # A distinct first token per request: no prefix is shared, every request costs a prefill.
    body = {"prompt": [i % 250, *PROMPT], "max_tokens": max_tokens, "ignore_eos": True}
    return json.dumps(body).encode()


async def timed(
    client: RawClient, i: int, max_tokens: int
) -> tuple[float, int, dict[bytes, bytes], bytes]:
    start = time.monotonic()
    status, headers, data = await client.post("/v1/completions", payload(i, max_tokens))
    return time.monotonic() - start, status, headers, data


async def capacity(client: RawClient, max_tokens: int, seconds: float = 3.0) -> float:
    """Requests/s the fleet completes with plenty of requests outstanding (closed loop)."""
    done = 0
    end = time.monotonic() + seconds

    async def worker(w: int) -> None:
        nonlocal done
        i = w
        while time.monotonic() < end:
            _, status, _, data = await timed(client, i, max_tokens)
            assert status in (200, 429), data
            done += status == 200
            i += 32

    start = time.monotonic()
    await asyncio.gather(*(worker(w) for w in range(32)))
    return done / (time.monotonic() - start)


async def poisson(
    max_tokens: int, max_num_seqs: int, load: float, seconds: float, seed: int = 0
) -> PoissonRun:
    """Ordinary traffic: Poisson arrivals at `load` x the fleet's capacity for `seconds`, on the
    flood's fleet, with the capacity measured again right after."""
    rng = random.Random(seed)
    statuses: dict[int, int] = {}
    with (
        agent_processes(2, "--max-num-seqs", str(max_num_seqs)) as pair,
        serve_process(
            [agent.instance_spec() for agent in pair], "--policy", "round_robin"
        ) as served,
    ):
        client = RawClient(served.url)
        for i in range(4):
            assert (await timed(client, i, max_tokens))[1] == 200
        rate = await capacity(client, max_tokens)

        async def one(i: int) -> None:
            _, status, _, _ = await timed(client, 30_000 + i, max_tokens)
            statuses[status] = statuses.get(status, 0) + 1

        tasks = []
        start = due = time.monotonic()
        while due < start + seconds:
            await asyncio.sleep(max(0.0, due - time.monotonic()))
            tasks.append(asyncio.create_task(one(len(tasks))))
            due += rng.expovariate(load * rate)
        await asyncio.gather(*tasks)
        after = await capacity(client, max_tokens)
        client.close()
    return PoissonRun(len(tasks) / seconds, rate, after, statuses)


@dataclass(frozen=True, slots=True)
class PoissonRun:
    arrival_rate: float  # requests/s sent
    capacity: float  # measured before, which set the arrival rate
    capacity_after: float  # measured again right after
    statuses: dict[int, int]

    @property
    def load(self) -> float:
        """The arrivals over the lower of the two capacities: the load the fleet actually had
        (a shared machine slowing down during the run raises it)."""
        return self.arrival_rate / min(self.capacity, self.capacity_after)


def ejections(metrics: str) -> list[str]:
    return [line for line in metrics.splitlines() if line.startswith("kvherd_ejections_total")]


async def flood(max_tokens: int, max_num_seqs: int = 8) -> FloodReport:
    report = FloodReport(max_tokens, max_num_seqs)
    with (
        agent_processes(2, "--max-num-seqs", str(max_num_seqs)) as pair,
        serve_process(
            [agent.instance_spec() for agent in pair],
            "--policy",
            "round_robin",
            "--migration-policy",
            "none",
            "--health-interval",
            "0.5",
        ) as served,
    ):
        client = RawClient(served.url)
        for i in range(4):  # warm up both agents
            assert (await timed(client, i, max_tokens))[1] == 200
        rate = await capacity(client, max_tokens)
        report.capacity = rate
        # Normal load: a request every 0.1 s, or at half the fleet's capacity where that is less
        # (long requests), so that service can recover after the flood.
        every = max(0.1, 2.0 / rate)

        async def normal_load(i: int) -> float:
            latency, status, _, data = await timed(client, 20_000 + i, max_tokens)
            assert status == 200, data
            return latency

        before = []
        for i in range(round(BASELINE_S / every)):
            before.append(asyncio.create_task(normal_load(i)))
            await asyncio.sleep(every)
        baseline = statistics.median(await asyncio.gather(*before))
        report.baseline_s = baseline

        async def flood_one(i: int) -> None:
            latency, status, headers, data = await timed(client, i, max_tokens)
            report.statuses[status] = report.statuses.get(status, 0) + 1
            if status == 429:
                report.refusals.append((headers, data))
                report.refusal_latencies.append(latency)

        async def probe(i: int) -> None:
            sent = time.monotonic()
            latency, status, _, _ = await timed(client, 10_000 + i, max_tokens)
            report.probes.append((sent, latency, status))

        flooding: list[asyncio.Task[None]] = []
        probing: list[asyncio.Task[None]] = []
        interval = 1.0 / (FLOOD_FACTOR * rate)
        start = time.monotonic()
        n = 0
        while (now := time.monotonic()) < start + FLOOD_S:  # open loop: arrivals on a clock
            due = start + n * interval
            if now < due:
                await asyncio.sleep(due - now)
            flooding.append(asyncio.create_task(flood_one(n)))
            n += 1
        report.sent = n
        flood_end = time.monotonic()
        for i in range(round(10.0 / every)):
            probing.append(asyncio.create_task(probe(i)))
            await asyncio.sleep(every)
        await asyncio.gather(*flooding, *probing)
        client.close()
        async with httpx.AsyncClient(timeout=30) as http:
            metrics = (await http.get(served.url + "/metrics")).text
            instances = (
                await http.get(
                    served.admin_url + "/admin/v1/instances", headers=served.admin_headers
                )
            ).json()
    report.ejection_lines = ejections(metrics)
    report.health = {i["health"] for i in instances["data"]}
    normal = max(2 * baseline, baseline + 0.25)
    report.recovered_s = recovered_s(report.probes, flood_end, normal, RECOVERY_WINDOW_S)
    return report
