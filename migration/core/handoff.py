"""How a P/D handoff leaves its prefill instance: one choice for the agents and the simulator.

Contract:
- `holds_first_token(role)`: out of a prefill-only instance a handed-off request is suspended by
  its engine in the step that samples its first token (`BatchScheduler.hold_at_first_token`), so
  it never decodes there, in no decode batch, while it waits for and goes through its handoff;
  only a failed handoff resumes it there. Out of a mixed instance it keeps decoding.
- `handoff_stages(role, stages)`: the handoff's `StageConfig`. Out of a prefill-only instance no
  live stage: the held request's KV moves in one stop-and-copy stage (its first snapshot finds
  it suspended, see `migration.core.session`). Out of a mixed instance `stages` (the migration's
  live stages while it decodes, then the stop-and-copy).
- `MAX_HANDOFFS_OUT` handoffs out of one instance run at once (others wait for a turn); a decode
  agent takes as many in (`DECODE_MAX_INCOMING`).
- Used by `instance_agent.pd_handoff` and `simulator.pd`/`simulator.cluster` alike, both opening
  the session as the request is admitted (`migration.source.PrefillOpening`; the simulator opens
  it the same way): stage 0 reserves the prompt's blocks on the decode instance, live stages copy
  a chunked prefill's full blocks while it computes, so the stop-and-copy sends only the last
  chunk's.
"""

from __future__ import annotations

from dataclasses import replace

from migration.core.stages import StageConfig

MAX_HANDOFFS_OUT = 4


def holds_first_token(role: str) -> bool:
    """Does a request handed off out of an instance of this role stop at its first token?"""
    return role == "prefill"


def handoff_stages(role: str, stages: StageConfig) -> StageConfig:
    """The stages of a handoff out of an instance of `role`, `stages` being its migrations'."""
    return replace(stages, max_live_stages=0) if holds_first_token(role) else stages
