"""Cache truth on a live fleet: two kvherd agents whose KV event streams the operator swapped.

The router then believes each agent holds what the other computed and sends a repeated prefix
where the engine recomputes it. The engines' own ``cached_tokens`` expose it: both instances are
reported diverging (WARNING, metrics) and routed with the approximate index, after which a repeated
prefix lands where it was computed and hits.
"""

from __future__ import annotations

import re
import time

import httpx
from agent_process import agent_processes
from serve_process import serve_process

PENDING_TTL_S = 5.0  # ClusterState's pending_ttl_s: a routed tail's record before its events
EVENTS_SETTLE_S = 1.0  # an agent's KV events reaching the router over ZMQ


def _complete(client: httpx.Client, url: str, prompt: str) -> int:
    reply = client.post(
        url + "/v1/completions",
        json={"model": "tiny", "prompt": prompt, "max_tokens": 2, "temperature": 0},
    )
    assert reply.status_code == 200, reply.text
    return int(reply.json()["usage"]["prompt_tokens_details"]["cached_tokens"])


def _samples(text: str, name: str) -> list[float]:
    return [float(v) for v in re.findall(rf"^{name}\{{[^}}]*\}} (\S+)$", text, re.MULTILINE)]


def test_swapped_event_streams_are_found_and_routed_around() -> None:
    with agent_processes(2) as (a, b):
        assert a.kv_events_endpoint and b.kv_events_endpoint
        swapped = [
            f"{a.url},kv_events={b.kv_events_endpoint},replay={b.replay_endpoint}",
            f"{b.url},kv_events={a.kv_events_endpoint},replay={a.replay_endpoint}",
        ]
        with serve_process(swapped) as served, httpx.Client(timeout=60.0) as client:
            # Each prefix is computed on one agent directly (half on each, so neither side hangs
            # on the router's tie-break), then asked again through the router: the (swapped)
            # events say the other agent caches it, so the router sends it there and that engine
            # recomputes it. Two rounds give each instance 8 misled checks (min_checks).
            text = ""
            for round_ in range(4):
                first = [f"talk {round_}.{k} about the cache and its truth " * 6 for k in range(8)]
                for k, prefix in enumerate(first):
                    _complete(client, (a, b)[k % 2].url, prefix + "first")
                time.sleep(EVENTS_SETTLE_S)
                for prefix in first:
                    _complete(client, served.url, prefix + "again")
                text = client.get(served.url + "/metrics").text
                if sum(_samples(text, "kvherd_cache_index_distrusted")) == 2:
                    break
            assert sum(_samples(text, "kvherd_cache_index_distrusted")) == 2, text
            claimed = sum(_samples(text, "kvherd_cache_claimed_tokens_total"))
            missing = sum(_samples(text, "kvherd_cache_missing_tokens_total"))
            assert claimed > 0 and missing > 0.3 * claimed
            assert "routed with the approximate index until they agree again" in served.log()
            # Now a repeated prefix goes where it was computed (the approximate index, 120 s).
            later = [f"a later talk {k} on routing by what was routed " * 6 for k in range(4)]
            for prefix in later:
                _complete(client, served.url, prefix + "first")
            time.sleep(PENDING_TTL_S + 1)
            hits = [_complete(client, served.url, prefix + "again") for prefix in later]
            assert sum(1 for h in hits if h >= 128) >= 3, hits
