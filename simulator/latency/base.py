"""The latency-model interface: how long one engine step takes, given what the step computes.

Contract:
- `LatencyModel.step_time(prefill, decode_contexts)` returns seconds (> 0) for one engine step that
  computes, for each prefill chunk `(num_new_tokens, num_computed_before)`, and one token for each decode
  request whose KV context holds `decode_contexts[i]` tokens. The simulated instance builds these from the
  engine scheduler's `SchedulerOutput`, so any model sees exactly the batches the real engine would run.
- `kv_capacity_tokens` (tokens of KV an instance holds, or None when the model does not know) sizes the
  simulated block pool; `kv_bytes_per_token` (or None) prices migrations.
- `decode_step_times` prices a run of pure-decode steps at once (the simulator's decode
  fast-forward); it equals calling `step_time` once per step, bit for bit.
- Models are pure and deterministic.
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from pathlib import Path

PrefillChunk = tuple[int, int]  # (num_new_tokens, num_computed_before)


class LatencyModel(ABC):
    name: str = "latency-model"
    kv_capacity_tokens: int | None = None
    kv_bytes_per_token: float | None = None

    @abstractmethod
    def step_time(self, prefill: Sequence[PrefillChunk], decode_contexts: Sequence[int]) -> float:
        """Seconds one step takes."""

    def decode_step_times(self, decode_contexts: Sequence[int], num_steps: int) -> Iterator[float]:
        """`step_time` of `num_steps` consecutive pure-decode steps of the same requests, lazily
        (the caller stops at its horizon).

        Step j (0-based) decodes one token for each request, with contexts `decode_contexts[i] + j`.
        Models whose decode cost depends only on the count and sum of contexts override this with
        a closed form that evaluates exactly the same arithmetic as `step_time`.
        """
        for j in range(num_steps):
            yield self.step_time((), [c + j for c in decode_contexts])

    def describe(self) -> dict[str, object]:
        return {
            "name": self.name,
            "kv_capacity_tokens": self.kv_capacity_tokens,
            "kv_bytes_per_token": self.kv_bytes_per_token,
        }


class LatencyModelError(ValueError):
    """A latency-model spec or profile file that cannot be used."""


def profiles_dir() -> Path:
    """Where the measured GPU profiles live: $KVHERD_PROFILES, else the repository's
    ``traces/profiles`` (see its README)."""
    env = os.environ.get("KVHERD_PROFILES")
    if env:
        return Path(env)
    return Path(__file__).resolve().parents[2] / "traces" / "profiles"
