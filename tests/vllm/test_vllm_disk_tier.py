"""The kvherd connector's disk tier on real vLLM: it survives a restart, and refuses another setup's.

Server ``b`` of the session pair has a 16-block host store and a disk tier. A prompt computed on
``b`` and then pushed out of its host store by a longer one lands on disk (``medium`` "STORAGE"
events on ``b``'s own KV event stream); ``b`` is restarted on the same directory; before any
request its fresh event stream announces the blocks on "STORAGE" again (so a restarted fleet
routes by them), and the prompt then loads from disk: ``cached_tokens`` count its full blocks, the
greedy output is the one computed before the restart, and vLLM's ``/metrics`` count a loaded
disk-tier load and its bytes (the connector's `KVConnectorStats`). Server ``a`` started on a
directory whose manifest names another model: it logged a WARNING, discarded the blocks and
rewrote the manifest for its own model.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
from vllm_fleet import SERVED_MODEL, Prompts, VllmServer, poll_until, restart_vllm

MAX_TOKENS = 8
BLOCK = 128


def _complete(server: VllmServer, prompt: str, max_tokens: int = MAX_TOKENS) -> dict[str, Any]:
    body = {"model": SERVED_MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0}
    response = httpx.post(server.url + "/v1/completions", json=body, timeout=120.0, trust_env=False)
    assert response.status_code == 200, response.text
    answer: dict[str, Any] = response.json()
    return answer


def _cached(answer: dict[str, Any]) -> int:
    return int(answer["usage"]["prompt_tokens_details"]["cached_tokens"] or 0)


def _stored(server: VllmServer, start: int, medium: str) -> set[int]:
    return {
        block_hash
        for _seq, (_ts, events, *_rank) in server.replay_batches(start)
        for event in events
        if event["type"] == "BlockStored" and event.get("medium") == medium
        for block_hash in event["block_hashes"]
    }


def _disk_dir(server: VllmServer) -> Path:
    return Path(str(dict(server.spec.connector_options)["disk_dir"]))


def test_a_restarted_server_loads_its_disk_tier(
    vllm_pair: tuple[VllmServer, VllmServer], prompts: Prompts
) -> None:
    _a, b = vllm_pair
    prompt = prompts.make("disk-tier-restart", blocks=3)
    full_blocks = prompts.full_blocks(prompt)
    batches = b.replay_batches()
    start = batches[-1][0] + 1 if batches else 0
    before = _complete(b, prompt)
    assert poll_until(lambda: len(_stored(b, start, "CPU")) >= full_blocks, timeout_s=10.0)
    prompt_blocks = _stored(b, start, "CPU")
    _complete(b, prompts.make("disk-tier-filler", blocks=17), max_tokens=1)  # > the host store

    def on_disk() -> bool:
        return prompt_blocks <= _stored(b, start, "STORAGE")

    assert poll_until(on_disk, timeout_s=10.0), (prompt_blocks, _stored(b, start, "STORAGE"))

    restart_vllm(b)
    announced = poll_until(lambda: prompt_blocks <= _stored(b, 0, "STORAGE"), timeout_s=20.0)
    assert announced, b.log()
    after = _complete(b, prompt)

    assert _cached(after) == full_blocks * BLOCK, after["usage"]
    assert after["kv_transfer_params"] == {
        "kvherd_host": {"outcome": "loaded", "tokens": full_blocks * BLOCK}
    }
    assert after["choices"][0]["text"] == before["choices"][0]["text"]
    loads = "vllm:kvherd_connector_loads_total"
    assert poll_until(lambda: b.metric(loads, tier="disk", outcome="loaded") >= 1.0), b.log()
    assert b.metric("vllm:kvherd_connector_load_bytes_total", tier="disk") > 0
    assert b.metric("vllm:kvherd_connector_load_blocks_total", tier="disk") >= full_blocks


def test_a_disk_tier_of_another_model_is_discarded_with_a_warning(
    vllm_pair: tuple[VllmServer, VllmServer],
) -> None:
    a, _b = vllm_pair
    directory = _disk_dir(a)
    warnings = [
        line
        for line in a.log(tail=2_000_000).splitlines()
        if "WARNING" in line and f"kvherd disk tier {directory}: discarding" in line
    ]
    assert len(warnings) == 1, a.log()
    assert "model 'another' != " in warnings[0]
    manifest = json.loads((directory / "manifest.json").read_text())
    assert manifest["model"] != "another" and manifest["block_size"] == str(BLOCK)
