"""Per-tenant rate limits: requests and tokens per minute, as token buckets.

Contract:
- Pure (explicit `now`, seconds). A limit of N a minute is a bucket of N that refills at N/60 a
  second and starts full. `RateLimits(rpm, tpm)`: None is no limit of that kind.
- `admit(now, tenant)` takes one request (rpm); `reserve(now, tenant, tokens)` takes a request's
  tokens (tpm): its prompt plus its ``max_tokens``, or `DEFAULT_OUTPUT_RESERVE` when it names none
  (`token_cost`). Each takes only what the bucket holds, else returns the refusal (`Exceeded`: the
  kind, seconds until it would fit; ``never`` for more tokens than the whole limit).
- `settle(now, tenant, reserved, used)` at completion: the reservation minus the real count
  goes back, or what was used beyond it is owed (the level goes below zero: a request admitted on
  the default reserve is the one that may overdraw). `give_back` returns what a request took when
  nothing of it was served. `set_limits` changes a tenant's at run time: what it used in the last
  minute still counts; None lifts a limit.
- `status(now, tenant)`: each limit's (limit, remaining, seconds until full again); a tenant
  without limits costs one dict lookup everywhere.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

DEFAULT_OUTPUT_RESERVE = 256  # output tokens reserved for a request that names no max_tokens
REQUESTS, TOKENS = "requests", "tokens"


@dataclass(frozen=True, slots=True)
class RateLimits:
    rpm: int | None = None  # requests per minute
    tpm: int | None = None  # tokens per minute (prompt and output)

    def __post_init__(self) -> None:
        for value in (self.rpm, self.tpm):
            if value is not None and (type(value) is not int or value <= 0):
                raise ValueError("rate limits must be positive integers (or none)")

    @property
    def any(self) -> bool:
        return self.rpm is not None or self.tpm is not None


@dataclass(frozen=True, slots=True)
class Exceeded:
    kind: str  # REQUESTS or TOKENS
    wait_s: float  # until the request would fit (math.inf: never)

    @property
    def never(self) -> bool:
        return self.wait_s == math.inf


@dataclass(frozen=True, slots=True)
class LimitStatus:
    limit: int
    remaining: int
    reset_s: float  # until the bucket is full again


class TokenBucket:
    """``capacity`` units refilled over a minute; the level may be owed below zero."""

    __slots__ = ("capacity", "level", "updated")

    def __init__(self, capacity: int, now: float) -> None:
        self.capacity = capacity
        self.level = float(capacity)
        self.updated = now

    def _refill(self, now: float) -> None:
        if now > self.updated:
            self.level = min(
                self.capacity, self.level + (now - self.updated) * self.capacity / 60.0
            )
            self.updated = now

    def take(self, now: float, amount: float) -> float:
        """0.0 when `amount` was taken, else the seconds until it would be there."""
        self._refill(now)
        if amount <= self.level:
            self.level -= amount
            return 0.0
        if amount > self.capacity:
            return math.inf
        return (amount - self.level) * 60.0 / self.capacity

    def put(self, now: float, amount: float) -> None:
        """`amount` back (negative: owed), never above the capacity."""
        self._refill(now)
        self.level = min(self.capacity, self.level + amount)

    def resize(self, now: float, capacity: int) -> None:
        self._refill(now)
        self.level = capacity - (self.capacity - self.level)
        self.capacity = capacity

    def status(self, now: float) -> LimitStatus:
        self._refill(now)
        remaining = max(0, math.floor(self.level))
        return LimitStatus(
            self.capacity, remaining, (self.capacity - self.level) * 60.0 / self.capacity
        )


def token_cost(prompt_tokens: int, max_tokens: int | None) -> int:
    """The tokens reserved at admission for a request."""
    output = max_tokens if max_tokens is not None and max_tokens > 0 else DEFAULT_OUTPUT_RESERVE
    return prompt_tokens + output


class RateLimiter:
    """Tenants' request and token buckets (see the module contract)."""

    __slots__ = ("_buckets", "_limits")

    def __init__(self) -> None:
        self._limits: dict[str, RateLimits] = {}
        self._buckets: dict[str, tuple[TokenBucket | None, TokenBucket | None]] = {}

    def limits(self, tenant: str | None) -> RateLimits | None:
        return None if tenant is None else self._limits.get(tenant)

    def set_limits(self, now: float, tenant: str, limits: RateLimits) -> None:
        old = self._buckets.pop(tenant, (None, None))
        self._limits.pop(tenant, None)
        if not limits.any:
            return
        self._limits[tenant] = limits
        self._buckets[tenant] = (
            _resized(old[0], limits.rpm, now),
            _resized(old[1], limits.tpm, now),
        )

    def admit(self, now: float, tenant: str) -> Exceeded | None:
        bucket = self._buckets[tenant][0] if tenant in self._buckets else None
        if bucket is None:
            return None
        wait = bucket.take(now, 1)
        return Exceeded(REQUESTS, wait) if wait else None

    def reserve(self, now: float, tenant: str, tokens: int) -> Exceeded | None:
        bucket = self._buckets[tenant][1] if tenant in self._buckets else None
        if bucket is None:
            return None
        wait = bucket.take(now, tokens)
        return Exceeded(TOKENS, wait) if wait else None

    def settle(self, now: float, tenant: str, reserved: int, used: int) -> None:
        bucket = self._buckets[tenant][1] if tenant in self._buckets else None
        if bucket is not None and used != reserved:
            bucket.put(now, reserved - used)

    def give_back(self, now: float, tenant: str, request: bool, tokens: int) -> None:
        requests, token_bucket = self._buckets.get(tenant, (None, None))
        if request and requests is not None:
            requests.put(now, 1)
        if tokens and token_bucket is not None:
            token_bucket.put(now, tokens)

    def status(self, now: float, tenant: str) -> dict[str, LimitStatus]:
        requests, tokens = self._buckets.get(tenant, (None, None))
        out: dict[str, LimitStatus] = {}
        if requests is not None:
            out[REQUESTS] = requests.status(now)
        if tokens is not None:
            out[TOKENS] = tokens.status(now)
        return out


def _resized(bucket: TokenBucket | None, capacity: int | None, now: float) -> TokenBucket | None:
    if capacity is None:
        return None
    if bucket is None:
        return TokenBucket(capacity, now)
    bucket.resize(now, capacity)
    return bucket
