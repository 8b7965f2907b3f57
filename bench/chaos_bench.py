"""Chaos benchmark: the fault-tolerance figures of issue 16, from real fleets, as one table.

Scenarios (each its own agents and ``kvherd serve`` subprocesses, `tests/support/chaos_scenarios.py`
and `tests/support/overload_flood.py`, the code the chaos suite asserts on):
- SIGKILL and SIGSTOP of 1 of 4 agents under mixed streamed/plain greedy load (12 closed-loop
  clients, round robin): completed and identical-to-undisturbed %, hangs, 5xx, time until the proxy
  takes the instance out of rotation, blocks the survivors still hold;
- a migration's destination or source SIGKILLed at each stage (live, stop-and-copy, before and
  after the commit): a stream and a plain request;
- a 10x open-loop flood of short (32-token) and long (256-token) requests: 5xx, healthy
  instances ejected, recovery (seconds from the flood's end to normal service);
- fuzzed bodies to /v1/completions and /v1/chat/completions, each to an agent and to the proxy.

Usage: ``python bench/chaos_bench.py [--only instance,migration,overload,fuzz] [--fuzz-bodies 1000]
[--json out.json]``.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import signal
import sys
from collections.abc import Awaitable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "support"))

from chaos_scenarios import Figures, fuzz, instance_lost, migration_fault
from overload_flood import flood

GROUPS = ("instance", "migration", "overload", "fuzz")


async def overload(max_tokens: int) -> Figures:
    report = await flood(max_tokens)
    answered = sum(report.statuses.values()) + len(report.probes)
    errors = sum(n for s, n in report.statuses.items() if s >= 500)
    errors += sum(status >= 500 for _, _, status in report.probes)
    clean = sum(n for s, n in report.statuses.items() if s in (200, 429))
    clean += sum(status == 200 for _, _, status in report.probes)
    ejected = len(report.ejection_lines) + sum(h != "healthy" for h in report.health)
    figures = Figures(
        f"overload 10x {max_tokens}-token ({ejected} healthy ejected)",
        requests=report.sent + len(report.probes),
        completed=clean,  # flood: 200 or 429 (refused by expected wait); after it: 200
        identical=None,
        errors_5xx=errors,
        recovery_s=report.recovered_s,
        leaked_blocks=None,
    )
    figures.hangs = report.sent + len(report.probes) - answered
    figures.notes.append(report.summary())
    return figures


async def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--only", default=",".join(GROUPS), help="comma-separated: " + ", ".join(GROUPS)
    )
    parser.add_argument("--fuzz-bodies", type=int, default=1000, help="per route")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    groups = set(args.only.split(","))
    if groups - set(GROUPS):
        parser.error(f"--only: unknown {sorted(groups - set(GROUPS))}")
    rows: list[Figures] = []

    async def run(scenario: Awaitable[Figures]) -> None:
        figures = await scenario
        rows.append(figures)
        print(Figures.table([figures]).splitlines()[-1], figures.notes[:2], flush=True)

    if "instance" in groups:
        for sig in (signal.SIGKILL, signal.SIGSTOP):
            await run(instance_lost(sig))
    if "migration" in groups:
        for victim in ("destination", "source"):
            for point in ("live", "stop-and-copy", "commit", "committed"):
                await run(migration_fault(victim, point))
    if "overload" in groups:
        for max_tokens in (32, 256):
            await run(overload(max_tokens))
    if "fuzz" in groups:
        await run(fuzz(args.fuzz_bodies))
    print()
    print(Figures.table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps([dataclasses.asdict(r) for r in rows], indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(asyncio.run(main()))
