"""Analytic roofline latency model for a model x GPU x tensor-parallel degree.

Contract: a step's time is the sum of (a) the dense layers, bounded below by both the weight bytes read
from HBM and the matmul FLOPs, (b) attention, bounded by the KV bytes read and its FLOPs, (c) the
tensor-parallel all-reduces (two per layer) over NVLink, and (d) a fixed per-step overhead (scheduling,
kernel launches, sampling). Each bound is divided by an efficiency factor (model FLOPs utilisation,
memory bandwidth utilisation) because no kernel reaches the data-sheet peak. fp16/bf16 weights and KV.
Presets cover Llama-2 7B/13B/70B on A100-80GB, H100 (SXM) and H200.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from kvherd.profile_format import attention_pairs
from simulator.latency.base import LatencyModel, LatencyModelError, PrefillChunk


@dataclass(frozen=True, slots=True)
class ModelShape:
    num_params: float  # dense parameters touched per token
    num_layers: int
    hidden_size: int
    num_kv_heads: int
    head_dim: int
    dtype_bytes: int = 2

    @property
    def weight_bytes(self) -> float:
        return self.num_params * self.dtype_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype_bytes


@dataclass(frozen=True, slots=True)
class GPUSpec:
    peak_flops: float  # dense fp16/bf16 FLOP/s
    hbm_bandwidth: float  # bytes/s
    memory_bytes: float
    link_bandwidth: float  # NVLink bytes/s per GPU, one direction


MODELS: dict[str, ModelShape] = {
    "llama-2-7b": ModelShape(6.74e9, 32, 4096, 32, 128),
    "llama-2-13b": ModelShape(13.0e9, 40, 5120, 40, 128),
    "llama-2-70b": ModelShape(68.98e9, 80, 8192, 8, 128),
}

GPUS: dict[str, GPUSpec] = {
    "a100-80gb": GPUSpec(312e12, 2.039e12, 80e9, 300e9),
    "h100": GPUSpec(989e12, 3.35e12, 80e9, 450e9),
    "h200": GPUSpec(989e12, 4.8e12, 141e9, 450e9),
}
_GPU_ALIASES = {"a100": "a100-80gb", "h100-80gb": "h100", "h100-sxm": "h100"}


class RooflineModel(LatencyModel):
    def __init__(
        self,
        model: str,
        gpu: str,
        tp: int = 1,
        mfu: float = 0.55,
        mbu: float = 0.8,
        step_overhead_s: float = 0.004,
        memory_utilization: float = 0.9,
    ) -> None:
        gpu = _GPU_ALIASES.get(gpu, gpu)
        if model not in MODELS:
            raise LatencyModelError(
                f"unknown roofline model {model!r}; presets: {', '.join(sorted(MODELS))}"
            )
        if gpu not in GPUS:
            raise LatencyModelError(f"unknown GPU {gpu!r}; presets: {', '.join(sorted(GPUS))}")
        if tp < 1:
            raise LatencyModelError(f"tensor parallelism must be >= 1, got {tp}")
        self.shape = MODELS[model]
        self.gpu = GPUS[gpu]
        self.tp = tp
        self.mfu = mfu
        self.mbu = mbu
        self.step_overhead_s = step_overhead_s
        self.name = f"roofline:{model}:{gpu}:tp{tp}"
        free = self.gpu.memory_bytes * tp * memory_utilization - self.shape.weight_bytes
        if free <= 0:
            raise LatencyModelError(f"{model} does not fit on {tp}x {gpu}")
        self.kv_bytes_per_token = float(self.shape.kv_bytes_per_token)
        self.kv_capacity_tokens = int(free // self.shape.kv_bytes_per_token)
        self._flops = self.gpu.peak_flops * tp * mfu
        self._bandwidth = self.gpu.hbm_bandwidth * tp * mbu

    def step_time(self, prefill: Sequence[PrefillChunk], decode_contexts: Sequence[int]) -> float:
        num_tokens = len(decode_contexts) + sum(n for n, _ in prefill)
        pairs = sum(attention_pairs(n, c) for n, c in prefill) + sum(decode_contexts)
        kv_read = sum(c for _, c in prefill) + sum(decode_contexts)
        return self._time(num_tokens, pairs, kv_read)

    def decode_step_times(self, decode_contexts: Sequence[int], num_steps: int) -> Iterator[float]:
        # Only the count and the (integer, so exact) sum of the contexts enter the step time;
        # the terms that do not change along the run are evaluated once, in `_time`'s order.
        shape = self.shape
        n = len(decode_contexts)
        total = sum(decode_contexts)
        dense = max(
            2.0 * shape.num_params * n / self._flops,
            shape.weight_bytes / self._bandwidth,
        )
        attn_scale = 4.0 * shape.num_layers * shape.hidden_size
        kv_bytes = shape.kv_bytes_per_token
        comm = self._comm(n)
        flops = self._flops
        bandwidth = self._bandwidth
        overhead = self.step_overhead_s
        for j in range(num_steps):
            context = total + j * n
            attention = max(attn_scale * context / flops, context * kv_bytes / bandwidth)
            yield dense + attention + comm + overhead

    def _time(self, num_tokens: int, pairs: int, kv_read: int) -> float:
        shape = self.shape
        dense = max(
            2.0 * shape.num_params * num_tokens / self._flops,
            shape.weight_bytes / self._bandwidth,
        )
        # Attention: QK^T and AV, 2 FLOPs per multiply-add each, over all query heads.
        attn_flops = 4.0 * shape.num_layers * shape.hidden_size * pairs
        attention = max(
            attn_flops / self._flops, kv_read * shape.kv_bytes_per_token / self._bandwidth
        )
        return dense + attention + self._comm(num_tokens) + self.step_overhead_s

    def _comm(self, num_tokens: int) -> float:
        if self.tp == 1:
            return 0.0
        # Ring all-reduce moves 2(tp-1)/tp of the activations, twice per layer.
        shape = self.shape
        act = num_tokens * shape.hidden_size * shape.dtype_bytes
        return 2 * shape.num_layers * 2 * (self.tp - 1) / self.tp * act / self.gpu.link_bandwidth
