"""A live migration's destination or source SIGKILLed at each of its stages, behind a real
``kvherd serve`` (`chaos_scenarios.migration_fault`): each agent sits behind a `FaultRelay` that
fires the kill at one control message of the migration.

Stages: ``live`` (a stage reserved while the request decodes on the source: its KV copy under
way), ``stop-and-copy`` (a stage reserved once the request is suspended on the source),
``commit`` (every block landed, the commit about to be delivered), ``committed`` (the destination
accepted the request), and, for the destination, a number of tokens after the proxy reattached
the stream there (it runs on at the destination, then is continued from what both agents sent,
on its former source). What must hold: the stream and a plain request sent alongside complete with
exactly the output of an undisturbed run (the migration aborts and the source resumes, or the proxy
continues the stream on the surviving agent), nothing hangs, and the surviving agent holds no block
once idle (a dead source's reservation on the destination expires).
"""

from __future__ import annotations

import pytest
from chaos_scenarios import Figures, Point, Victim, migration_fault

pytestmark = pytest.mark.timeout(600)

CASES = [
    *(pytest.param("destination", point, id=f"destination-{point}") for point in
      ("live", "stop-and-copy", "commit", "committed")),
    pytest.param("source", "live", id="source-live"),
    pytest.param("source", "stop-and-copy", id="source-stop-and-copy"),
    pytest.param("source", "commit", id="source-commit"),
    pytest.param("source", "committed", id="source-committed"),
]  # fmt: skip


@pytest.mark.parametrize(("victim", "point"), CASES)
async def test_a_migration_cut_at_any_stage_loses_no_request_and_leaks_no_block(
    victim: Victim, point: Point
) -> None:
    _check(await migration_fault(victim, point))


@pytest.mark.parametrize("after_tokens", [1, 32, 128])
async def test_a_stream_whose_destination_dies_after_the_commit_continues_on_its_source(
    after_tokens: int,
) -> None:
    # Killed once the stream ran on from the destination for a while (at the ~300 tokens/s of
    # two busy agents on 2 cores, 128 tokens are ~0.4 s): the proxy continues it from the tokens
    # both agents relayed, on the former source, the one healthy instance left. The reattachment
    # came after 84-149 tokens on a loaded machine; 480 leave room for a slower migration.
    _check(await migration_fault("destination", "resumed", 480, after_tokens))


def _check(figures: Figures) -> None:
    print("\n" + Figures.table([figures]), figures.notes)
    assert "the fault never fired" not in figures.notes, figures.notes
    assert "the stream ended before the fault" not in figures.notes, figures.notes
    assert figures.completed == figures.requests == 2, figures.notes
    assert figures.identical == figures.requests, figures.notes
    assert figures.hangs == 0 and figures.errors_5xx == 0
    assert figures.leaked_blocks == 0
