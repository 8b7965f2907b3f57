"""Test helper: a running kvherd fleet under light traffic (one agent behind ``kvherd serve``).

Usage::

    with live_fleet() as fleet:
        fleet.served.url, fleet.served.admin_url, fleet.agent.url

A background thread streams small completions through the proxy (about three a second) for
as long as the fleet runs, so counters, the TTFT and inter-token histograms and the agent's KV
tiers all move. The agent publishes KV events, so the proxy indexes its cache.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
from agent_process import AgentProcess, agent_process
from serve_process import Served, serve_process

TRAFFIC_PERIOD_S = 0.3


@dataclass
class LiveFleet:
    agent: AgentProcess
    served: Served
    requests_sent: int = 0


def _traffic(fleet: LiveFleet, stop: threading.Event) -> None:
    with httpx.Client(timeout=30.0) as client:
        while not stop.is_set():
            body = {
                "model": "tiny",
                "prompt": f"the fleet is live {fleet.requests_sent % 5} " * 8,
                "max_tokens": 8,
                "stream": True,
            }
            with contextlib.suppress(httpx.HTTPError):
                client.post(fleet.served.url + "/v1/completions", json=body).read()
            fleet.requests_sent += 1
            stop.wait(TRAFFIC_PERIOD_S)


@contextlib.contextmanager
def live_fleet() -> Iterator[LiveFleet]:
    with (
        agent_process(kv_events=True) as agent,
        serve_process([agent.instance_spec()]) as served,
    ):
        fleet = LiveFleet(agent, served)
        stop = threading.Event()
        thread = threading.Thread(target=_traffic, args=(fleet, stop), daemon=True)
        thread.start()
        try:
            yield fleet
        finally:
            stop.set()
            thread.join(timeout=35.0)
