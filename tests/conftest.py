"""Shared fixtures: tiny random HF checkpoints (Llama and Qwen2) saved once per test session.

The checkpoints are built offline from a config with transformers, so the engine's loader and model
are checked against the reference implementation on exactly the same weights. Qwen2 gets random q/k/v
biases (HF initialises them to zero, which would hide a bias bug) and tied embeddings.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

# Test helpers (agent processes, the in-process engine thread) live in tests/support.
sys.path.insert(0, str(Path(__file__).resolve().parent / "support"))

TINY_SHAPES: dict[str, Any] = {
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 176,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 1024,
    # Wider than HF's default 0.02 so greedy choices have clear margins over float rounding.
    "initializer_range": 0.1,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
}


def build_hf_checkpoint(family: str, path: Path, seed: int = 0) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    model: LlamaForCausalLM | Qwen2ForCausalLM
    if family == "llama":
        model = LlamaForCausalLM(
            LlamaConfig(
                **TINY_SHAPES, bos_token_id=256, eos_token_id=257, tie_word_embeddings=False
            )
        )
    elif family == "qwen2":
        model = Qwen2ForCausalLM(
            Qwen2Config(**TINY_SHAPES, bos_token_id=256, eos_token_id=257, tie_word_embeddings=True)
        )
        with torch.no_grad():
            for layer in model.model.layers:
                for proj in (
                    layer.self_attn.q_proj,
                    layer.self_attn.k_proj,
                    layer.self_attn.v_proj,
                ):
                    proj.bias.normal_(0.0, 0.1)
    else:
        raise ValueError(family)
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def hf_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """{"llama": dir, "qwen2": dir} of tiny random checkpoints (config.json + safetensors)."""
    root = tmp_path_factory.mktemp("hf_checkpoints")
    return {
        family: build_hf_checkpoint(family, root / family, seed=i)
        for i, family in enumerate(("llama", "qwen2"))
    }
