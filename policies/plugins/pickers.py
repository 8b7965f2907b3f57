"""Pipeline pickers: turn summed scores into one instance.

Contract: ``pick(scores, rng) -> instance_id`` given a non-empty ``{instance_id: total score}``;
all randomness comes from the pipeline's seeded `rng`. Ids are visited in sorted order so the choice
depends only on the scores and the seed, never on dict insertion order.
"""

from __future__ import annotations

import random
from collections.abc import Mapping


class MaxScorePicker:
    """`max-score-picker`: the highest total score; ties broken at random (as llm-d does)."""

    type_name = "max-score-picker"

    def pick(self, scores: Mapping[str, float], rng: random.Random) -> str:
        best = max(scores.values())
        tied = sorted(key for key, value in scores.items() if value == best)
        return tied[0] if len(tied) == 1 else rng.choice(tied)


class RandomPicker:
    """`random-picker`: any candidate, uniformly (ignores scores; filters still apply)."""

    type_name = "random-picker"

    def pick(self, scores: Mapping[str, float], rng: random.Random) -> str:
        return rng.choice(sorted(scores))


class WeightedRandomPicker:
    """`weighted-random-picker`: probability proportional to score (uniform if all are 0)."""

    type_name = "weighted-random-picker"

    def pick(self, scores: Mapping[str, float], rng: random.Random) -> str:
        keys = sorted(scores)
        weights = [max(0.0, scores[k]) for k in keys]
        if sum(weights) <= 0.0:
            return rng.choice(keys)
        return rng.choices(keys, weights=weights, k=1)[0]
