"""Chaos benchmark: the fault-tolerance figures of issue 16, from real fleets, as one table.

Scenarios (each its own agents and ``kvherd serve`` subprocesses, `tests/support/chaos_scenarios.py`
and `tests/support/overload_flood.py`, the code the chaos suite asserts on):
- SIGKILL and SIGSTOP of 1 of 4 agents under mixed streamed/plain greedy load (12 closed-loop
  clients, round robin): completed and identical-to-undisturbed %, hangs, 5xx, time until the proxy
  takes the instance out of rotation, blocks the survivors still hold;
- a migration's destination or source SIGKILLed at each stage (live, stop-and-copy, before and
  after the commit): a stream and a plain request;
- a 10x open-loop flood of short (32-token) and long (256-token) requests, on agents with batches
  of 8 and (long requests) of 64: 5xx, healthy instances ejected, recovery (seconds from the
  flood's end to normal service: the median of ``--overload-runs`` floods);
- fuzzed bodies to /v1/completions and /v1/chat/completions, each to an agent and to the proxy.

Usage: ``python bench/chaos_bench.py [--only instance,migration,overload,fuzz] [--fuzz-bodies 1000]
[--overload-runs 3] [--json out.json]``.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import signal
import statistics
import sys
from collections.abc import Awaitable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "support"))

from chaos_scenarios import Figures, fuzz, instance_lost, migration_fault
from overload_flood import flood

GROUPS = ("instance", "migration", "overload", "fuzz")


async def overload(max_tokens: int, max_num_seqs: int, runs: int) -> Figures:
    """`runs` floods of one kind: counts summed, recovery their median (each run in the notes)."""
    reports = [await flood(max_tokens, max_num_seqs) for _ in range(runs)]
    figures = Figures(
        f"overload 10x {max_tokens}-token, batch {max_num_seqs} (0 healthy ejected)",
        identical=None,
        leaked_blocks=None,
    )
    ejected = 0
    for report in reports:
        answered = sum(report.statuses.values()) + len(report.probes)
        figures.requests += report.sent + len(report.probes)
        figures.errors_5xx += sum(n for s, n in report.statuses.items() if s >= 500)
        figures.errors_5xx += sum(status >= 500 for _, _, status in report.probes)
        # Flood: 200 or 429 (refused by expected wait); after it: 200.
        figures.completed += sum(n for s, n in report.statuses.items() if s in (200, 429))
        figures.completed += sum(status == 200 for _, _, status in report.probes)
        figures.hangs += report.sent + len(report.probes) - answered
        ejected += len(report.ejection_lines) + sum(h != "healthy" for h in report.health)
    figures.scenario = figures.scenario.replace("(0 healthy", f"({ejected} healthy")
    recovered = [r.recovered_s for r in reports]
    if None not in recovered:
        figures.recovery_s = statistics.median(r for r in recovered if r is not None)
    figures.notes.append(
        f"recovery s over {runs} runs: {[None if r is None else round(r, 2) for r in recovered]}"
    )
    figures.notes.extend(report.summary() for report in reports)
    return figures


async def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--only", default=",".join(GROUPS), help="comma-separated: " + ", ".join(GROUPS)
    )
    parser.add_argument("--fuzz-bodies", type=int, default=1000, help="per route")
    parser.add_argument("--overload-runs", type=int, default=3, help="floods per kind (median)")
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
        for max_tokens, max_num_seqs in ((32, 8), (256, 8), (256, 64)):
            await run(overload(max_tokens, max_num_seqs, args.overload_runs))
    if "fuzz" in groups:
        await run(fuzz(args.fuzz_bodies))
    print()
    print(Figures.table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps([dataclasses.asdict(r) for r in rows], indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(asyncio.run(main()))
