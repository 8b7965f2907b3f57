"""Calibrated latency model: a linear fit of the built-in engine's measured step times.

Contract: `kvherd profile` measures step times and fits
  t = c0 + c1 * prefill_tokens + c2 * prefill_attention_pairs + c3 * decode_batch + c4 * decode_ctx_tokens
by least squares over the features `step_features` computes; this module loads that JSON file and
predicts with the very same feature function, so fit and prediction cannot disagree. The file also
records the engine configuration it was measured with (block size, pool size, batch limits), which
`kvherd sim` uses for its simulated instances unless told otherwise.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from simulator.latency.base import LatencyModel, LatencyModelError, PrefillChunk, attention_pairs

PROFILE_FORMAT = "kvherd-latency-profile/v1"
FEATURES = (
    "const",
    "prefill_tokens",
    "prefill_attention_pairs",
    "decode_batch",
    "decode_context_tokens",
)
# Floor for predictions: a fit may extrapolate below zero far outside the measured grid.
_MIN_STEP_S = 1e-5


def step_features(prefill: Sequence[PrefillChunk], decode_contexts: Sequence[int]) -> list[float]:
    return [
        1.0,
        float(sum(n for n, _ in prefill)),
        float(sum(attention_pairs(n, c) for n, c in prefill)),
        float(len(decode_contexts)),
        float(sum(decode_contexts)),
    ]


class CalibratedModel(LatencyModel):
    def __init__(self, profile: dict[str, Any], source: str = "profile") -> None:
        if profile.get("format") != PROFILE_FORMAT:
            raise LatencyModelError(
                f"{source}: not a kvherd latency profile (format {profile.get('format')!r}, "
                f"expected {PROFILE_FORMAT!r})"
            )
        if list(profile.get("features", [])) != list(FEATURES):
            raise LatencyModelError(f"{source}: features {profile.get('features')} != {FEATURES}")
        coef = profile.get("coefficients_s")
        if not isinstance(coef, list) or len(coef) != len(FEATURES):
            raise LatencyModelError(f"{source}: coefficients_s must be {len(FEATURES)} numbers")
        self.coefficients = [float(c) for c in coef]
        self.engine: dict[str, int] = {k: int(v) for k, v in profile.get("engine", {}).items()}
        self.fit: dict[str, float] = dict(profile.get("fit", {}))
        self.name = f"calibrated:{source}"
        if "num_blocks" in self.engine and "block_size" in self.engine:
            self.kv_capacity_tokens = self.engine["num_blocks"] * self.engine["block_size"]
        bpt = profile.get("kv_bytes_per_token")
        self.kv_bytes_per_token = float(bpt) if bpt else None

    @classmethod
    def from_file(cls, path: str | Path) -> CalibratedModel:
        p = Path(path)
        try:
            data = json.loads(p.read_text())
        except FileNotFoundError:
            raise LatencyModelError(
                f"profile {p} not found (make one with `kvherd profile`)"
            ) from None
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise LatencyModelError(f"profile {p} is not readable JSON: {exc}") from None
        if not isinstance(data, dict):
            raise LatencyModelError(f"profile {p} must hold a JSON object")
        return cls(data, source=str(p))

    def step_time(self, prefill: Sequence[PrefillChunk], decode_contexts: Sequence[int]) -> float:
        features = step_features(prefill, decode_contexts)
        t = sum(c * x for c, x in zip(self.coefficients, features, strict=True))
        return max(t, _MIN_STEP_S)

    def describe(self) -> dict[str, object]:
        return {**super().describe(), "engine": self.engine, "fit": self.fit}
