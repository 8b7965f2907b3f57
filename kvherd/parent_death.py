"""`die_with_parent`: a child process's `preexec_fn` that ties its life to its parent's.

Linux only (``prctl(PR_SET_PDEATHSIG, SIGTERM)``): the child gets SIGTERM when the parent that
started it dies, killed outright included, so it drains and exits instead of running orphaned.
Elsewhere it does nothing.
"""

from __future__ import annotations

import contextlib
import signal


def die_with_parent() -> None:
    with contextlib.suppress(OSError, AttributeError):
        import ctypes

        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        pr_set_pdeathsig = 1
        libc.prctl(pr_set_pdeathsig, signal.SIGTERM)
