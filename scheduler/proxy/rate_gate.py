"""Tenants' rate limits on the proxy's clock: 429s with OpenAI's ``x-ratelimit-*`` headers.

Contract:
- `RateGate(tenants)` starts each tenant's limits from its keys-file options (``rpm=``, ``tpm=``,
  `scheduler.core.rate_limit`); `set_limits` and `describe` serve the admin API.
- `admit(tenant)`: a `Lease` holding one request for a limited tenant, None for one without
  limits (one dict lookup); `Refused` (429, ``rate_limit_requests``) when its rpm is spent.
  `Lease.reserve(prompt_tokens, max_tokens)` takes the request's tokens (``rate_limit_tokens``;
  ``request_too_large``, without ``Retry-After``, for more than the whole tpm).
- Exactly one of `Lease.settle(output_tokens)` (the real count corrects the reservation; None:
  not known, the reservation stands) or `Lease.give_back()` (nothing of it was served).
- A refusal carries ``Retry-After`` (whole seconds) and the ``x-ratelimit-{limit,remaining,reset}-
  {requests,tokens}`` headers of the tenant's limits (reset as OpenAI writes it: ``1s``, ``6m0s``,
  ``20ms``); `Lease.headers()` are those a limited tenant's successful response carries.
"""

from __future__ import annotations

import math
import time
from typing import Any

from scheduler.core.rate_limit import (
    REQUESTS,
    Exceeded,
    LimitStatus,
    RateLimiter,
    RateLimits,
    token_cost,
)
from scheduler.core.tenancy import TenantRegistry
from scheduler.metrics import ProxyMetrics
from scheduler.proxy.admission_gate import Refused


class Lease:
    """What one limited tenant's request holds of its buckets."""

    __slots__ = ("_done", "_gate", "prompt_tokens", "tenant", "tokens")

    def __init__(self, gate: RateGate, tenant: str) -> None:
        self._gate = gate
        self.tenant = tenant
        self.tokens = 0  # reserved
        self.prompt_tokens = 0
        self._done = False

    def reserve(self, prompt_tokens: int, max_tokens: int | None) -> None:
        cost = token_cost(prompt_tokens, max_tokens)
        gate = self._gate
        exceeded = gate.limiter.reserve(time.monotonic(), self.tenant, cost)
        if exceeded is not None:
            self.give_back()
            raise gate.refusal(self.tenant, exceeded, cost)
        self.tokens = cost
        self.prompt_tokens = prompt_tokens

    def settle(self, output_tokens: int | None) -> None:
        if self._done:
            return
        self._done = True
        if output_tokens is not None and self.tokens:
            used = self.prompt_tokens + output_tokens
            self._gate.limiter.settle(time.monotonic(), self.tenant, self.tokens, used)

    def give_back(self) -> None:
        if self._done:
            return
        self._done = True
        self._gate.limiter.give_back(time.monotonic(), self.tenant, True, self.tokens)

    def headers(self) -> list[tuple[bytes, bytes]]:
        return _headers(self._gate.limiter.status(time.monotonic(), self.tenant))


class RateGate:
    def __init__(self, tenants: TenantRegistry, metrics: ProxyMetrics) -> None:
        self.limiter = RateLimiter()
        self.tenants = tenants
        self.metrics = metrics
        now = time.monotonic()
        for name, tenant in tenants.tenants.items():
            self.limiter.set_limits(now, name, tenant.options.limits)

    def admit(self, tenant: str | None) -> Lease | None:
        limiter = self.limiter
        if limiter.limits(tenant) is None:
            return None
        assert tenant is not None
        exceeded = limiter.admit(time.monotonic(), tenant)
        if exceeded is not None:
            raise self.refusal(tenant, exceeded, 1)
        return Lease(self, tenant)

    def refusal(self, tenant: str, exceeded: Exceeded, asked: int) -> Refused:
        headers = _headers(self.limiter.status(time.monotonic(), tenant))
        limits = self.limiter.limits(tenant) or RateLimits()
        if exceeded.never:
            self.metrics.rejected("request_too_large")
            return Refused(
                f"request too large for tenant {tenant!r}: tokens per minute (TPM) limit "
                f"{limits.tpm}, requested {asked} (prompt plus max_tokens)",
                "request_too_large",
                None,
                headers,
            )
        kind = exceeded.kind
        code = f"rate_limit_{kind}"
        self.metrics.rejected(code)
        limit = limits.rpm if kind == REQUESTS else limits.tpm
        unit = "requests per minute (RPM)" if kind == REQUESTS else "tokens per minute (TPM)"
        return Refused(
            f"rate limit reached for tenant {tenant!r} on {unit}: limit {limit}, requested "
            f"{asked}; try again in {_duration(exceeded.wait_s)}",
            code,
            max(1, math.ceil(exceeded.wait_s)),
            headers,
        )

    def set_limits(self, tenant: str, limits: RateLimits) -> None:
        self.limiter.set_limits(time.monotonic(), tenant, limits)

    def describe(self) -> list[dict[str, Any]]:
        """Every tenant's limits and what remains of them (the admin API)."""
        now = time.monotonic()
        out = []
        for name in sorted(self.tenants.tenants):
            limits = self.limiter.limits(name) or RateLimits()
            status = self.limiter.status(now, name)
            out.append(
                {
                    "tenant": name,
                    "rpm": limits.rpm,
                    "tpm": limits.tpm,
                    "remaining": {
                        kind: {"remaining": s.remaining, "reset_s": round(s.reset_s, 3)}
                        for kind, s in status.items()
                    },
                }
            )
        return out


def _headers(status: dict[str, LimitStatus]) -> list[tuple[bytes, bytes]]:
    headers = []
    for kind, s in status.items():
        name = kind.encode()
        headers += [
            (b"x-ratelimit-limit-" + name, b"%d" % s.limit),
            (b"x-ratelimit-remaining-" + name, b"%d" % s.remaining),
            (b"x-ratelimit-reset-" + name, _duration(s.reset_s).encode()),
        ]
    return headers


def _duration(seconds: float) -> str:
    """As OpenAI writes its reset times: ``20ms``, ``1.5s``, ``6m0s``."""
    if seconds < 1:
        return f"{max(0, math.ceil(seconds * 1000))}ms"
    minutes, rest = divmod(seconds, 60)
    text = f"{rest:.3f}".rstrip("0").rstrip(".") + "s"
    return f"{int(minutes)}m{text}" if minutes else text
