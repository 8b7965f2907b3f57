"""Calibrated latency model: a linear fit of the built-in engine's measured step times.

Contract: `kvherd profile` measures whole engine steps and fits
  t = c0 + c1 * prefill_sequences + c2 * prefill_tokens + c3 * prefill_attention_pairs
        + c4 * decode_batch + c5 * decode_context_tokens
by least squares over the features `kvherd.profile_format` computes; this module
loads that JSON file and predicts with the very same feature function, so fit and prediction
cannot disagree. Files of the
first format (``kvherd-latency-profile/v1``, without ``prefill_sequences``) still load; a feature a
file does not name weighs zero.

The file also records the engine configuration it was measured with (block size, pool size, batch
limits), which `kvherd sim` uses for its simulated instances unless told otherwise, and may carry a
``serving`` section measured against a running fleet (see bench/sim_fidelity.py),
``{"compute_scale": f, "step_s": a, "per_sequence_s": b}``: how much slower the fleet's agents
compute than the profile measured (wall time under the machine's load against the profile's clock),
and what a live fleet spends per step outside the engine (streaming every sequence's token over
HTTP, thread hand-offs). A step then takes ``f * (fitted time) + a + b * (sequences in the step)``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvherd.profile_format import FEATURES, PROFILE_FORMAT, step_features
from simulator.latency.base import LatencyModel, LatencyModelError, PrefillChunk

_FORMATS = ("kvherd-latency-profile/v1", PROFILE_FORMAT)
# Floor for predictions: a fit may extrapolate below zero far outside the measured grid.
_MIN_STEP_S = 1e-5


def _number(value: Any, what: str, source: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise LatencyModelError(f"{source}: {what} must be a finite number, got {value!r}")
    return float(value)


class CalibratedModel(LatencyModel):
    def __init__(self, profile: dict[str, Any], source: str = "profile") -> None:
        if profile.get("format") not in _FORMATS:
            raise LatencyModelError(
                f"{source}: not a kvherd latency profile (format {profile.get('format')!r}, "
                f"expected one of {_FORMATS})"
            )
        names = profile.get("features")
        coef = profile.get("coefficients_s")
        if not isinstance(names, list) or not set(names) <= set(FEATURES):
            raise LatencyModelError(f"{source}: features {names} must be among {FEATURES}")
        if not isinstance(coef, list) or len(coef) != len(names):
            raise LatencyModelError(f"{source}: coefficients_s must be {len(names)} numbers")
        fitted = {
            n: _number(c, f"coefficient of {n}", source) for n, c in zip(names, coef, strict=True)
        }
        # One weight per known feature, so prediction is a fixed-length dot product.
        self.fitted = [fitted.get(name, 0.0) for name in FEATURES]
        serving = profile.get("serving") or {}
        if not isinstance(serving, dict):
            raise LatencyModelError(f"{source}: serving must be an object")
        defaults = {"compute_scale": 1.0, "step_s": 0.0, "per_sequence_s": 0.0}
        self.serving = {
            key: _number(serving.get(key, default), f"serving.{key}", source)
            for key, default in defaults.items()
        }
        if self.serving["compute_scale"] <= 0:
            raise LatencyModelError(f"{source}: serving.compute_scale must be positive")
        self.coefficients = [self.serving["compute_scale"] * c for c in self.fitted]
        self.coefficients[FEATURES.index("const")] += self.serving["step_s"]
        for name in ("prefill_sequences", "decode_batch"):
            self.coefficients[FEATURES.index(name)] += self.serving["per_sequence_s"]
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

    def engine_step_time(
        self, prefill: Sequence[PrefillChunk], decode_contexts: Sequence[int]
    ) -> float:
        """The fitted engine step alone, as profiled (no serving section, no compute scale)."""
        features = step_features(prefill, decode_contexts)
        t = sum(c * x for c, x in zip(self.fitted, features, strict=True))
        return max(t, _MIN_STEP_S)

    def step_time(self, prefill: Sequence[PrefillChunk], decode_contexts: Sequence[int]) -> float:
        features = step_features(prefill, decode_contexts)
        t = sum(c * x for c, x in zip(self.coefficients, features, strict=True))
        return max(t, _MIN_STEP_S)

    def describe(self) -> dict[str, object]:
        return {
            **super().describe(),
            "engine": self.engine,
            "fit": self.fit,
            "serving": self.serving,
        }
