"""Where an engine's decode throughput stops growing with its batch: the saturation batch size.

Contract:
- `DecodeThroughput` is pure (no clock of its own): the engine thread reports every decode-only
  step it ran (`record(num_seqs, seconds)`: one token per sequence, no prefill in the batch).
- Steps are kept in power-of-two buckets of batch size (``[1]``, ``[2, 3]``, ``[4, 7]``, ...) as
  exponentially decayed sums (each new step in a bucket weighs ``1/memory`` of it), so a bucket
  follows the machine's current speed. A bucket's throughput is its sequences per second of step
  time; it is known once it holds ``min_steps`` (decayed) steps.
- `saturation_seqs()`: the mean batch size (rounded up) of the smallest known bucket whose
  throughput reaches ``fraction`` of the best known bucket's, provided some known larger bucket
  exists (throughput was seen to stop growing beyond it); None otherwise. Sequences running beyond
  it add latency to every running request and (almost) nothing to what the engine completes: the
  proxy counts them as waiting when it judges the wait a new request faces
  (`scheduler.core.admission`). Engines that batch without bound (a CPU engine, or a GPU one
  compute-bound at large batches) saturate well before their ``max_num_seqs``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class SaturationSettings:
    fraction: float = 0.8  # throughput counted as saturated
    memory: int = 200  # steps a bucket remembers (decay 1 - 1/memory per step recorded in it)
    min_steps: float = 20.0  # decayed steps before a bucket's throughput is trusted

    def __post_init__(self) -> None:
        if not 0 < self.fraction <= 1 or self.memory < 1 or self.min_steps <= 0:
            raise ValueError("need 0 < fraction <= 1, memory >= 1, min_steps > 0")


class DecodeThroughput:
    """Decode throughput by batch size and the saturation point (see the module contract)."""

    __slots__ = ("_seconds", "_seqs", "_steps", "settings")

    def __init__(self, settings: SaturationSettings | None = None) -> None:
        self.settings = settings or SaturationSettings()
        self._steps: list[float] = []  # per bucket: decayed step count
        self._seqs: list[float] = []  # decayed sum of batch sizes
        self._seconds: list[float] = []  # decayed sum of step seconds

    def record(self, num_seqs: int, seconds: float) -> None:
        if num_seqs < 1 or not seconds > 0:
            return
        bucket = num_seqs.bit_length() - 1
        while len(self._steps) <= bucket:
            self._steps.append(0.0)
            self._seqs.append(0.0)
            self._seconds.append(0.0)
        keep = 1.0 - 1.0 / self.settings.memory
        self._steps[bucket] = self._steps[bucket] * keep + 1.0
        self._seqs[bucket] = self._seqs[bucket] * keep + num_seqs
        self._seconds[bucket] = self._seconds[bucket] * keep + seconds

    def throughput(self) -> dict[int, float]:
        """Sequences per second of step time for each known bucket, by its smallest batch size."""
        least = self.settings.min_steps
        return {
            1 << b: self._seqs[b] / self._seconds[b]
            for b, steps in enumerate(self._steps)
            if steps >= least
        }

    def saturation_seqs(self) -> int | None:
        known = [b for b, steps in enumerate(self._steps) if steps >= self.settings.min_steps]
        if len(known) < 2:
            return None
        rates = {b: self._seqs[b] / self._seconds[b] for b in known}
        enough = self.settings.fraction * max(rates.values())
        knee = next(b for b in known if rates[b] >= enough)
        if knee == known[-1]:
            return None  # still growing as far as it was seen
        return math.ceil(self._seqs[knee] / self._steps[knee])
