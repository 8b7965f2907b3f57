"""Open-file limits of the long-running kvherd processes (``kvherd serve``, ``kvherd agent``).

Contract:
- `raise_fd_limit()` raises this process's soft ``RLIMIT_NOFILE`` to its hard limit (a no-op where
  the platform has no such limit or refuses) and returns the soft limit now in force (None when
  unknown). Every client connection, upstream connection and socket costs one descriptor; the
  distribution default of 1,024 is far below what a proxy in front of a fleet needs.
- `connection_cap(limit)`: how many client connections the proxy's front server may hold under
  that limit: half of what is left after `RESERVED_FDS` for everything else (admin API, upstream
  connections beyond the front's own share, KV event sockets, files), at least `MIN_CONNECTIONS`;
  `DEFAULT_CONNECTIONS` when the limit is unknown.
"""

from __future__ import annotations

import contextlib

RESERVED_FDS = 256
MIN_CONNECTIONS = 64
DEFAULT_CONNECTIONS = 4096


def raise_fd_limit() -> int | None:
    try:
        import resource
    except ImportError:  # not on this platform
        return None
    infinity = resource.RLIM_INFINITY
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != infinity and (hard == infinity or soft < hard):
        target = hard if hard != infinity else max(soft, 1 << 20)
        # Some platforms (macOS) refuse values below the hard limit they report: keep the soft one.
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return None if soft == infinity else soft


def connection_cap(limit: int | None) -> int:
    if limit is None:
        return DEFAULT_CONNECTIONS
    return max(MIN_CONNECTIONS, (limit - RESERVED_FDS) // 2)
