"""Test helper: a PEFT-format LoRA adapter for an engine model, written without `peft`.

`write_adapter(path, config, rank, alpha, targets, seed)` writes ``adapter_config.json`` and
``adapter_model.safetensors`` exactly as ``peft`` saves them (tensor names, [r, in] / [out, r]
shapes), with random A and B (both non-zero, so the adapter changes the model's output).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from instance_agent.engine.config import ModelConfig
from instance_agent.engine.lora import TARGETS


def write_adapter(
    path: Path,
    config: ModelConfig,
    rank: int = 4,
    alpha: float = 8,
    targets: Sequence[str] = TARGETS,
    seed: int = 0,
    scale: float = 0.2,
    **overrides: Any,
) -> Path:
    q = config.num_attention_heads * config.head_dim
    kv = config.num_key_value_heads * config.head_dim
    hidden, inter = config.hidden_size, config.intermediate_size
    sizes = {
        "q_proj": (hidden, q), "k_proj": (hidden, kv), "v_proj": (hidden, kv),
        "o_proj": (q, hidden), "gate_proj": (hidden, inter), "up_proj": (hidden, inter),
        "down_proj": (inter, hidden),
    }  # fmt: skip
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config.num_hidden_layers):
        for module in targets:
            block = "mlp" if module in ("gate_proj", "up_proj", "down_proj") else "self_attn"
            prefix = f"base_model.model.model.layers.{layer}.{block}.{module}"
            fan_in, fan_out = sizes[module]
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, fan_in, generator=gen) * scale
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(fan_out, rank, generator=gen) * scale
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    adapter_config = {
        "peft_type": "LORA",
        "r": rank,
        "lora_alpha": alpha,
        "target_modules": list(targets),
        "bias": "none",
        "use_dora": False,
        "use_rslora": False,
        "modules_to_save": None,
        "rank_pattern": {},
        "alpha_pattern": {},
        **overrides,
    }
    (path / "adapter_config.json").write_text(json.dumps(adapter_config))
    return path
