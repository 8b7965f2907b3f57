"""The door on the proxy's clock: a flood's refusals answered from the request head.

Contract:
- `DoorGate(tenants, admission, metrics)` keys requests as admission tells them apart: the tenant
  of the ``Authorization`` header and the priority class (``X-Kvherd-Priority``, else the
  tenant's default), read from the head alone: no body parse, no tokenization, no task.
- `refusal(headers)`: None to let the request through to the full path, else the 429 to send
  (headers and body: the OpenAI error object, ``code`` the last admission refusal's, and its
  ``Retry-After``) while the key sheds (`scheduler.core.door`) or the admission queue is full.
  A head the full path would refuse otherwise (a bad key, a bad priority) is let through.
- `admitted(tenant, priority)` and `refused(tenant, priority, exc)` feed admission's decisions
  (the codes of `ADMISSION_CODES`) back to the door.
- Door refusals count as ``kvherd_rejected_total{reason="door"}`` and as 429 requests.
"""

from __future__ import annotations

import time

import orjson

from kvherd.wire import OpenAIError
from scheduler.core.door import Door, DoorSettings, Key, Shed
from scheduler.core.tenancy import TenantRegistry
from scheduler.metrics import ProxyMetrics
from scheduler.proxy.admission_gate import AdmissionGate, Refused
from scheduler.proxy.routed_request import parse_priority_header, resolve_priority

ADMISSION_CODES = frozenset({"queue_wait", "queue_full", "queue_timeout"})


class DoorGate:
    def __init__(
        self,
        tenants: TenantRegistry,
        admission: AdmissionGate,
        metrics: ProxyMetrics,
        settings: DoorSettings | None = None,
    ) -> None:
        self.door = Door(settings)
        self.tenants = tenants
        self.admission = admission
        self.metrics = metrics
        self._answers: dict[Shed, tuple[list[tuple[bytes, bytes]], bytes]] = {}

    def _key(self, headers: list[tuple[bytes, bytes]]) -> Key | None:
        auth = priority = None
        for name, value in headers:
            if name == b"authorization":
                auth = value
            elif name == b"x-kvherd-priority":
                priority = value
        tenant = None
        if self.tenants.enabled:
            tenant = self.tenants.authenticate(auth)
            if tenant is None:
                return None  # 401 from the full path
        if priority is None:
            return None if tenant is None else tenant.name, resolve_priority(None, tenant)
        try:
            asked = parse_priority_header(priority)
        except OpenAIError:  # 400 from the full path
            return None
        return None if tenant is None else tenant.name, resolve_priority(asked, tenant)

    def refusal(
        self, headers: list[tuple[bytes, bytes]]
    ) -> tuple[list[tuple[bytes, bytes]], bytes] | None:
        key = self._key(headers)
        if key is None:
            return None
        queue = self.admission.queue
        shed = self.door.check(time.monotonic(), key, len(queue) >= queue.settings.size)
        if shed is None:
            return None
        self.metrics.rejected("door")
        self.metrics.request_done(429)
        answer = self._answers.get(shed)
        if answer is None:
            if len(self._answers) > 64:
                self._answers.clear()
            answer = self._answers[shed] = _answer(shed)
        return answer

    def admitted(self, tenant: str | None, priority: int) -> None:
        self.door.outcome(time.monotonic(), (tenant, priority), None)

    def refused(self, tenant: str | None, priority: int, exc: Refused) -> None:
        if exc.code in ADMISSION_CODES:
            shed = Shed(exc.code, exc.retry_after_s or 1)
            self.door.outcome(time.monotonic(), (tenant, priority), shed)


def _answer(shed: Shed) -> tuple[list[tuple[bytes, bytes]], bytes]:
    body = orjson.dumps(
        {
            "error": {
                "message": "the fleet is overloaded: admission is refusing most requests like "
                f"this one; retry after {shed.retry_after_s}s",
                "type": "rate_limit_error",
                "param": None,
                "code": shed.code,
            }
        }
    )
    headers = [(b"content-type", b"application/json"), (b"retry-after", b"%d" % shed.retry_after_s)]
    return headers, body
