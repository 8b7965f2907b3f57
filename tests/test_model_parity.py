"""Parity of kvherd's paged model with HF transformers on the same tiny random weights.

Llama and Qwen2 (q/k/v bias, tied embeddings) checkpoints are saved by transformers and loaded by
kvherd's loader. Checked: logits of a full prompt; token-by-token decoding and uneven chunked prefill
through a paged cache with small, shuffled blocks against the reference's full-sequence logits at
every position; greedy generations token for token.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from instance_agent.engine.attention import build_metadata
from instance_agent.engine.llm_engine import EngineConfig, LLMEngine
from instance_agent.engine.loader import LoadedModel, load_model
from instance_agent.engine.model import allocate_kv_cache
from instance_agent.engine.request import SamplingParams

FAMILIES = ["llama", "qwen2"]
ATOL = 2e-5


def _reference(path: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _prompt(n: int, seed: int = 1) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(512) for _ in range(n)]


class PagedRun:
    """Drives the model directly through chunks of a paged cache with shuffled block ids."""

    def __init__(self, loaded: LoadedModel, num_tokens: int, block_size: int) -> None:
        self.loaded = loaded
        self.block_size = block_size
        num_blocks = -(-num_tokens // block_size)
        pool = num_blocks * 3
        self.cache = allocate_kv_cache(
            loaded.config, pool, block_size, torch.float32, loaded.device
        )
        self.blocks = random.Random(7).sample(range(pool), num_blocks)

    @torch.inference_mode()
    def chunk(self, token_ids: list[int], start: int, n: int) -> torch.Tensor:
        bs = self.block_size
        pos = torch.arange(start, start + n)
        table = torch.tensor(self.blocks, dtype=torch.long)
        slots = table[pos // bs] * bs + pos % bs
        used = self.blocks[: -(-(start + n) // bs)]
        if n == 1:
            meta = build_metadata(bs, [(used, start + 1)], [], slots, torch.device("cpu"))
        else:
            meta = build_metadata(bs, [], [(0, used, start, n)], slots, torch.device("cpu"))
        model = self.loaded.model
        hidden = model(torch.tensor(token_ids[start : start + n]), pos, self.cache, meta)
        return model.compute_logits(hidden)


@pytest.fixture(scope="module", params=FAMILIES)
def pair(request: pytest.FixtureRequest, hf_checkpoints: dict[str, Path]):
    path = hf_checkpoints[request.param]
    return path, _reference(path), load_model(str(path), device="cpu")


def test_loader_reads_config(hf_checkpoints: dict[str, Path]) -> None:
    llama = load_model(str(hf_checkpoints["llama"]), device="cpu")
    qwen = load_model(str(hf_checkpoints["qwen2"]), device="cpu")
    assert llama.config.model_type == "llama" and not llama.config.attention_bias
    assert qwen.config.model_type == "qwen2" and qwen.config.attention_bias
    assert qwen.config.tie_word_embeddings
    assert qwen.model.lm_head.weight.data_ptr() == qwen.model.model.embed_tokens.weight.data_ptr()
    assert llama.config.num_key_value_heads == 2 and llama.config.head_dim == 16


def test_full_prompt_logits_match(pair) -> None:
    _, ref, ours = pair
    ids = _prompt(37)
    with torch.no_grad():
        expected = ref(torch.tensor([ids])).logits[0]
    got = PagedRun(ours, len(ids), block_size=16).chunk(ids, 0, len(ids))
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)


def test_token_by_token_decode_matches_every_position(pair) -> None:
    _, ref, ours = pair
    ids = _prompt(45, seed=2)
    with torch.no_grad():
        expected = ref(torch.tensor([ids])).logits[0]
    run = PagedRun(ours, len(ids), block_size=4)  # 12 blocks, shuffled over a pool of 36
    got = torch.cat([run.chunk(ids, i, 1) for i in range(len(ids))])
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)


def test_uneven_chunked_prefill_matches(pair) -> None:
    _, ref, ours = pair
    ids = _prompt(50, seed=3)
    with torch.no_grad():
        expected = ref(torch.tensor([ids])).logits[0]
    run = PagedRun(ours, len(ids), block_size=4)
    got, start = [], 0
    for n in (5, 7, 1, 13, 2, 22):  # chunks cross block boundaries at odd offsets
        got.append(run.chunk(ids, start, n))
        start += n
    assert start == len(ids)
    torch.testing.assert_close(torch.cat(got), expected, atol=ATOL, rtol=0)


def test_greedy_generation_identical(pair) -> None:
    path, ref, _ = pair
    prompts = [_prompt(n, seed=n) for n in (3, 17, 40)]
    engine = LLMEngine(EngineConfig(model=str(path), block_size=4, device="cpu"))
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    outs = engine.generate(prompts, params)
    for prompt, out in zip(prompts, outs, strict=True):
        with torch.no_grad():
            hf = ref.generate(
                torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                do_sample=False,
                max_new_tokens=24,
                min_new_tokens=24,
                pad_token_id=0,
            )
        assert out.output_token_ids == hf[0, len(prompt) :].tolist()
        assert out.finish_reason == "length"
