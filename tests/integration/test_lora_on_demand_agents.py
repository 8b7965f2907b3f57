"""``kvherd serve --lora-load-on-demand`` in front of real kvherd agents that load adapters at run time.

Two agent processes behind a real ``kvherd serve``: one with ``--allow-runtime-lora``, one
without (the proxy must never ask it). Concurrent requests for an adapter no instance serves are
served after exactly one load, on the agent that may load; its tokens equal an agent's that
loaded the adapter at start; an adapter whose path holds nothing answers 502 ``lora_load_failed``.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest
from agent_process import agent_process
from lora_adapters import write_adapter
from serve_process import serve_process

from instance_agent.engine.config import PRESETS

pytestmark = pytest.mark.timeout(240)

PROMPT = [(i * 11 + 5) % 250 for i in range(40)]


def _body(model: str) -> dict[str, object]:
    return {"model": model, "prompt": PROMPT, "max_tokens": 8, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True}  # fmt: skip


def _loads(metrics: str, outcome: str) -> float:
    for line in metrics.splitlines():
        if line.startswith(f'kvherd_lora_loads_total{{outcome="{outcome}"}}'):
            return float(line.split()[-1])
    return 0.0


async def test_an_adapter_no_agent_serves_is_loaded_once_where_loading_is_allowed(
    tmp_path: Path,
) -> None:
    adapter = str(write_adapter(tmp_path / "B", PRESETS["tiny"], seed=3))
    with (
        agent_process("--allow-runtime-lora", "--max-loras", "2") as loader,
        agent_process() as fixed,
        agent_process("--lora-modules", f"B={adapter}") as reference,
        serve_process(
            [loader.instance_spec(), fixed.instance_spec()],
            "--policy", "round_robin",
            "--lora-load-on-demand",
            "--lora-modules", f"B={adapter}",
            "--lora-modules", f"E={tmp_path / 'absent'}",
        ) as served,
    ):  # fmt: skip
        async with httpx.AsyncClient(timeout=60, trust_env=False) as client:
            answers = await asyncio.gather(
                *(client.post(served.url + "/v1/completions", json=_body("B")) for _ in range(3))
            )
            assert [a.status_code for a in answers] == [200] * 3, [a.text for a in answers]
            tokens = {tuple(a.json()["choices"][0]["token_ids"]) for a in answers}
            expected = await client.post(reference.url + "/v1/completions", json=_body("B"))
            assert tokens == {tuple(expected.json()["choices"][0]["token_ids"])}
            loaded_on = [
                m["id"] for m in (await client.get(loader.url + "/v1/models")).json()["data"]
            ]
            assert loaded_on == ["tiny", "B"]
            fixed_models = (await client.get(fixed.url + "/v1/models")).json()["data"]
            assert [m["id"] for m in fixed_models] == ["tiny"]
            failed = await client.post(served.url + "/v1/completions", json=_body("E"))
            assert failed.status_code == 502
            assert failed.json()["error"]["code"] == "lora_load_failed"
            assert "No adapter found" in failed.json()["error"]["message"]
            metrics = (await client.get(served.url + "/metrics")).text
            assert _loads(metrics, "loaded") == 1 and _loads(metrics, "failed") == 1
