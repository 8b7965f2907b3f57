"""DistServe fitted-coefficient latency model (Zhong et al., OSDI 2024; LLMServe/DistServe profiles).

Contract: for OPT-13B/66B on A100-80GB at a given TP, DistServe fits
  prefill  t_ms = a + b * sum(len) + c * sum(len^2)
  decode   t_ms = a + b * sum(ctx_tokens) + c * batch   (separate fits below/above a batch threshold).
A prefill chunk of n new tokens after c cached ones costs `len^2 -> n * (n + 2c)`: the quadratic term is
causal attention, which grows with the query-key pairs the chunk computes. A mixed step pays the prefill
fit plus the decode fit's marginal terms (its fixed cost `a` is already paid by the prefill pass).
Per-instance KV capacity comes from DistServe's `max_num_tokens.csv` (pipeline degree 1).
"""

from __future__ import annotations

import csv
import json
from collections.abc import Sequence
from pathlib import Path

from simulator.latency.base import LatencyModel, LatencyModelError, PrefillChunk, profiles_dir

# OPT KV bytes per token (fp16): 2 (K and V) x layers x hidden x 2 bytes.
_KV_BYTES = {"opt-13b": 2 * 40 * 5120 * 2, "opt-66b": 2 * 64 * 9216 * 2}


class DistServeModel(LatencyModel):
    def __init__(
        self, model: str, tp: int = 1, engine: str = "distserve", root: Path | None = None
    ):
        root = root or profiles_dir() / "distserve"
        path = root / f"profiler-a100-80g.{engine}.json"
        if not path.is_file():
            raise LatencyModelError(f"DistServe profile {path} not found (set KVHERD_PROFILES)")
        table = json.loads(path.read_text())
        full = f"facebook/{model}"
        if full not in table or str(tp) not in table[full]:
            have = ", ".join(f"{m.split('/')[-1]}:tp{t}" for m, v in table.items() for t in v)
            raise LatencyModelError(f"no DistServe profile for {model}:tp{tp}; have {have}")
        entry = table[full][str(tp)]
        self._prefill = [float(v) for v in entry["prefill"]]
        self._small = [float(v) for v in entry["decoding_smallbs"]]
        self._large = [float(v) for v in entry["decoding_largebs"]]
        self._threshold = int(entry["decoding_large_small_bs_threshold"])
        self.name = f"distserve:{model}:tp{tp}" + ("" if engine == "distserve" else f":{engine}")
        self.kv_bytes_per_token = float(_KV_BYTES.get(model, 0)) or None
        cap = root / "max_num_tokens.csv"
        if cap.is_file():
            with cap.open(newline="") as f:
                for row in csv.DictReader(f):
                    if row["model"] == full and int(row["tp"]) == tp and int(row["pp"]) == 1:
                        self.kv_capacity_tokens = int(row["max_num_tokens"])

    def step_time(self, prefill: Sequence[PrefillChunk], decode_contexts: Sequence[int]) -> float:
        ms = 0.0
        if decode_contexts:
            a, b, c = self._small if len(decode_contexts) < self._threshold else self._large
            ms = b * sum(decode_contexts) + c * len(decode_contexts)
            if not prefill:
                ms += a
        if prefill:
            a, b, c = self._prefill
            ms += a + b * sum(n for n, _ in prefill) + c * sum(n * (n + 2 * k) for n, k in prefill)
        return ms / 1000.0
