"""API keys, tenants and cache salts.

Contract:
- With no keys configured the proxy is open: every request belongs to no tenant, and a client's own
  ``cache_salt`` (vLLM's request field) is passed through and used for routing unchanged.
- With keys configured (``--api-key KEY[=TENANT]`` repeated, and/or a keys file of ``KEY[=TENANT]``
  or ``KEY TENANT`` lines, ``#`` comments), every request must carry ``Authorization: Bearer KEY`` for a
  known key, else 401. A key without a tenant name is its own tenant.
- Each tenant has a cache salt ``HMAC-SHA256(secret, tenant name)``: unguessable without the
  fleet's salt secret (``--tenant-salt-secret`` or `SALT_SECRET_ENV`), and identical in every proxy
  that shares the secret (so router replicas route a tenant's requests to the same cached blocks).
  With no secret given, a random one is generated (`TenantRegistry.salt_secret_generated`): salts
  are then private to this process, and change when it restarts (tenants' cached prefixes are
  computed again). The proxy overrides the request body's ``cache_salt`` with the tenant's salt, so
  a client can neither choose another tenant's salt nor opt out of its own: tenants never share
  prefix blocks and never observe each other's cache hits.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from collections.abc import Iterable
from dataclasses import dataclass

SALT_SECRET_ENV = "KVHERD_TENANT_SALT_SECRET"


@dataclass(frozen=True, slots=True)
class Tenant:
    name: str
    cache_salt: str


class TenantRegistry:
    """Maps bearer keys to tenants (see the module contract)."""

    def __init__(self, keys: dict[str, str] | None = None, salt_secret: str | None = None) -> None:
        self.salt_secret_generated = not salt_secret
        self._salt_secret = (salt_secret or secrets.token_hex(32)).encode()
        self._by_key: dict[bytes, Tenant] = {}
        for key, tenant in (keys or {}).items():
            self.add_key(key, tenant)

    @property
    def enabled(self) -> bool:
        return bool(self._by_key)

    def salt_for(self, tenant: str) -> str:
        digest = hmac.new(self._salt_secret, tenant.encode(), hashlib.sha256)
        return "kvherd-tenant-" + digest.hexdigest()[:32]

    def add_key(self, key: str, tenant: str | None = None) -> None:
        if not key or any(c.isspace() for c in key):
            raise ValueError("an API key must be non-empty and contain no whitespace")
        name = tenant or key
        self._by_key[key.encode()] = Tenant(name, self.salt_for(name))

    def authenticate(self, authorization: bytes | None) -> Tenant | None:
        """The tenant of an ``Authorization`` header value, or None when it names no known key."""
        if authorization is None or authorization[:7].lower() != b"bearer ":
            return None
        return self._by_key.get(authorization[7:].strip())


def parse_key_spec(spec: str) -> tuple[str, str | None]:
    """``KEY=TENANT`` or ``KEY`` -> (key, tenant or None)."""
    key, sep, tenant = spec.partition("=")
    key = key.strip()
    if not key:
        raise ValueError(f"bad API key spec {spec!r}: expected KEY or KEY=TENANT")
    return key, (tenant.strip() or None) if sep else None


def read_keys_file(path: str) -> list[tuple[str, str | None]]:
    """Key specs from a file: one ``KEY[=TENANT]`` or ``KEY TENANT`` per line, ``#`` comments."""
    specs: list[tuple[str, str | None]] = []
    with open(path, encoding="utf-8") as handle:
        for number, raw in enumerate(handle, 1):
            line = raw.split("#", 1)[0].strip()
            if not line:
                continue
            if "=" not in line and len(line.split()) == 2:
                key, tenant = line.split()
                specs.append((key, tenant))
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
    for key, tenant in specs:
        registry.add_key(key, tenant)
    return registry
