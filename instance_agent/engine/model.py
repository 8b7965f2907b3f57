"""Llama-family decoder (Llama, Qwen2) running on a paged KV cache.

Contract:
- `LlamaModel(config)` holds the weights under HF-like names, with q/k/v and gate/up fused
  (``qkv_proj``, ``gate_up_proj``); `load_hf_weights` takes HF tensor names and fills the fused slices.
- `forward(input_ids, positions, kv_cache, meta, lora)` runs one flattened mixed batch (decodes then
  prefill chunks, see `attention.AttentionMetadata`) and returns the final hidden states
  ``[num_tokens, hidden]``; it writes every token's KV into its slot. `lora` (a `lora.LoraBatch`,
  None when no row has an adapter) adds each adapter's update to its rows' projections.
  `compute_logits` maps the hidden states of the positions that sample to vocabulary logits
  (float32).
- The KV cache is one tensor ``[layers, 2, num_blocks, block_size, kv_heads, head_dim]``, allocated
  by `allocate_kv_cache`.
- Numerics follow HF transformers (RMSNorm in float32, rotate-half RoPE, SiLU-gated MLP), so logits
  match `LlamaForCausalLM` / `Qwen2ForCausalLM` to float rounding.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from instance_agent.engine.attention import AttentionMetadata, paged_attention
from instance_agent.engine.config import ModelConfig
from instance_agent.engine.lora import LoraBatch


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


class RotaryEmbedding(nn.Module):
    """cos/sin tables for every position, computed once (same float32 recipe as HF)."""

    def __init__(self, head_dim: int, max_positions: int, theta: float) -> None:
        super().__init__()
        inv_freq = 1.0 / (
            theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim)
        )
        freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos: torch.Tensor
        self.sin: torch.Tensor
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def forward(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # [num_tokens, 1, head_dim], broadcast over heads
        return self.cos[positions, None, :].to(dtype), self.sin[positions, None, :].to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return x * cos + _rotate_half(x) * sin


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = self.head_dim**-0.5
        self.qkv_proj = nn.Linear(
            config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.attention_bias
        )
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=False)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        lora: LoraBatch | None,
    ) -> torch.Tensor:
        n = x.shape[0]
        qkv = self.qkv_proj(x)
        if lora is not None:
            lora.apply(self.layer, "qkv_proj", x, qkv)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = apply_rope(q.view(n, self.num_heads, self.head_dim), cos, sin)
        k = apply_rope(k.view(n, self.num_kv_heads, self.head_dim), cos, sin)
        v = v.view(n, self.num_kv_heads, self.head_dim)
        out = paged_attention(q, k, v, kv_cache, meta, self.scale).reshape(n, self.q_size)
        if lora is None:
            return self.o_proj(out)
        return lora.apply(self.layer, "o_proj", out, self.o_proj(out))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.intermediate_size = config.intermediate_size
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, lora: LoraBatch | None) -> torch.Tensor:
        if lora is None:
            gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
            return self.down_proj(F.silu(gate) * up)
        gate_up = lora.apply(self.layer, "gate_up_proj", x, self.gate_up_proj(x))
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        act = F.silu(gate) * up
        return lora.apply(self.layer, "down_proj", act, self.down_proj(act))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        self.self_attn = Attention(config, layer)
        self.mlp = MLP(config, layer)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        h: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        lora: LoraBatch | None,
    ) -> torch.Tensor:
        h = h + self.self_attn(self.input_layernorm(h), cos, sin, kv_cache, meta, lora)
        return h + self.mlp(self.post_attention_layernorm(h), lora)


class DecoderStack(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(config, i) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = DecoderStack(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.rotary = RotaryEmbedding(
            config.head_dim, config.max_position_embeddings, config.rope_theta
        )

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        lora: LoraBatch | None = None,
    ) -> torch.Tensor:
        h = self.model.embed_tokens(input_ids)
        cos, sin = self.rotary(positions, h.dtype)
        for i, layer in enumerate(self.model.layers):
            h = layer(h, cos, sin, kv_cache[i], meta, lora)
        return self.model.norm(h)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    # -- weights -----------------------------------------------------------------------------
    def init_random(self, seed: int) -> None:
        """HF's initialisation (normal(0, initializer_range), zero biases, unit norms) from a seed."""
        gen = torch.Generator().manual_seed(seed)
        std = self.config.initializer_range
        with torch.no_grad():
            for name, param in self.named_parameters():
                if name.endswith("layernorm.weight") or name == "model.norm.weight":
                    param.fill_(1.0)
                elif name.endswith(".bias"):
                    param.zero_()
                else:
                    param.copy_(torch.randn(param.shape, generator=gen) * std)

    def load_hf_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Fill parameters from HF-named tensors; raises `ValueError` on missing/unknown/misshapen ones."""
        cfg = self.config
        q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
        # HF name fragment -> (our fragment, row offset, rows) inside a fused parameter
        fused = {
            "q_proj": ("qkv_proj", 0, q),
            "k_proj": ("qkv_proj", q, kv),
            "v_proj": ("qkv_proj", q + kv, kv),
            "gate_proj": ("gate_up_proj", 0, cfg.intermediate_size),
            "up_proj": ("gate_up_proj", cfg.intermediate_size, cfg.intermediate_size),
        }
        params = dict(self.named_parameters(remove_duplicate=False))
        expected = {n: p.numel() for n, p in params.items()}
        if cfg.tie_word_embeddings:
            expected.pop("lm_head.weight")
        loaded: dict[str, int] = {}
        with torch.no_grad():
            for name, tensor in weights:
                if "rotary_emb" in name:
                    continue  # derived buffers some checkpoints carry
                if cfg.tie_word_embeddings and name == "lm_head.weight":
                    continue
                target, offset, rows = name, 0, None
                for hf_part, (ours, off, n_rows) in fused.items():
                    if f".{hf_part}." in name:
                        target, offset, rows = name.replace(hf_part, ours), off, n_rows
                        break
                param = params.get(target)
                if param is None:
                    raise ValueError(
                        f"checkpoint tensor {name!r} has no place in a {cfg.model_type} model"
                    )
                dest = param if rows is None else param.narrow(0, offset, rows)
                if tuple(dest.shape) != tuple(tensor.shape):
                    raise ValueError(
                        f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, "
                        f"expected {tuple(dest.shape)}"
                    )
                dest.copy_(tensor.to(dest.dtype))
                loaded[target] = loaded.get(target, 0) + tensor.numel()
        missing = sorted(n for n, size in expected.items() if loaded.get(n, 0) != size)
        if missing:
            raise ValueError(f"checkpoint lacks tensors for: {', '.join(missing[:8])}")


def allocate_kv_cache(
    config: ModelConfig,
    num_blocks: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
) -> torch.Tensor:
    return torch.zeros(
        config.num_hidden_layers,
        2,
        num_blocks,
        block_size,
        config.num_key_value_heads,
        config.head_dim,
        dtype=dtype,
        device=device,
    )


def kv_bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    itemsize = torch.empty((), dtype=dtype).element_size()
    return (
        config.num_hidden_layers
        * 2
        * block_size
        * config.num_key_value_heads
        * config.head_dim
        * itemsize
    )
