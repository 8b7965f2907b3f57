"""Admission serves what the engines can start: two real agents behind a real ``kvherd serve``.

Issue 22, with kvherd's own engine at batches of 8 (a fleet of 16 slots) and 64 (128 slots), the
shipped admission defaults (``--max-queue-wait`` 1 s, ``--standing-queue-wait`` 0.25 s):
- a burst of as many concurrent requests as the fleet has batch slots, half streamed, sent
  twice (cold, then on a fleet with a measured rate), is served without a 429: each engine's
  batch holds its share, nothing needs to wait; and so is a burst of the slots left free while a
  quarter of them run long generations that have not completed for a while;
- a closed loop of as many clients as one agent has batch slots (half the fleet's) is not
  refused; after SIGKILL of one agent under it, at least 99% of the requests sent after the kill
  complete (200, every token), none gets a 5xx and none hangs; the requests in flight at the
  kill end too (retried, continued or refused), none hanging.
The burst is shown to be one (the last request sent before the first answered), so a pass is not
a fleet that happened to serve the requests one after another.
"""

from __future__ import annotations

import os
import signal

import pytest
from agent_process import agent_processes
from capacity_load import (
    assert_survivor_served,
    burst,
    burst_behind_long,
    burst_problems,
    closed_loop_with_kill,
    describe,
)
from serve_process import serve_process

pytestmark = pytest.mark.timeout(300)

BURST_TOKENS = 64  # 0.6 s at a batch of 8, 1.9 s at 64 (tiny model): the burst overlaps
KILL_TOKENS = 32
LONG_TOKENS = 1500  # far longer than the burst (closed once the burst has ended)
SETTLE_S = 1.5  # the long generations run this long with no completion before the burst
MIN_AFTER_KILL = 100  # requests after the kill: 99% of them is a count, not a rounding


@pytest.mark.parametrize("max_num_seqs", [8, 64])
async def test_burst_up_to_the_fleets_batch_slots_is_served(max_num_seqs: int) -> None:
    slots = 2 * max_num_seqs
    with (
        agent_processes(2, "--max-num-seqs", str(max_num_seqs)) as fleet,
        serve_process([a.instance_spec() for a in fleet], "--expose-instance") as served,
    ):
        reports, problems = [], []
        for round_ in ("cold", "warm"):
            outcomes = await burst(served.url, slots, BURST_TOKENS, tag=f"b{max_num_seqs}{round_}")
            reports.append(f"{round_} burst of {slots}:\n{describe(outcomes)}")
            problems += [f"{round_} burst: {p}" for p in burst_problems(outcomes)]
        # A quarter of the slots busy with long generations, no completion for a while: the
        # rest of the slots are free, and the burst that fills them is not refused either.
        long_n = slots // 4
        held, outcomes = await burst_behind_long(
            served.url, long_n, slots - long_n, BURST_TOKENS, LONG_TOKENS, SETTLE_S,
            tag=f"b{max_num_seqs}behind",
        )  # fmt: skip
        reports.append(
            f"{long_n} long generations:\n{describe(held)}\nburst of {slots - long_n} behind "
            f"them:\n{describe(outcomes)}"
        )
        if not all(o.status == 200 and o.started for o in held):
            problems.append("a long generation was not started")
        problems += [f"burst behind long generations: {p}" for p in burst_problems(outcomes)]
        print("\n".join(reports))
        assert not problems, "\n".join(problems) + "\n" + "\n".join(reports)


@pytest.mark.parametrize("max_num_seqs", [8, 64])
async def test_survivor_serves_after_the_other_agent_is_killed(max_num_seqs: int) -> None:
    per_client = -(-MIN_AFTER_KILL // max_num_seqs)
    with (
        agent_processes(2, "--max-num-seqs", str(max_num_seqs)) as fleet,
        serve_process([a.instance_spec() for a in fleet], "--expose-instance") as served,
    ):
        victim = fleet[1]
        run = await closed_loop_with_kill(
            served.url,
            clients=max_num_seqs,
            per_client=per_client,
            max_tokens=KILL_TOKENS,
            kill=lambda: os.kill(victim.process.pid, signal.SIGKILL),
            tag=f"k{max_num_seqs}",
        )
        assert_survivor_served(run, MIN_AFTER_KILL)
