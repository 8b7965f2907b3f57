"""Parity of kvherd's paged model with HF transformers on the same tiny random weights.

Llama and Qwen2 (q/k/v bias, tied embeddings) checkpoints are saved by transformers and loaded by
kvherd's loader. Checked: logits of a full prompt; token-by-token decoding and uneven chunked prefill
through a paged cache with small, shuffled blocks against the reference's full-sequence logits at
every position; greedy generations token for token.
"""

from __future__ import annotations

import random
import re
from pathlib import Path

import pytest
import torch

from instance_agent.engine.attention import build_metadata
from instance_agent.engine.config import PRESETS, ModelConfig
from instance_agent.engine.core.request import SamplingParams
from instance_agent.engine.llm_engine import EngineConfig, LLMEngine
from instance_agent.engine.loader import LoadedModel, load_model
from instance_agent.engine.model import allocate_kv_cache

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


def test_sharded_checkpoint_loads_identically(
    hf_checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(hf_checkpoints["llama"])
    ref.save_pretrained(tmp_path, max_shard_size="100KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    whole = load_model(str(hf_checkpoints["llama"]), device="cpu").model.state_dict()
    sharded = load_model(str(tmp_path), device="cpu").model.state_dict()
    assert whole.keys() == sharded.keys()
    assert all(torch.equal(whole[k], sharded[k]) for k in whole)


def _edit_config(src: Path, dst: Path, **changes: object) -> None:
    import json
    import shutil

    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    config.update(changes)
    (dst / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize(
    ("changes", "needle"),
    [
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_type 'yarn'"),
        ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 1e4}}, "rope_type 'llama3'"),
        ({"model_type": "mistral"}, "unsupported model_type 'mistral'"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
        ({"num_key_value_heads": 3}, "not a multiple"),
        ({"hidden_size": 32}, "has shape"),  # weights no longer fit the config
        ({"num_hidden_layers": 3}, "lacks tensors"),
    ],
)
def test_bad_checkpoint_config_raises_clearly(
    hf_checkpoints: dict[str, Path], tmp_path: Path, changes: dict, needle: str
) -> None:
    _edit_config(hf_checkpoints["llama"], tmp_path / "ckpt", **changes)
    with pytest.raises(ValueError, match=re.escape(needle)):
        load_model(str(tmp_path / "ckpt"), device="cpu")


def test_missing_files_raise_clearly(hf_checkpoints: dict[str, Path], tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown model"):
        load_model(str(tmp_path / "nope"))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match=r"no config\.json"):
        load_model(str(empty))
    (empty / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="cannot read"):
        load_model(str(empty))
    no_weights = tmp_path / "no_weights"
    no_weights.mkdir()
    (no_weights / "config.json").write_text((hf_checkpoints["llama"] / "config.json").read_text())
    with pytest.raises(ValueError, match=r"no \*\.safetensors"):
        load_model(str(no_weights))
    with pytest.raises(ValueError, match="unknown dtype"):
        load_model("tiny", dtype="float8")


def test_preset_is_seeded() -> None:
    a, b, c = (load_model("tiny", seed=s, device="cpu").model for s in (0, 0, 1))
    emb = "model.embed_tokens.weight"
    assert torch.equal(a.state_dict()[emb], b.state_dict()[emb])
    assert not torch.equal(a.state_dict()[emb], c.state_dict()[emb])


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_preset_config_round_trips_through_hf(name: str) -> None:
    from transformers import LlamaConfig

    preset = PRESETS[name]
    assert ModelConfig.from_hf_dict(preset.to_hf_dict()) == preset
    hf = LlamaConfig(**{k: v for k, v in preset.to_hf_dict().items() if k != "model_type"})
    assert ModelConfig.from_hf_dict(hf.to_dict()) == preset
