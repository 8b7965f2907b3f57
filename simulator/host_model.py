"""The host a simulated fleet runs on: what the request path and co-located instances add.

A latency model times an engine step on its own; a real fleet also pays for the path from the
client through the proxy to the engine, for waking idle processes, and, where instances share a
host's cores, for its neighbours' work. `HostModel` holds those knobs and applies them, beside the
latency models, as one object from the profile file or the command line to the simulated fleet.

Contract:
- `HostModel` (frozen; seconds; all zero, the default, is a host that adds nothing):
  ``request_overhead_s`` (client -> proxy -> agent until the engine holds the request),
  ``request_overhead_per_busy_s`` (more per other instance busy at the arrival),
  ``request_overhead_idle`` ((idle s, extra s) points, idle times strictly ascending from 0: a
  piecewise-linear function, flat past its ends, of how long the whole fleet has been idle at the
  arrival; hosts that park idle CPUs take longer to wake an idle serving path),
  ``request_overhead_spread`` (quantiles, ascending and evenly spaced from the least to the
  greatest, of the path's deviation from its typical time: a real path varies from request to
  request) and ``step_slowdown_per_busy`` (each engine step stretches by this fraction per other
  instance busy at its start). Invalid knobs raise `HostModelError` naming the knob.
- `path_draws(count, seed)`: each request's draw from the spread (inverse-CDF, linear between the
  quantiles), seeded and tied to the request's place in the trace so every policy's run sees the
  same path times; empty without a spread.
- `request_overhead(path_draw, busy_others, fleet_idle_s)`: one request's path time. The fleet's
  facts are callables, read only when a knob needs them (counting busy instances walks the
  fleet). It may be negative: the caller delays by nothing then.
- `step_stretch(busy_others)`: the factor on a step's time; `times_steps_by_fleet`: whether a
  step's time depends on the fleet at its start (then no step may be planned ahead).
- The profile file's ``host`` section (`kvherd.profile_format`: `HOST_SECTION`, keys
  `HOST_KNOBS`, the field names): `from_profile` / `from_file` read it (absent: the default
  host; unknown keys and bad values are refused with the file and key named), `profile_section`
  writes it, so `HostModel.from_profile({"format": ..., "host": h.profile_section()}) == h`.
"""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from kvherd.profile_format import HOST_KNOBS, HOST_SECTION, PROFILE_FORMATS


class HostModelError(ValueError):
    """A host-model knob (or the profile section holding them) is invalid."""

    def __init__(self, knob: str, problem: str) -> None:
        super().__init__(f"{knob} {problem}")
        self.knob = knob
        self.problem = problem


@dataclass(frozen=True, slots=True)
class HostModel:
    request_overhead_s: float = 0.0
    request_overhead_per_busy_s: float = 0.0
    request_overhead_idle: tuple[tuple[float, float], ...] = ()
    request_overhead_spread: tuple[float, ...] = ()
    step_slowdown_per_busy: float = 0.0
    # `request_overhead_idle` as (idle times, extras), for np.interp at each arrival.
    _idle_curve: tuple[tuple[float, ...], tuple[float, ...]] = field(
        init=False, repr=False, compare=False
    )

    def __post_init__(self) -> None:
        for knob in ("request_overhead_s", "request_overhead_per_busy_s", "step_slowdown_per_busy"):
            value = getattr(self, knob)
            if not (math.isfinite(value) and value >= 0):  # NaN fails too
                raise HostModelError(knob, "must be a non-negative number")
        idle = self.request_overhead_idle
        if not all(map(math.isfinite, itertools.chain(*idle))) or any(
            len(point) != 2 for point in idle
        ):
            raise HostModelError("request_overhead_idle", "must be (idle s, extra s) points")
        if (idle and idle[0][0] < 0) or any(b[0] <= a[0] for a, b in itertools.pairwise(idle)):
            raise HostModelError(
                "request_overhead_idle", "must have idle times >= 0, strictly ascending"
            )
        spread = self.request_overhead_spread
        if not all(map(math.isfinite, spread)):
            raise HostModelError("request_overhead_spread", "must be finite numbers")
        if spread and (len(spread) < 2 or any(b < a for a, b in itertools.pairwise(spread))):
            raise HostModelError(
                "request_overhead_spread", "must be at least two quantiles, ascending"
            )
        curve = (tuple(i for i, _ in idle), tuple(e for _, e in idle))
        object.__setattr__(self, "_idle_curve", curve)

    # -- applying it -----------------------------------------------------------------------------
    def path_draws(self, count: int, seed: int) -> list[float]:
        """Per request (in trace order) its draw from the spread; empty without one."""
        spread = self.request_overhead_spread
        if not spread:
            return []
        uniform = np.random.default_rng(seed).random(count)
        draws: list[float] = np.interp(uniform, np.linspace(0.0, 1.0, len(spread)), spread).tolist()
        return draws

    def request_overhead(
        self,
        path_draw: float,
        busy_others: Callable[[], int],
        fleet_idle_s: Callable[[], float],
    ) -> float:
        """One request's path time: `path_draw` (from `path_draws`), `busy_others()` other
        instances busy at its arrival, the fleet idle for `fleet_idle_s()` (0 while any instance
        runs a step)."""
        overhead = self.request_overhead_s + path_draw
        if self.request_overhead_per_busy_s > 0:
            overhead += self.request_overhead_per_busy_s * busy_others()
        if self.request_overhead_idle:
            idles, extras = self._idle_curve
            overhead += float(np.interp(fleet_idle_s(), idles, extras))  # flat past the ends
        return overhead

    def step_stretch(self, busy_others: Callable[[], int]) -> float:
        """The factor on a step's time with `busy_others()` other instances busy at its start."""
        slowdown = self.step_slowdown_per_busy
        return 1.0 + slowdown * busy_others() if slowdown else 1.0

    @property
    def times_steps_by_fleet(self) -> bool:
        return self.step_slowdown_per_busy > 0

    # -- the profile file's host section ---------------------------------------------------------
    def profile_section(self) -> dict[str, Any]:
        return {
            "request_overhead_s": self.request_overhead_s,
            "request_overhead_per_busy_s": self.request_overhead_per_busy_s,
            "request_overhead_idle": [list(point) for point in self.request_overhead_idle],
            "request_overhead_spread": list(self.request_overhead_spread),
            "step_slowdown_per_busy": self.step_slowdown_per_busy,
        }

    @classmethod
    def from_profile(cls, profile: dict[str, Any], source: str = "profile") -> HostModel:
        if profile.get("format") not in PROFILE_FORMATS:
            raise HostModelError(
                f"{source}:",
                f"is not a kvherd profile (format {profile.get('format')!r}, expected one of "
                f"{PROFILE_FORMATS})",
            )
        section = profile.get(HOST_SECTION, {})
        where = f"{source}: {HOST_SECTION}"
        if not isinstance(section, dict):
            raise HostModelError(where, "must be an object")
        unknown = sorted(set(section) - set(HOST_KNOBS))
        if unknown:
            raise HostModelError(where, f"has unknown keys {unknown} (known: {list(HOST_KNOBS)})")

        def number(value: Any, knob: str) -> float:
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise HostModelError(f"{where}.{knob}", f"must be a number, got {value!r}")
            return float(value)

        def numbers(value: Any, knob: str) -> list[Any]:
            if not isinstance(value, list):
                raise HostModelError(f"{where}.{knob}", f"must be a list, got {value!r}")
            return value

        knobs: dict[str, Any] = {}
        for knob in ("request_overhead_s", "request_overhead_per_busy_s", "step_slowdown_per_busy"):
            if knob in section:
                knobs[knob] = number(section[knob], knob)
        if "request_overhead_idle" in section:
            knob = "request_overhead_idle"
            points = [numbers(point, knob) for point in numbers(section[knob], knob)]
            knobs[knob] = tuple(tuple(number(v, knob) for v in point) for point in points)
        if "request_overhead_spread" in section:
            knob = "request_overhead_spread"
            knobs[knob] = tuple(number(v, knob) for v in numbers(section[knob], knob))
        try:
            return cls(**knobs)
        except HostModelError as exc:
            raise HostModelError(f"{where}.{exc.knob}", exc.problem) from None

    @classmethod
    def from_file(cls, path: str | Path) -> HostModel:
        p = Path(path)
        try:
            data = json.loads(p.read_text())
        except FileNotFoundError:
            raise HostModelError(f"profile {p}", "not found") from None
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise HostModelError(f"profile {p}", f"is not readable JSON: {exc}") from None
        if not isinstance(data, dict):
            raise HostModelError(f"profile {p}", "must hold a JSON object")
        return cls.from_profile(data, str(p))
