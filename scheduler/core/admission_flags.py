"""The admission flags, one definition for ``kvherd serve`` and ``kvherd sim``.

Contract:
- `add_admission_arguments(parser)` adds ``--max-inflight-per-instance``, ``--queue-size``,
  ``--queue-timeout``, ``--priority-aging``, ``--max-queue-wait`` and ``--standing-queue-wait``; a
  non-positive count or a number of seconds that is not positive and finite is a usage error (2).
- `admission_settings(args)` -> (`AdmissionSettings`, `QueueSettings`, the in-flight cap).
"""

from __future__ import annotations

import argparse

from scheduler.core.admission import AdmissionSettings
from scheduler.core.admission_queue import QueueSettings


def _seconds(text: str) -> float:
    """A positive, finite number of seconds (argparse type: anything else is a usage error)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, got {text!r}") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"need a positive number of seconds, got {text!r}")
    return value


def _count(text: str) -> int:
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"need a non-negative whole number, got {text!r}")
    return int(text)


def _positive(text: str) -> int:
    value = _count(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"need a positive whole number, got {text!r}")
    return value


def add_admission_arguments(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    parser.add_argument(
        "--max-inflight-per-instance",
        type=_positive,
        default=256,
        help="requests in flight per instance before new ones wait in the admission queue",
    )
    parser.add_argument("--queue-size", type=_count, default=1024, help="admission queue bound")
    parser.add_argument(
        "--queue-timeout", type=_seconds, default=30.0, help="longest wait in the admission queue"
    )
    parser.add_argument(
        "--priority-aging",
        type=_seconds,
        default=10.0,
        metavar="SECONDS",
        help="a request that waited this long in the admission queue goes before every priority "
        "class (no class starves beyond it; default 10)",
    )
    parser.add_argument(
        "--max-queue-wait",
        type=_seconds,
        default=1.0,
        metavar="SECONDS",
        help="refuse a request (429, Retry-After) when no instance would start it at once and the "
        "requests queued ahead of it would take the fleet longer than this to start, at its "
        "measured completion rate (default 1)",
    )
    parser.add_argument(
        "--standing-queue-wait",
        type=_seconds,
        default=0.25,
        metavar="SECONDS",
        help="the wait allowed instead once the queue has not emptied for --max-queue-wait "
        "seconds (a flood, not a burst); a flood leaves about this much work queued when it ends "
        "(default 0.25; equal to --max-queue-wait: off)",
    )


def admission_settings(args: argparse.Namespace) -> tuple[AdmissionSettings, QueueSettings, int]:
    admission = AdmissionSettings(
        max_queue_wait_s=args.max_queue_wait,
        standing_queue_wait_s=min(args.standing_queue_wait, args.max_queue_wait),
    )
    return (
        admission,
        QueueSettings(args.queue_size, args.queue_timeout, args.priority_aging),
        args.max_inflight_per_instance,
    )
