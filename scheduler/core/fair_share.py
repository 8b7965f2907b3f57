"""Each tenant's share of the admitted work: who is over its share when the fleet is overloaded.

Contract:
- Pure, no clock. `admitted(tenant)` when admission lets a request in (it then waits or runs);
  `finished(tenant)` exactly once when it ended, served, refused later or failed.
- `within_share(tenant)`: another tenant has work admitted and this one's, one more request
  included, is at most its weighted share of the whole (``weight / sum of the active tenants'
  weights``, weights from the keys file). Admission then does not refuse it by expected wait: the
  fair queue serves it before those over their share, so its wait is theirs to pay. Alone, or over
  its share, a tenant meets the ordinary expected-wait rule, so overload stays bounded (two
  flooders alternate below and above their halves, and each is refused above).
- `may_start(tenant, free, slots)`: whether it may take one of the `free` in-flight slots of
  `slots` now. Idle share is lent: a tenant over its share takes free slots too, but not the last
  ``reserve`` of them (`reserve` x `slots`, at least one) while another tenant has work in; those
  start the next request of a tenant within its share at once instead of after a completion.
- No tenant (None: tenancy off) is never within a share, and may always start.
"""

from __future__ import annotations

import math
from collections.abc import Callable


class TenantShares:
    __slots__ = ("_active", "_total", "_weight", "reserve")

    def __init__(
        self, weight: Callable[[str | None], float] | None = None, reserve: float = 0.1
    ) -> None:
        if not 0 <= reserve < 1:
            raise ValueError("the reserved fraction of slots must be in [0, 1)")
        self._weight = weight or (lambda _: 1.0)
        self.reserve = reserve
        self._active: dict[str, int] = {}  # tenant -> requests admitted and not finished
        self._total = 0

    def active(self, tenant: str) -> int:
        return self._active.get(tenant, 0)

    def admitted(self, tenant: str | None) -> None:
        if tenant is not None:
            self._active[tenant] = self._active.get(tenant, 0) + 1
            self._total += 1

    def finished(self, tenant: str | None) -> None:
        if tenant is None or tenant not in self._active:
            return
        self._total -= 1
        left = self._active[tenant] - 1
        if left:
            self._active[tenant] = left
        else:
            del self._active[tenant]

    def within_share(self, tenant: str | None) -> bool:
        if tenant is None:
            return False
        mine = self._active.get(tenant, 0)
        if self._total - mine <= 0:
            return False  # alone: no one else's share to protect
        weight = self._weight
        total_weight = sum(weight(t) for t in self._active) + (0 if mine else weight(tenant))
        return mine + 1 <= weight(tenant) / total_weight * (self._total + 1)

    def may_start(self, tenant: str | None, free: int, slots: int) -> bool:
        if tenant is None or self._total - self._active.get(tenant, 0) <= 0:
            return True
        if self.within_share(tenant):
            return True
        reserve = max(1, math.ceil(self.reserve * slots)) if self.reserve else 0
        return free > reserve
