"""The fleet token: the shared secret that guards the agents' control routes.

Contract:
- `CONTROL_PREFIX` (``/kvherd/v1/``) is what it guards on an agent: migration orders and stages,
  stream follow and resume, the state snapshot (with its block hashes). The OpenAI routes,
  ``/health`` and ``/metrics`` stay open (the proxy and the operator's probes read them).
- A fleet has one token, given by ``--fleet-token`` or `FLEET_TOKEN_ENV` (`resolve`); ``kvherd up``
  generates one and hands it to its agents by the environment (never on a command line, where
  ``ps`` shows it).
- Callers of control routes (the proxy's resume, its load poller and migration driver, agents
  calling each other during a migration) send `auth_headers(token)`: ``Authorization: Bearer
  TOKEN``, or nothing when the fleet has no token.
- `authorized(presented, token)` compares the presented header value in constant time.
"""

from __future__ import annotations

import hmac
import os

FLEET_TOKEN_ENV = "KVHERD_FLEET_TOKEN"
CONTROL_PREFIX = "/kvherd/v1/"


def resolve(flag: str | None) -> str | None:
    """The fleet token from the flag, else the environment; None when neither sets one."""
    return flag or os.environ.get(FLEET_TOKEN_ENV) or None


def auth_headers(token: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"} if token else {}


def authorized(presented: bytes | None, token: str) -> bool:
    return hmac.compare_digest(presented or b"", f"Bearer {token}".encode())
