"""Synthetic traces: Poisson/Gamma arrivals, length distributions, Zipf-popular shared prefixes.

Contract: `generate(SyntheticSpec)` returns a `Trace` that is a pure function of the spec (seeded
numpy Generator). Arrivals are a renewal process with mean rate `rate` and inter-arrival coefficient
of variation `cv` (cv = 1: Poisson; otherwise Gamma with shape 1/cv^2). Input and output lengths are
log-normal with the given means and `length_sigma` (0: fixed). With `num_groups` > 0 a request joins
prefix group g with Zipf(`zipf_s`) popularity and shares the group's first `prefix_tokens` tokens (in
whole id blocks of `id_block_size`); the rest of its prompt is its own. With `adapters` > 0 each
request names a LoRA adapter (``lora-0`` .. ``lora-{adapters-1}``, its `model`) with
Zipf(`adapter_zipf_s`) popularity, drawn after everything else (the rest of the trace is that of
the same spec without adapters).
`parse_spec("synthetic:requests=1000,rate=20,...")` builds a spec from the CLI form.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np

from simulator.traces import Trace, TraceRequest, group_block_ids, unique_block_ids


@dataclass(frozen=True, slots=True)
class SyntheticSpec:
    requests: int = 1000
    rate: float = 10.0  # requests per second
    cv: float = 1.0
    input_mean: int = 2048
    output_mean: int = 128
    length_sigma: float = 0.5
    num_groups: int = 0
    zipf_s: float = 1.1
    prefix_tokens: int = 1024
    id_block_size: int = 512
    max_input: int = 32768
    seed: int = 0
    adapters: int = 0  # LoRA adapters requests name (0: none, no model)
    adapter_zipf_s: float = 1.0

    def validate(self) -> None:
        if self.requests < 1 or self.rate <= 0 or self.cv <= 0:
            raise ValueError("synthetic: requests >= 1, rate > 0 and cv > 0 are required")
        if self.input_mean < 1 or self.output_mean < 1 or self.length_sigma < 0:
            raise ValueError("synthetic: input_mean, output_mean >= 1 and length_sigma >= 0")
        if self.num_groups < 0 or self.zipf_s <= 0 or self.prefix_tokens < 0:
            raise ValueError("synthetic: num_groups >= 0, zipf_s > 0, prefix_tokens >= 0")
        if self.adapters < 0 or self.adapter_zipf_s <= 0:
            raise ValueError("synthetic: adapters >= 0 and adapter_zipf_s > 0 are required")


def _lognormal(rng: np.random.Generator, mean: float, sigma: float, n: int) -> np.ndarray:
    if sigma == 0:
        return np.full(n, mean, dtype=float)
    # Choose mu so the distribution's mean is `mean`.
    mu = np.log(mean) - sigma * sigma / 2
    return rng.lognormal(mu, sigma, n)


def _zipf_choice(rng: np.random.Generator, count: int, s: float, n: int) -> np.ndarray:
    """`n` draws from 0 .. count-1 with Zipf(`s`) popularity (rank r has weight r^-s)."""
    popularity = np.arange(1, count + 1, dtype=float) ** -s
    return rng.choice(count, size=n, p=popularity / popularity.sum())


def generate(spec: SyntheticSpec) -> Trace:
    spec.validate()
    rng = np.random.default_rng(spec.seed)
    n = spec.requests
    mean_gap = 1.0 / spec.rate
    if spec.cv == 1.0:
        gaps = rng.exponential(mean_gap, n)
    else:
        shape = 1.0 / (spec.cv * spec.cv)
        gaps = rng.gamma(shape, mean_gap / shape, n)
    gaps[0] = 0.0
    arrivals = np.cumsum(gaps)
    inputs = np.clip(
        np.rint(_lognormal(rng, spec.input_mean, spec.length_sigma, n)), 1, spec.max_input
    )
    outputs = np.maximum(np.rint(_lognormal(rng, spec.output_mean, spec.length_sigma, n)), 1)
    groups = np.full(n, -1)
    if spec.num_groups:
        groups = _zipf_choice(rng, spec.num_groups, spec.zipf_s, n)
    adapters = _zipf_choice(rng, spec.adapters, spec.adapter_zipf_s, n) if spec.adapters else None
    bs = spec.id_block_size
    rows: list[TraceRequest] = []
    for i in range(n):
        length = int(inputs[i])
        num_blocks = -(-length // bs)
        ids = unique_block_ids(i, num_blocks)
        if groups[i] >= 0:
            shared = min(spec.prefix_tokens, length) // bs
            ids = group_block_ids(int(groups[i]), shared) + ids[shared:]
        model = None if adapters is None else f"lora-{adapters[i]}"
        rows.append(TraceRequest(i, float(arrivals[i]), length, int(outputs[i]), ids, model=model))
    name = f"synthetic(n={n},rate={spec.rate:g},cv={spec.cv:g},groups={spec.num_groups})"
    if spec.adapters:
        name = name[:-1] + f",adapters={spec.adapters})"
    return Trace(name, rows, bs, has_prefix_info=spec.num_groups > 0)


def parse_spec(text: str) -> SyntheticSpec:
    """``synthetic:key=value,...`` with keys of `SyntheticSpec`."""
    _, _, body = text.partition(":")
    types = {f.name: f.type for f in fields(SyntheticSpec)}
    values: dict[str, int | float] = {}
    for item in filter(None, (part.strip() for part in body.split(","))):
        key, sep, raw = item.partition("=")
        if not sep or key not in types:
            raise ValueError(
                f"synthetic trace: bad item {item!r}; keys are {', '.join(sorted(types))}"
            )
        try:
            values[key] = int(raw) if types[key] in ("int", int) else float(raw)
        except ValueError:
            raise ValueError(f"synthetic trace: {key} must be a number, got {raw!r}") from None
    return SyntheticSpec(**values)  # type: ignore[arg-type]
