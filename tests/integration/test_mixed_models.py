"""One real ``kvherd serve`` in front of a mixed fleet of real ``kvherd agent`` processes: two
instances of ``alpha`` (the tiny preset: byte tokenizer, 16-token blocks) and two of ``beta`` (a
tiny Llama checkpoint with a trained BPE tokenizer, 32-token blocks), the proxy given
``--tokenizer beta=DIR``.

Each model's repeated prompt goes back to the instance that holds it and hits every full block,
so the proxy's chains (its model's tokenizer, its model's block size) equal the agents' KV events;
no request reaches an instance of the other model; admin and metrics show the hits per model.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from agent_process import agent_processes
from chat_corpus import build_tokenizer
from serve_process import serve_process

from kvherd.tokenizer import ByteTokenizer, load_tokenizer

pytestmark = pytest.mark.timeout(300)

ENGINE = ("--num-gpu-blocks", "256", "--max-num-seqs", "4")
TEXT = (
    "A router sends each request to the instance that already holds the longest matching prefix "
    "in its key value cache. Blocks of tokens are hashed with their parent hash, so equal "
    "prefixes give equal chains of block hashes. The quick brown fox jumps over the lazy dog. "
)
PROMPTS = {"alpha": "alpha: " + TEXT, "beta": "beta: " + TEXT * 3}


@pytest.fixture(scope="module")
def beta_dir(hf_checkpoints: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama checkpoint holding a trained tokenizer (vocabulary within its 512 ids)."""
    root = tmp_path_factory.mktemp("beta")
    tokenizer = build_tokenizer(root / "tokenizer", vocab_size=512)
    checkpoint = root / "checkpoint"
    shutil.copytree(hf_checkpoints["llama"], checkpoint)
    for f in tokenizer.iterdir():
        shutil.copy(f, checkpoint / f.name)
    return checkpoint


def _until(condition: Any, what: str, timeout: float = 30.0) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.05)  # the proxy ingests the agents' KV events on its own loop
    raise AssertionError(f"timed out waiting for {what}")


def test_one_proxy_routes_two_models_each_with_its_tokenizer_and_block_size(
    beta_dir: Path,
) -> None:
    alpha_args = ("--served-model-name", "alpha", "--block-size", "16", *ENGINE)
    beta_args = ("--model", str(beta_dir), "--served-model-name", "beta", "--block-size", "32")
    with (
        agent_processes(2, *alpha_args) as alphas,
        agent_processes(2, *beta_args, *ENGINE) as betas,
        serve_process(
            [a.instance_spec() for a in alphas + betas],
            *("--policy", "kvherd", "--expose-instance", "--tokenizer", f"beta={beta_dir}"),
        ) as served,
        httpx.Client(timeout=60.0) as client,
    ):
        admin = served.admin_headers

        def instances() -> dict[str, dict[str, Any]]:
            listed = client.get(served.admin_url + "/admin/v1/instances", headers=admin).json()
            return {i["instance_id"]: i for i in listed["data"]}

        serving = {
            model: {i for i, inst in instances().items() if inst["url"] in {a.url for a in group}}
            for model, group in (("alpha", alphas), ("beta", betas))
        }
        assert all(len(ids) == 2 for ids in serving.values()), instances()
        token_ids = {
            "alpha": ByteTokenizer().encode(PROMPTS["alpha"]),
            "beta": load_tokenizer(str(beta_dir)).encode(PROMPTS["beta"]),
        }
        full_blocks = {
            "alpha": len(token_ids["alpha"]) // 16,
            "beta": len(token_ids["beta"]) // 32,
        }
        assert full_blocks["alpha"] >= 8 and full_blocks["beta"] >= 4
        assert len(token_ids["beta"]) < len(token_ids["alpha"]) * 3  # BPE, not bytes

        def complete(model: str) -> str:
            body = {"model": model, "prompt": PROMPTS[model], "max_tokens": 2, "temperature": 0}
            response = client.post(served.url + "/v1/completions", json=body)
            assert response.status_code == 200, response.text
            assert response.json()["model"] == model
            chosen = response.headers["x-kvherd-instance"]
            assert chosen in serving[model], (model, chosen)  # never the other model's
            return chosen

        for model in ("alpha", "beta"):
            holder = complete(model)
            _until(
                lambda holder=holder, model=model: (
                    instances()[holder]["kv_events"]["indexed_blocks"] >= full_blocks[model]
                ),
                f"{model}'s blocks in the proxy's index",
            )
            for _ in range(2):
                assert complete(model) == holder  # back to the instance holding the prefix

        models = client.get(served.admin_url + "/admin/v1/models", headers=admin).json()
        described = {m["id"]: m for m in models["data"]}
        for model, block_size, tokenizer in (("alpha", 16, "byte"), ("beta", 32, str(beta_dir))):
            figures = described[model]
            assert (figures["block_size"], figures["tokenizer"]) == (block_size, tokenizer)
            assert sorted(figures["instances"]) == sorted(serving[model])
            assert figures["requests"] == 3
            assert figures["prompt_blocks"] == 3 * full_blocks[model]  # its tokenizer, its size
            assert figures["hit_blocks"] == 2 * full_blocks[model]  # every full block, twice
        metrics = client.get(served.url + "/metrics").text
        hits = f"{2 * full_blocks['beta']}.0"
        assert f'kvherd_model_hit_blocks_total{{model="beta"}} {hits}' in metrics
        for ids in serving.values():  # what each agent served was its own model's
            assert sum(instances()[i]["served"] for i in ids) == 3
