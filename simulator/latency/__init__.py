"""Latency models for simulated instances, selected by a spec string (see `SPEC_HELP`)."""

from __future__ import annotations

from simulator.latency.base import LatencyModel, LatencyModelError

SPEC_HELP = (
    "latency model: roofline:MODEL:GPU[:tpN] (MODEL llama-2-7b|llama-2-13b|llama-2-70b, "
    "GPU a100-80gb|h100|h200), splitwise:MODEL:HW:tpN (measured table, e.g. "
    "splitwise:llama2-70b:a100:tp4), distserve:MODEL[:tpN][:vllm] (fitted coefficients, "
    "opt-13b|opt-66b), calibrated:FILE.json (from `kvherd profile`)"
)


def _tp(part: str, spec: str) -> int:
    if not part.startswith("tp") or not part[2:].isdigit():
        raise LatencyModelError(f"{spec!r}: expected tpN, got {part!r}")
    return int(part[2:])


def load_latency_model(spec: str) -> LatencyModel:
    """Build the latency model a spec names; raises `LatencyModelError` with a usable message."""
    kind, _, rest = spec.partition(":")
    parts = rest.split(":") if rest else []
    if kind == "calibrated":
        from simulator.latency.calibrated import CalibratedModel

        if not rest:
            raise LatencyModelError("calibrated needs a file: calibrated:FILE.json")
        return CalibratedModel.from_file(rest)
    if kind == "roofline":
        from simulator.latency.roofline import RooflineModel

        if len(parts) not in (2, 3):
            raise LatencyModelError(f"{spec!r}: expected roofline:MODEL:GPU[:tpN]")
        return RooflineModel(parts[0], parts[1], _tp(parts[2], spec) if len(parts) == 3 else 1)
    if kind == "splitwise":
        from simulator.latency.profile_table import SplitwiseModel

        if len(parts) != 3:
            raise LatencyModelError(f"{spec!r}: expected splitwise:MODEL:HW:tpN")
        return SplitwiseModel(parts[0], parts[1], _tp(parts[2], spec))
    if kind == "distserve":
        from simulator.latency.distserve import DistServeModel

        if not 1 <= len(parts) <= 3:
            raise LatencyModelError(f"{spec!r}: expected distserve:MODEL[:tpN][:vllm]")
        tp = _tp(parts[1], spec) if len(parts) >= 2 else 1
        engine = parts[2] if len(parts) == 3 else "distserve"
        return DistServeModel(parts[0], tp, engine)
    raise LatencyModelError(f"unknown latency model {spec!r}; {SPEC_HELP}")


__all__ = ["SPEC_HELP", "LatencyModel", "LatencyModelError", "load_latency_model"]
