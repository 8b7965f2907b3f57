"""LoRA adapters for the engine: PEFT adapter weights and the per-request low-rank update.

Contract:
- `load_adapter(name, path, config, dtype, device)` reads a PEFT LoRA directory
  (``adapter_config.json`` + ``adapter_model.safetensors``) for a Llama-family model: targets among
  q/k/v/o and gate/up/down projections (a list, ``"all-linear"`` or PEFT's full-name regex), rank
  ``r``, ``lora_alpha`` (``use_rslora`` too). Anything else (DoRA, biases, rank/alpha patterns,
  modules_to_save, ...), a missing, unknown or misshapen tensor raises `ValueError` naming it.
- An adapter's update of a projection is PEFT's unmerged one: ``y += (x @ A.T) @ B.T * scaling``.
- `LoraBatch` says which rows of one step's flattened batch run with which adapter; `apply` adds
  each group's update to a (fused) projection's output in place. The model takes a `LoraBatch`
  only when some row has an adapter: the base model's path does no extra work.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass
from typing import Any

import torch

from instance_agent.engine.config import ModelConfig

_ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
TARGETS = (*_ATTENTION, "gate_proj", "up_proj", "down_proj")
# PEFT config fields the engine does not implement: each must be absent, null, empty or false.
_UNSUPPORTED = (
    "use_dora", "lora_bias", "fan_in_fan_out", "modules_to_save", "rank_pattern", "alpha_pattern",
    "layers_to_transform", "layer_replication", "exclude_modules", "target_parameters",
    "trainable_token_indices", "alora_invocation_tokens", "use_qalora", "use_bdlora",
)  # fmt: skip


def fused_slices(config: ModelConfig) -> dict[str, tuple[tuple[str, int, int], ...]]:
    """Per fused projection of `model.LlamaModel`: (PEFT module, column offset, width) of each part."""
    q = config.num_attention_heads * config.head_dim
    kv = config.num_key_value_heads * config.head_dim
    inter = config.intermediate_size
    return {
        "qkv_proj": (("q_proj", 0, q), ("k_proj", q, kv), ("v_proj", q + kv, kv)),
        "o_proj": (("o_proj", 0, config.hidden_size),),
        "gate_up_proj": (("gate_proj", 0, inter), ("up_proj", inter, inter)),
        "down_proj": (("down_proj", 0, config.hidden_size),),
    }


def _shapes(config: ModelConfig, module: str) -> tuple[int, int]:
    """(in_features, out_features) of one HF projection."""
    hidden, inter = config.hidden_size, config.intermediate_size
    q = config.num_attention_heads * config.head_dim
    kv = config.num_key_value_heads * config.head_dim
    return {
        "q_proj": (hidden, q), "k_proj": (hidden, kv), "v_proj": (hidden, kv),
        "o_proj": (q, hidden), "gate_proj": (hidden, inter), "up_proj": (hidden, inter),
        "down_proj": (inter, hidden),
    }[module]  # fmt: skip


def _full_name(layer: int, module: str) -> str:
    block = "self_attn" if module in _ATTENTION else "mlp"
    return f"model.layers.{layer}.{block}.{module}"


@dataclass(slots=True)
class LoraAdapter:
    name: str
    path: str
    rank: int
    scaling: float
    # (layer, PEFT module name) -> (A [rank, in], B [out, rank])
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]


def _targets(raw: Any, num_layers: int, where: str) -> set[tuple[int, str]]:
    if raw == "all-linear":
        raw = list(TARGETS)
    if isinstance(raw, str):  # PEFT: a regex that must match a module's full name
        try:
            pattern = re.compile(raw)
        except re.error as exc:
            raise ValueError(f"{where}: target_modules regex {raw!r}: {exc}") from None
        found = {
            (i, m)
            for i in range(num_layers)
            for m in TARGETS
            if pattern.fullmatch(_full_name(i, m))
        }
    elif isinstance(raw, list) and raw and all(isinstance(m, str) for m in raw):
        # PEFT: an entry names a module by its full name or a dotted suffix of it.
        names = {(i, m): _full_name(i, m) for i in range(num_layers) for m in TARGETS}
        unknown = sorted(
            entry
            for entry in raw
            if not any(n == entry or n.endswith("." + entry) for n in names.values())
        )
        if unknown:
            raise ValueError(
                f"{where}: target module(s) {', '.join(unknown)} are not supported "
                f"(supported: {', '.join(TARGETS)})"
            )
        found = {key for key, n in names.items() if any(n == e or n.endswith("." + e) for e in raw)}
    else:
        raise ValueError(f"{where}: target_modules must be a non-empty list of names or a regex")
    if not found:
        raise ValueError(f"{where}: target_modules {raw!r} matches no projection of the model")
    return found


def read_adapter_config(path: str, num_layers: int) -> tuple[int, float, set[tuple[int, str]]]:
    """(rank, scaling, targeted (layer, module) pairs) of a PEFT LoRA config; `ValueError` if
    unreadable or using a feature the engine does not implement."""
    config_path = os.path.join(path, "adapter_config.json")
    try:
        with open(config_path, encoding="utf-8") as f:
            raw = json.load(f)
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"cannot read {config_path}: {exc}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{config_path} is not a JSON object")
    if raw.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{config_path}: peft_type {raw['peft_type']!r} is not LORA")
    for key in _UNSUPPORTED:
        if raw.get(key):
            raise ValueError(f"{config_path}: {key}={raw[key]!r} is not supported")
    if raw.get("bias", "none") != "none":
        raise ValueError(f"{config_path}: bias={raw['bias']!r} is not supported (only 'none')")
    rank, alpha = raw.get("r"), raw.get("lora_alpha")
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise ValueError(f"{config_path}: r must be a positive integer, got {rank!r}")
    if isinstance(alpha, bool) or not isinstance(alpha, int | float) or not alpha > 0:
        raise ValueError(f"{config_path}: lora_alpha must be a positive number, got {alpha!r}")
    scaling = alpha / (math.sqrt(rank) if raw.get("use_rslora") else rank)
    return rank, scaling, _targets(raw.get("target_modules"), num_layers, config_path)


def load_adapter(
    name: str, path: str, config: ModelConfig, dtype: torch.dtype, device: torch.device
) -> LoraAdapter:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    if not os.path.isdir(path):
        raise ValueError(f"LoRA adapter {name!r}: {path!r} is not a directory")
    rank, scaling, targets = read_adapter_config(path, config.num_hidden_layers)
    weights_path = os.path.join(path, "adapter_model.safetensors")
    try:
        tensors = load_file(weights_path)
    except (OSError, SafetensorError) as exc:
        raise ValueError(f"LoRA adapter {name!r}: cannot read {weights_path}: {exc}") from None
    expected: dict[str, tuple[int, str, str, tuple[int, int]]] = {}
    for layer, module in targets:
        fan_in, fan_out = _shapes(config, module)
        prefix = f"base_model.model.{_full_name(layer, module)}"
        expected[f"{prefix}.lora_A.weight"] = (layer, module, "A", (rank, fan_in))
        expected[f"{prefix}.lora_B.weight"] = (layer, module, "B", (fan_out, rank))
    unknown = sorted(set(tensors) - set(expected))
    missing = sorted(set(expected) - set(tensors))
    if unknown or missing:
        what = f"unexpected tensor {unknown[0]!r}" if unknown else f"missing tensor {missing[0]!r}"
        raise ValueError(f"LoRA adapter {name!r} ({weights_path}): {what} for its config")
    parts: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, (layer, module, which, shape) in expected.items():
        tensor = tensors[key]
        if tuple(tensor.shape) != shape:
            raise ValueError(
                f"LoRA adapter {name!r}: {key} has shape {tuple(tensor.shape)}, expected {shape} "
                f"(rank {rank}, the model's projection sizes)"
            )
        parts.setdefault((layer, module), {})[which] = tensor.to(device=device, dtype=dtype)
    weights = {key: (p["A"], p["B"]) for key, p in parts.items()}
    return LoraAdapter(name, path, rank, scaling, weights)


@dataclass(slots=True)
class LoraBatch:
    """The adapter groups of one step: each adapter with its rows of the flattened batch."""

    groups: list[tuple[LoraAdapter, torch.Tensor]]
    fused: dict[str, tuple[tuple[str, int, int], ...]]

    def apply(self, layer: int, proj: str, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """Add every group's update of fused projection `proj` (input `x`) into `out`."""
        parts = self.fused[proj]
        for adapter, rows in self.groups:
            xs = x[rows]
            for module, offset, width in parts:
                pair = adapter.weights.get((layer, module))
                if pair is not None:
                    a, b = pair
                    out[rows, offset : offset + width] += (xs @ a.T) @ b.T * adapter.scaling
        return out
