"""Splitwise measured-profile latency model (Patel et al., ISCA 2024; Mutinifni/splitwise-sim data).

Contract: `perf_model.csv` gives measured prompt (prefill) times over prompt size x batch size and token
(decode) times over batch size for llama2-70b / bloom-176b on A100-80GB and H100-80GB at TP 2/4/8.
- Prefill time is interpolated piecewise-linearly over the step's total tokens (prompt_size x batch_size,
  median over repeated runs; extrapolated along the last segment). Decode tokens that ride along in a
  chunked-prefill step count as extra tokens of that forward pass (Sarathi-style mixed batches).
- A pure decode step is interpolated over its batch size. The table does not vary decode time with
  context length, so neither does this model; use the roofline or DistServe model to study long contexts.
"""

from __future__ import annotations

import csv
import statistics
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from simulator.latency.base import LatencyModel, LatencyModelError, PrefillChunk, profiles_dir
from simulator.latency.roofline import MODELS

_HW_ALIASES = {"a100": "a100-80gb", "h100": "h100-80gb"}
_CAPACITY_SHAPE = {"llama2-70b": "llama-2-70b"}  # KV sizing borrowed from the roofline presets


class _Curve:
    """Piecewise-linear interpolation with linear extrapolation past both ends."""

    def __init__(self, xs: Sequence[float], ys: Sequence[float]) -> None:
        self.xs = np.asarray(xs, dtype=float)
        self.ys = np.asarray(ys, dtype=float)

    def __call__(self, x: float) -> float:
        xs, ys = self.xs, self.ys
        if x <= xs[-1]:
            if x >= xs[0]:
                return float(np.interp(x, xs, ys))
            slope = (ys[1] - ys[0]) / (xs[1] - xs[0])
            return max(float(ys[0] + slope * (x - xs[0])), float(ys[0]) * 0.5)
        slope = (ys[-1] - ys[-2]) / (xs[-1] - xs[-2])
        return float(ys[-1] + slope * (x - xs[-1]))


class SplitwiseModel(LatencyModel):
    def __init__(self, model: str, hardware: str, tp: int, path: Path | None = None) -> None:
        hardware = _HW_ALIASES.get(hardware, hardware)
        path = path or profiles_dir() / "splitwise" / "perf_model.csv"
        if not path.is_file():
            raise LatencyModelError(f"Splitwise profile {path} not found (set KVHERD_PROFILES)")
        prompt: dict[int, list[float]] = defaultdict(list)
        token: dict[int, list[float]] = defaultdict(list)
        combos: set[tuple[str, str, int]] = set()
        with path.open(newline="") as f:
            for row in csv.DictReader(f):
                key = (row["model"], row["hardware"], int(row["tensor_parallel"]))
                combos.add(key)
                if key != (model, hardware, tp):
                    continue
                prompt_size, batch = int(row["prompt_size"]), int(row["batch_size"])
                prompt[prompt_size * batch].append(float(row["prompt_time"]) / 1000.0)
                if prompt_size == 512 and int(row["token_size"]) == 128:
                    token[batch].append(float(row["token_time"]) / 1000.0)
        if not prompt or len(token) < 2:
            have = ", ".join(f"{m}:{h}:tp{t}" for m, h, t in sorted(combos))
            raise LatencyModelError(
                f"no Splitwise profile for {model}:{hardware}:tp{tp}; have {have}"
            )
        xs = sorted(prompt)
        self._prefill = _Curve(xs, [statistics.median(prompt[x]) for x in xs])
        bs = sorted(token)
        self._decode = _Curve(bs, [statistics.median(token[b]) for b in bs])
        self.name = f"splitwise:{model}:{hardware}:tp{tp}"
        shape_name = _CAPACITY_SHAPE.get(model)
        if shape_name is not None:
            shape = MODELS[shape_name]
            gpu_bytes = 80e9  # every GPU in the table has 80 GB
            free = gpu_bytes * tp * 0.9 - shape.weight_bytes
            self.kv_bytes_per_token = float(shape.kv_bytes_per_token)
            self.kv_capacity_tokens = max(int(free // shape.kv_bytes_per_token), 0) or None

    def step_time(self, prefill: Sequence[PrefillChunk], decode_contexts: Sequence[int]) -> float:
        if prefill:
            return self._prefill(sum(n for n, _ in prefill) + len(decode_contexts))
        return self._decode(len(decode_contexts))
