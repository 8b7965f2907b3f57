"""Routing by model and LoRA adapter in front of two real vLLM servers (kvherd serve, real HTTP).

Server ``la`` serves the tiny Llama with PEFT adapters A and B (``--lora-modules``, two slots),
``lb`` with adapter C; both allow run-time loading (``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True``).
What vLLM 0.32 itself says, checked here: ``/v1/models`` lists the base model (``parent`` null)
and every adapter (``parent`` = the base model's name, ``root`` = its path); an unknown model is
404 ``{"message": "The model `X` does not exist. Valid aliases: tiny.", "type":
"NotFoundError", "param": "model", "code": 404}``; ``/metrics`` says nothing of an adapter
until a request used it (``vllm:lora_requests_info``, see `scheduler.core.load_report`).
One module-scoped pair, no KV events or connector: cheap (the adapters are rank 8, made offline
with ``peft``).
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from vllm_fleet import (
    KvherdServe,
    VllmServer,
    VllmSpec,
    instance_arg,
    kvherd_serve,
    vllm_servers,
)

SERVES = {"la": {"tiny", "A", "B"}, "lb": {"tiny", "C"}}
PROMPTS = ("the quick brown fox", "router prefix block cache token")


def build_adapter(base: Path, out: Path, seed: int) -> Path:
    """A random (non-zero) rank-8 PEFT LoRA adapter on q_proj and v_proj of the tiny Llama."""
    peft = pytest.importorskip("peft")
    import torch
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(str(base))
    config = peft.LoraConfig(
        r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], init_lora_weights=False
    )
    torch.manual_seed(seed)
    peft.get_peft_model(model, config).save_pretrained(str(out))
    return out


@pytest.fixture(scope="module")
def adapters(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("lora")
    return {name: build_adapter(tiny_model, root / name, seed) for seed, name in enumerate("ABCD")}


@pytest.fixture(scope="module")
def lora_pair(
    vllm_python: str,
    tiny_model: Path,
    adapters: dict[str, Path],
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[VllmServer, VllmServer]]:
    def spec(name: str, served: str) -> VllmSpec:
        modules = [f"{a}={adapters[a]}" for a in served]
        lora = ("--enable-lora", "--max-loras", "2", "--max-lora-rank", "8")
        return VllmSpec(
            name,
            extra_args=(*lora, "--lora-modules", *modules),
            env=(("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "True"),),
        )

    log_dir = tmp_path_factory.mktemp("vllm_lora_logs")
    with vllm_servers(vllm_python, tiny_model, [spec("la", "AB"), spec("lb", "C")], log_dir) as (
        la,
        lb,
    ):
        yield la, lb


def generate(url: str, model: Any, prompt: str) -> httpx.Response:
    body = {"model": model, "prompt": prompt, "max_tokens": 4, "temperature": 0.0}
    return httpx.post(url + "/v1/completions", json=body, timeout=120.0, trust_env=False)


def test_requests_reach_the_instances_serving_their_model_or_adapter(
    lora_pair: tuple[VllmServer, VllmServer], tiny_model: Path, adapters: dict[str, Path]
) -> None:
    la, lb = lora_pair
    servers = {"la": la, "lb": lb}
    listed = httpx.get(la.url + "/v1/models", trust_env=False).json()["data"]
    assert [(m["id"], m["parent"]) for m in listed] == [
        ("tiny", None),
        ("A", "tiny"),
        ("B", "tiny"),
    ]
    assert listed[1]["root"] == str(adapters["A"])
    args = ["--instance", instance_arg(la), "--instance", instance_arg(lb)]
    args += ["--tokenizer", str(tiny_model), "--expose-instance", "--models-interval", "0.5"]
    args += ["--lora-load-on-demand", "--lora-modules", f"D={adapters['D']}"]
    args += ["--lora-modules", "E=/nonexistent/adapter"]
    with kvherd_serve(*args) as proxy:
        fleet = httpx.get(proxy.url + "/v1/models", trust_env=False).json()["data"]
        assert [(m["id"], m["parent"]) for m in fleet] == [
            ("tiny", None),
            ("A", "tiny"),
            ("B", "tiny"),
            ("C", "tiny"),
        ]
        for model in ("A", "B", "C", "tiny"):
            for prompt in PROMPTS:
                routed = generate(proxy.url, model, prompt)
                assert routed.status_code == 200, routed.text
                where = routed.headers["x-kvherd-instance"]
                assert model in SERVES[where], (model, where)
                direct = generate(servers[where].url, model, prompt).json()
                assert routed.json()["choices"][0]["text"] == direct["choices"][0]["text"]
        # An adapter and its base model answer differently (the adapter is applied).
        texts = {m: generate(proxy.url, m, PROMPTS[0]).json()["choices"][0]["text"] for m in "ABC"}
        assert len(set(texts.values())) == 3, texts

        unknown = generate(proxy.url, "nope", PROMPTS[0])
        own = generate(la.url, "nope", PROMPTS[0])
        assert (unknown.status_code, unknown.json()) == (404, own.json()), unknown.text
        assert own.json()["error"]["code"] == 404 and own.json()["error"]["type"] == "NotFoundError"
        bad = generate(proxy.url, 5, PROMPTS[0])
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "model", bad.text

        assert_loaded_once(proxy, servers)
        assert_load_failure_is_a_clear_error(proxy)


def assert_loaded_once(proxy: KvherdServe, servers: dict[str, VllmServer]) -> None:
    """Concurrent requests for adapter D (no instance has it) wait for one load, then all run."""
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(lambda p: generate(proxy.url, "D", p), PROMPTS * 2))
    assert [a.status_code for a in answers] == [200] * 4, [a.text for a in answers]
    assert proxy.metric("kvherd_lora_loads_total", outcome="loaded") == 1
    where = {a.headers["x-kvherd-instance"] for a in answers}
    assert len(where) == 1, where
    home = servers[where.pop()]
    listed = httpx.get(home.url + "/v1/models", trust_env=False).json()["data"]
    assert ("D", "tiny") in [(m["id"], m["parent"]) for m in listed]
    for answer, prompt in zip(answers, PROMPTS * 2, strict=True):
        direct = generate(home.url, "D", prompt).json()
        assert answer.json()["choices"][0]["text"] == direct["choices"][0]["text"]
    again = generate(proxy.url, "D", PROMPTS[0])
    assert again.status_code == 200
    assert proxy.metric("kvherd_lora_loads_total", outcome="loaded") == 1


def assert_load_failure_is_a_clear_error(proxy: KvherdServe) -> None:
    failed = generate(proxy.url, "E", PROMPTS[0])
    error = failed.json()["error"]
    assert failed.status_code == 502 and error["code"] == "lora_load_failed", failed.text
    assert "`E`" in error["message"] and "No adapter found" in error["message"], error
    assert proxy.metric("kvherd_lora_loads_total", outcome="failed") == 1
