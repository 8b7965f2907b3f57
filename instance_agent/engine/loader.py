"""Load a model for the engine: a random-init preset or a local HF checkpoint directory.

Contract:
- ``load_model(spec, seed, dtype, device)``: `spec` is a preset name (``tiny``, ``small``: weights drawn
  from `seed`, byte tokenizer) or a directory holding ``config.json`` and safetensors weights (one
  file, several, or a sharded ``model.safetensors.index.json``); its tokenizer files, if any, give an
  HF tokenizer, otherwise the byte tokenizer is used.
- Nothing touches the network. Every problem (no such preset or directory, unreadable or unsupported
  config, missing or misshapen tensors) raises `ValueError` naming it.
- `dtype` "auto" means float32 on CPU and bfloat16 on CUDA; `device` None means CUDA when available.
"""

from __future__ import annotations

import glob
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from instance_agent.engine.config import PRESETS, ModelConfig
from instance_agent.engine.model import LlamaModel, RotaryEmbedding
from kvherd.tokenizer import ByteTokenizer, Tokenizer, load_tokenizer

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float16": torch.float16,
    "fp16": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}


@dataclass(slots=True)
class LoadedModel:
    model: LlamaModel
    config: ModelConfig
    tokenizer: Tokenizer
    dtype: torch.dtype
    device: torch.device
    source: str  # preset name or checkpoint directory


def resolve_device(device: str | torch.device | None) -> torch.device:
    if device is None or device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"unknown device {device!r}") from exc
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' requested but CUDA is not available")
    return dev


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype is None or dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in _DTYPES:
        raise ValueError(f"unknown dtype {dtype!r} (expected auto or one of {sorted(_DTYPES)})")
    return _DTYPES[dtype]


def read_checkpoint_config(path: str) -> ModelConfig:
    config_path = os.path.join(path, "config.json")
    if not os.path.isfile(config_path):
        raise ValueError(f"model directory {path!r} has no config.json")
    try:
        with open(config_path, encoding="utf-8") as f:
            raw = json.load(f)
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"cannot read {config_path}: {exc}") from exc
    if not isinstance(raw, dict):
        raise ValueError(f"{config_path} is not a JSON object")
    return ModelConfig.from_hf_dict(raw)


def _weight_files(path: str) -> list[str]:
    index_path = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index_path):
        try:
            with open(index_path, encoding="utf-8") as f:
                weight_map = json.load(f)["weight_map"]
        except (OSError, json.JSONDecodeError, KeyError, TypeError) as exc:
            raise ValueError(f"cannot read {index_path}: {exc}") from exc
        files = sorted({os.path.join(path, shard) for shard in weight_map.values()})
        absent = [f for f in files if not os.path.isfile(f)]
        if absent:
            raise ValueError(f"shard(s) listed in {index_path} are missing: {absent}")
        return files
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise ValueError(f"model directory {path!r} has no *.safetensors weights")
    return files


def _iter_tensors(files: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import SafetensorError
    from safetensors.torch import safe_open

    for file in files:
        try:
            with safe_open(file, framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                    yield name, f.get_tensor(name)
        except SafetensorError as exc:
            raise ValueError(f"cannot read weights {file}: {exc}") from exc


def load_model(
    spec: str,
    seed: int = 0,
    dtype: str | torch.dtype | None = "auto",
    device: str | torch.device | None = None,
) -> LoadedModel:
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    tokenizer: Tokenizer
    if spec in PRESETS:
        config = PRESETS[spec]
        model = LlamaModel(config)
        model.init_random(seed)
        tokenizer = ByteTokenizer()
    elif os.path.isdir(spec):
        config = read_checkpoint_config(spec)
        files = _weight_files(spec)
        model = LlamaModel(config)
        model.load_hf_weights(_iter_tensors(files))
        tokenizer = load_tokenizer(spec)
    else:
        raise ValueError(
            f"unknown model {spec!r}: not a preset ({', '.join(sorted(PRESETS))}) "
            "and not a local checkpoint directory"
        )
    model = model.to(device=dev, dtype=dt).eval()
    # The rotary tables stay float32 (cast per step), as HF computes them: rebuild after the cast.
    model.rotary = RotaryEmbedding(
        config.head_dim, config.max_position_embeddings, config.rope_theta
    ).to(dev)
    return LoadedModel(model, config, tokenizer, dt, dev, spec)
