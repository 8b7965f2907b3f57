"""API keys, tenants, their cache salts and their service options.

Contract:
- With no keys configured the proxy is open: every request belongs to no tenant, and a client's own
  ``cache_salt`` (vLLM's request field) is passed through and used for routing unchanged.
- With keys configured (``--api-key`` specs repeated, and/or a keys file of one spec a line, ``#``
  comments), every request must carry ``Authorization: Bearer KEY`` for a known key, else 401. A spec
  is ``KEY[=TENANT]`` or ``KEY TENANT``, then options ``weight=W`` (fair share, > 0, default 1),
  ``priority=P`` (the default priority class, an int), ``rpm=N`` and ``tpm=N`` (requests and
  tokens a minute, `scheduler.core.rate_limit`), ``kv_transfer_params=allow`` (its requests'
  own ``kv_transfer_params`` reach the engines; every other request's are stripped: they make
  vLLM's KV connector load KV from a peer they name); a bad spec, or differing options for one
  tenant's keys, is a `ValueError`. A key without a tenant name is its own tenant.
- Each tenant has a cache salt ``HMAC-SHA256(secret, tenant name)`` (``--tenant-salt-secret`` or
  `SALT_SECRET_ENV`; generated when not given: `TenantRegistry.salt_secret_generated`), the same in
  every proxy sharing the secret. The proxy overrides the body's ``cache_salt`` with it: tenants
  never share prefix blocks and never observe each other's cache hits.
"""

from __future__ import annotations

import hashlib
import hmac
import math
import os
import secrets
from collections.abc import Iterable
from dataclasses import dataclass, replace

from scheduler.core.rate_limit import RateLimits

SALT_SECRET_ENV = "KVHERD_TENANT_SALT_SECRET"


@dataclass(frozen=True, slots=True)
class TenantOptions:
    weight: float = 1.0  # its share of the fleet under contention, relative to the others'
    priority: int | None = None  # its requests' class when they name none
    rpm: int | None = None  # requests a minute (None: unlimited)
    tpm: int | None = None  # tokens a minute, prompt and output (None: unlimited)
    kv_transfer_params: bool = False  # its requests' own kv_transfer_params are forwarded

    @property
    def limits(self) -> RateLimits:
        return RateLimits(self.rpm, self.tpm)


@dataclass(frozen=True, slots=True)
class Tenant:
    name: str
    cache_salt: str
    options: TenantOptions = TenantOptions()


@dataclass(frozen=True, slots=True)
class KeySpec:
    key: str
    tenant: str | None = None
    options: TenantOptions | None = None  # None: none given (the tenant's from its other keys)


class TenantRegistry:
    """Maps bearer keys to tenants (see the module contract)."""

    def __init__(self, keys: dict[str, str] | None = None, salt_secret: str | None = None) -> None:
        self.salt_secret_generated = not salt_secret
        self._salt_secret = (salt_secret or secrets.token_hex(32)).encode()
        self._by_key: dict[bytes, Tenant] = {}
        self._tenants: dict[str, Tenant] = {}
        for key, tenant in (keys or {}).items():
            self.add_key(key, tenant)

    @property
    def enabled(self) -> bool:
        return bool(self._by_key)

    @property
    def tenants(self) -> dict[str, Tenant]:
        return self._tenants

    def salt_for(self, tenant: str) -> str:
        digest = hmac.new(self._salt_secret, tenant.encode(), hashlib.sha256)
        return "kvherd-tenant-" + digest.hexdigest()[:32]

    def add_key(
        self, key: str, tenant: str | None = None, options: TenantOptions | None = None
    ) -> None:
        if not key or any(c.isspace() for c in key):
            raise ValueError("an API key must be non-empty and contain no whitespace")
        name = tenant or key
        known = self._tenants.get(name)
        if known is None:
            known = Tenant(name, self.salt_for(name), options or TenantOptions())
        elif options is not None and options != known.options:
            if known.options != TenantOptions():
                raise ValueError(f"tenant {name!r}: its keys give different options")
            known = replace(known, options=options)
        self._tenants[name] = known
        self._by_key[key.encode()] = known
        for k, t in self._by_key.items():  # its other keys see the options too
            if t.name == name:
                self._by_key[k] = known

    def weight(self, tenant: str | None) -> float:
        known = None if tenant is None else self._tenants.get(tenant)
        return 1.0 if known is None else known.options.weight

    def authenticate(self, authorization: bytes | None) -> Tenant | None:
        """The tenant of an ``Authorization`` header value, or None when it names no known key."""
        if authorization is None or authorization[:7].lower() != b"bearer ":
            return None
        return self._by_key.get(authorization[7:].strip())


_OPTIONS = ("weight", "priority", "rpm", "tpm", "kv_transfer_params")


def _option(spec: str, item: str, values: dict[str, float | int]) -> None:
    name, sep, text = item.partition("=")
    if not sep or name not in _OPTIONS or name in values:
        raise ValueError(
            f"bad API key spec {spec!r}: {item!r} is not one of weight=W, priority=P, rpm=N, "
            "tpm=N, kv_transfer_params=allow (each at most once)"
        )
    if name == "kv_transfer_params":
        if text != "allow":
            raise ValueError(f"bad API key spec {spec!r}: kv_transfer_params takes only allow")
        values[name] = True
        return
    try:
        value: float | int = float(text) if name == "weight" else int(text)
    except ValueError:
        raise ValueError(
            f"bad API key spec {spec!r}: {name} must be a number, got {text!r}"
        ) from None
    if name == "weight" and not (0 < value < math.inf):
        raise ValueError(f"bad API key spec {spec!r}: weight must be > 0 and finite")
    if name in ("rpm", "tpm") and value <= 0:
        raise ValueError(f"bad API key spec {spec!r}: {name} must be a positive integer")
    values[name] = value


def parse_key_spec(spec: str) -> KeySpec:
    """``KEY[=TENANT]`` or ``KEY TENANT``, then ``name=value`` options (module contract)."""
    words = spec.split()
    if not words:
        raise ValueError(f"bad API key spec {spec!r}: expected KEY or KEY=TENANT")
    key, sep, tenant = words[0].partition("=")
    rest = words[1:]
    if not sep and rest and "=" not in rest[0]:
        tenant, sep, rest = rest[0], " ", rest[1:]
    if not key:
        raise ValueError(f"bad API key spec {spec!r}: expected KEY or KEY=TENANT")
    values: dict[str, float | int] = {}
    for item in rest:
        _option(spec, item, values)
    options = TenantOptions(**values) if values else None  # type: ignore[arg-type]
    return KeySpec(key, (tenant.strip() or None) if sep else None, options)


def read_keys_file(path: str) -> list[KeySpec]:
    """Key specs from a file, one a line (module contract), ``#`` comments."""
    specs: list[KeySpec] = []
    with open(path, encoding="utf-8") as handle:
        for number, raw in enumerate(handle, 1):
            line = raw.split("#", 1)[0].strip()
            if not line:
                continue
            try:
                specs.append(parse_key_spec(line))
            except ValueError as exc:
                raise ValueError(f"{path}:{number}: {exc}") from exc
    return specs


def build_registry(
    api_keys: Iterable[str] = (), keys_file: str | None = None, salt_secret: str | None = None
) -> TenantRegistry:
    """The registry for ``--api-key`` specs plus an optional keys file; the salt secret is
    `salt_secret`, else `SALT_SECRET_ENV`, else generated."""
    specs = [parse_key_spec(s) for s in api_keys]
    if keys_file:
        specs += read_keys_file(keys_file)
    registry = TenantRegistry(salt_secret=salt_secret or os.environ.get(SALT_SECRET_ENV))
    for spec in specs:
        registry.add_key(spec.key, spec.tenant, spec.options)
    return registry
