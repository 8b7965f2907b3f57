"""A TTFT model per instance, learned online from the first tokens the fleet sees.

Contract:
- At dispatch the router records what the chosen instance faced (`dispatched`): the request's
  uncached prompt tokens, the prefill tokens queued ahead of it and the requests running there.
  `first_token` at the request's first token observes its TTFT; `discard` drops a request that
  ended (or moved) before one. Each dispatch is observed at most once.
- TTFT = w . (1, uncached k-tokens, queued k-tokens, running, (uncached + queued) k-tokens x
  running, host_requests): a step runs the prefill chunks beside the running decodes, so the
  prefill's steps each cost more with more requests running; `host_requests` counts the requests
  on the other instances of the instance's host, which share its CPU (frontends, tokenizers,
  schedulers; all of it for CPU engines). w >= 0 is the non-negative least-squares
  fit of the instance's last `window` observations, refitted every `refit_every` observations.
- `predict(instance, ...)` uses the instance's fit once it has `min_samples`, else the fleet's
  (every instance's observations), else None (nothing learned yet).
- `quality(instance)`: effective samples, R^2 of the fit and the mean relative error of the
  predictions made at dispatch, before their TTFT was seen (the honest figure), for metrics.
Pure: times are arguments; the proxy and the simulator drive the same object (through `Router`).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import numpy as np

TERMS = ("base", "uncached", "queued", "running", "prefill_x_running", "host_requests")
_N = len(TERMS)
_RIDGE = 1e-9  # keeps the normal equations solvable when a term never varied


def features(
    uncached_tokens: float, queued_tokens: float, running: float, host_requests: float = 0.0
) -> tuple[float, ...]:
    """The model's terms for one dispatch (see the module docstring)."""
    u = uncached_tokens / 1000.0
    q = queued_tokens / 1000.0
    return (1.0, u, q, float(running), (u + q) * running, float(host_requests))


@dataclass(frozen=True, slots=True)
class TtftSettings:
    window: int = 256  # observations a fit remembers (its last ones)
    min_samples: int = 16  # observations before a fit predicts
    refit_every: int = 16

    def __post_init__(self) -> None:
        if self.window < 2 or not 1 <= self.min_samples <= self.window or self.refit_every < 1:
            raise ValueError("TTFT model needs window >= 2, 1 <= min_samples <= window, refit >= 1")


@dataclass(frozen=True, slots=True)
class Quality:
    samples: int  # observations the fit remembers
    r2: float  # of the current fit over them (0 before a fit)
    error_ratio: float  # mean |predicted - observed| / observed of their dispatch-time predictions
    predicted: int  # of them, those that had a prediction at dispatch


class _Fit:
    """One instance's (or the fleet's) last observations, a ring, and the weights fitted to them."""

    __slots__ = ("coef", "count", "errors", "r2", "since", "x", "y")

    def __init__(self, window: int) -> None:
        self.x = np.zeros((window, _N))
        self.y = np.zeros(window)
        self.count = 0  # observations ever added (the ring's next row is count % window)
        self.errors: deque[float] = deque(maxlen=window)  # of dispatch-time predictions
        self.since = 0  # observations since the last fit
        self.coef: tuple[float, ...] | None = None
        self.r2 = 0.0

    @property
    def samples(self) -> int:
        return min(self.count, len(self.y))

    def add(self, x: tuple[float, ...], ttft: float, predicted: float | None) -> None:
        row = self.count % len(self.y)
        self.x[row] = x
        self.y[row] = ttft
        self.count += 1
        if predicted is not None:
            self.errors.append(abs(predicted - ttft) / max(ttft, 1e-3))
        self.since += 1

    def refit(self) -> None:
        self.since = 0
        n = self.samples
        x, y = self.x[:n], self.y[:n]
        gram = x.T @ x
        gram += _RIDGE * (np.trace(gram) + 1.0) * np.eye(_N)
        w = nnls(gram, x.T @ y)
        self.coef = tuple(w.tolist())
        total = float(np.var(y)) * n
        residual = float(np.square(y - x @ w).sum())
        self.r2 = 1.0 - residual / total if total > 0.0 else 0.0


def nnls(gram: np.ndarray, xy: np.ndarray) -> np.ndarray:
    """argmin ||Xw - y||^2 over w >= 0, from X'X and X'y (Lawson and Hanson's active set)."""
    n = len(xy)
    w = np.linalg.solve(gram, xy)
    if (w >= 0).all():  # the usual case: least squares is already non-negative
        return w
    w = np.zeros(n)
    passive = np.zeros(n, dtype=bool)
    tol = 1e-12 * (np.abs(xy).max() + 1.0)
    for _ in range(4 * n):
        grad = xy - gram @ w
        grad[passive] = -np.inf
        j = int(np.argmax(grad))
        if grad[j] <= tol:
            break
        passive[j] = True
        while True:
            s = np.zeros(n)
            s[passive] = np.linalg.solve(gram[np.ix_(passive, passive)], xy[passive])
            if (s[passive] > 0).all():
                w = s
                break
            shrinking = passive & (s <= 0)
            alpha = float(np.min(w[shrinking] / (w[shrinking] - s[shrinking])))
            w = w + alpha * (s - w)
            passive &= w > tol
            w[~passive] = 0.0
    return w


def _dot(coef: tuple[float, ...], x: tuple[float, ...]) -> float:
    return (
        coef[0] + coef[1] * x[1] + coef[2] * x[2] + coef[3] * x[3] + coef[4] * x[4]
        + coef[5] * x[5]
    )  # fmt: skip


@dataclass(slots=True)
class _Pending:
    instance_id: str
    x: tuple[float, ...]
    dispatched_at: float
    predicted: float | None


@dataclass
class TtftModel:
    settings: TtftSettings = field(default_factory=TtftSettings)
    _fits: dict[str, _Fit] = field(default_factory=dict)
    _pending: dict[str, _Pending] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._fleet = _Fit(self.settings.window)

    def coefficients(self, instance_id: str) -> tuple[float, ...] | None:
        """The weights `predict` uses for `instance_id` (its own, else the fleet's, else None)."""
        fit = self._fits.get(instance_id)
        if fit is not None and fit.coef is not None:
            return fit.coef
        return self._fleet.coef
        return None

    def fitted(self, instance_id: str | None) -> tuple[float, ...] | None:
        """`instance_id`'s own weights (None: the fleet's), None before its first fit."""
        fit = self._fleet if instance_id is None else self._fits.get(instance_id)
        return None if fit is None else fit.coef

    def predict(
        self,
        instance_id: str,
        uncached_tokens: float,
        queued_tokens: float,
        running: float,
        host_requests: float = 0.0,
    ) -> float | None:
        """Predicted TTFT in seconds on `instance_id` (None: nothing learned yet)."""
        coef = self.coefficients(instance_id)
        if coef is None:
            return None
        return _dot(coef, features(uncached_tokens, queued_tokens, running, host_requests))

    def dispatched(
        self,
        request_id: str,
        instance_id: str,
        uncached_tokens: int,
        queued_tokens: int,
        running: int,
        host_requests: int,
        now: float,
    ) -> None:
        x = features(uncached_tokens, queued_tokens, running, host_requests)
        coef = self.coefficients(instance_id)
        predicted = None if coef is None else _dot(coef, x)
        self._pending[request_id] = _Pending(instance_id, x, now, predicted)

    def discard(self, request_id: str) -> None:
        self._pending.pop(request_id, None)

    def first_token(self, request_id: str, now: float) -> float | None:
        """Observe the request's TTFT (returned; None when it was not pending)."""
        pending = self._pending.pop(request_id, None)
        if pending is None:
            return None
        ttft = max(0.0, now - pending.dispatched_at)
        fit = self._fits.get(pending.instance_id)
        if fit is None:
            fit = self._fits[pending.instance_id] = _Fit(self.settings.window)
        for f in (fit, self._fleet):
            f.add(pending.x, ttft, pending.predicted)
            if f.samples >= self.settings.min_samples and (
                f.coef is None or f.since >= self.settings.refit_every
            ):
                f.refit()
        return ttft

    def quality(self, instance_id: str | None = None) -> Quality:
        """Fit quality of `instance_id`'s model (None: the fleet's)."""
        fit = self._fleet if instance_id is None else self._fits.get(instance_id)
        if fit is None:
            return Quality(0, 0.0, 0.0, 0)
        errors = fit.errors
        error = sum(errors) / len(errors) if errors else 0.0
        return Quality(fit.samples, fit.r2, error, len(errors))

    def instances(self) -> list[str]:
        """The instances with observations."""
        return list(self._fits)

    def remove_instance(self, instance_id: str) -> None:
        """An instance left: its fit and pending dispatches go (the fleet's fit keeps them)."""
        self._fits.pop(instance_id, None)
        for key in [k for k, p in self._pending.items() if p.instance_id == instance_id]:
            del self._pending[key]
