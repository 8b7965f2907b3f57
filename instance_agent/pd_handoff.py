"""P/D disaggregation on the prefill instance: reserve on the decode instance at admission, move
the KV while the prefill computes, hand the request over after its first token, through the
agent's live migration.

Contract:
- A generation request sent with ``X-Kvherd-Handoff: URL`` (`HANDOFF_HEADER`; the proxy's P/D
  pairing names the decode instance) runs here like any other. `PDHandoffs.start(stream, url,
  num_tokens, block_hashes, lora_name)`, called as it is admitted, opens its migration to the instance at
  URL with this agent's `MigrationService` at once (once it has a turn, see below), concurrently
  with the prefill and before any engine call of its own: the same cache-aware session as every
  migration, opened before the prefill (`migration.source.PrefillOpening`): stage 0 reserves the
  prompt's blocks there (sharing the ones it caches: only the blocks it lacks are ever sent)
  while the first prefill chunk computes, so the first token never waits for it; live stages
  copy the full blocks each chunk of the prefill computes, and the stop-and-copy stage after the
  first token sends only the rest (the last chunk's blocks). The stages are
  `migration.core.handoff`'s, as in the simulator: on a prefill-only agent (`holds_first_token`)
  the server asks the engine to hold the request at its first token
  (`BatchScheduler.hold_at_first_token`, in the same engine command that adds it), so it is
  suspended before any decode step here; on a mixed agent live stages go on while it decodes.
  The stop-and-copy waits until the first token's frame has been written (so TTFT pays no
  transfer). The client's stream goes on from the decode instance (the proxy reattaches there; a
  non-streamed request is relayed here), no token lost or repeated.
- When the migration aborts (the decode instance refuses the reservation, is unreachable, dies
  mid-prefill or before the commit; the client leaves; the request finishes first) or cannot
  start, the request is prefilled and decoded here and the client sees nothing: the migration's
  abort path frees the destination's reservation and resumes a suspended request; a held request
  is resumed here, or, still prefilling, no longer held (`BatchScheduler.cancel_hold`).
- The outcome (`Handoff.report`: ``outcome`` ``ok`` or ``fallback``, the abort reason, bytes and
  blocks sent and skipped, ``final_blocks`` of them sent by the stop-and-copy, ``stages``,
  ``downtime_s`` from the first token (held) to the commit, ``duration_s`` from the first
  token's frame written (the client has it; not streamed: from the first token) to the commit or
  abort, i.e. what the client's second token waits for beyond a decode step and the
  reattachment, ``first_frame_s`` from the first token to that write (the rest of the downtime:
  the first token's own delivery), ``queued_s`` from admission to the migration's start
  (waiting for a turn), ``in_flight`` handoffs out of this agent when it started, itself
  included, ``prefill_s`` from admission to the first token)
  reaches the proxy as one token-ledger comment line ``: kvherd {"handoff": {...}}``
  (`annotate`, streamed requests with the ledger only): right before the migration notice, or on
  a fallback before the next frame; a stream that finishes before the handoff resolved reports
  ``fallback`` with reason ``finished_first``. A non-streamed response carries the same JSON in
  the `HANDOFF_HEADER` response header (`header_value`).
- The header is honoured only with the fleet token (``Authorization: Bearer FLEET_TOKEN``, which
  the proxy adds to such requests) when the agent has one (`PDHandoffs.authorized`): the OpenAI
  routes are open, and a handoff sends KV and the token to the URL it names.
- Up to `MAX_HANDOFFS_OUT` handoffs out of one instance run at once, the others wait for a turn
  in order of admission (one whose turn comes after its first token waits held, not decoding, on
  a prefill-only agent, and its session finds it so).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator, Sequence
from typing import TYPE_CHECKING, Any

from kvherd import wire
from kvherd.fleet_token import authorized
from migration.core.handoff import MAX_HANDOFFS_OUT, handoff_stages, holds_first_token
from migration.core.protocol import (
    MigrateOrder,
    MigrationOutcome,
    MigrationStatus,
)
from migration.source import PrefillOpening

if TYPE_CHECKING:
    from instance_agent.engine.llm_engine import LLMEngine
    from instance_agent.engine_loop import RequestStream
    from instance_agent.migration_routes import MigrationService

log = logging.getLogger(__name__)

HANDOFF_HEADER = "x-kvherd-handoff"
# The longest a handoff waits for its first token's frame to be written (a client that reads
# nothing must not keep the request on the prefill instance).
FIRST_FRAME_WAIT_S = 1.0
_TOKEN_LEDGER = b'"token_ids"'


class Handoff:
    """One request's handoff to its decode instance."""

    def __init__(self, request_id: str, dst: str) -> None:
        self.request_id = request_id
        self.dst = dst
        self.done = asyncio.Event()
        # A streamed request's first token frame has been handed to the client's connection: the
        # handoff waits for it, so TTFT never pays for the transfer.
        self.streamed = False
        self.first_frame_sent = asyncio.Event()
        self.outcome: MigrationOutcome | None = None
        self.prefill_s = 0.0  # from admission to the first token
        self.queued_s = 0.0  # from admission to the migration's start (its turn)
        self.first_frame_at: float | None = None  # when the first token's frame was written
        self.first_frame_s = 0.0  # from the first token to that write
        self.duration_s = 0.0  # from that write (or the first token) to the commit or abort
        self.held_s: float | None = None  # held at its first token until the commit
        self.in_flight = 0  # handoffs out of this agent as it started, itself included
        self.skipped = ""  # why no migration was tried

    def report(self) -> dict[str, Any]:
        """The outcome as the proxy reads it (see the module contract)."""
        out = self.outcome
        if out is None:
            return {"outcome": "fallback", "reason": self.skipped or "finished_first"}
        committed = out.status is MigrationStatus.COMMITTED
        return {
            "outcome": "ok" if committed else "fallback",
            "reason": None if committed or out.reason is None else out.reason.value,
            "dst": self.dst,
            "stages": out.stages,
            "blocks_sent": out.blocks_sent,
            "final_blocks": out.final_blocks,
            "blocks_skipped": out.blocks_skipped,
            "bytes_sent": out.bytes_sent,
            "bytes_skipped": out.bytes_skipped,
            "downtime_s": out.downtime_s if self.held_s is None else self.held_s,
            "duration_s": self.duration_s,
            "first_frame_s": self.first_frame_s,
            "queued_s": self.queued_s,
            "in_flight": self.in_flight,
            "prefill_s": self.prefill_s,
        }

    def ledger_line(self) -> bytes:
        return wire.ledger_line({"handoff": self.report()})


class PDHandoffs:
    """This agent's handoffs in flight."""

    def __init__(
        self, service: MigrationService, fleet_token: str | None = None, role: str = "mixed"
    ) -> None:
        self.service = service
        self._token = fleet_token
        self.holds_first_token = holds_first_token(role)  # the server holds such requests
        self._stages = handoff_stages(role, service.settings.stages)
        self._turns = asyncio.Semaphore(MAX_HANDOFFS_OUT)
        self._in_flight = 0
        self._tasks: set[asyncio.Task[None]] = set()
        self.outcomes: dict[str, int] = {}  # "ok" / "fallback" -> count

    def authorized(self, presented: str | None) -> bool:
        """May a request with this ``Authorization`` value ask for a handoff?"""
        if self._token is None:
            return True
        return authorized(presented.encode() if presented else None, self._token)

    def start(
        self,
        stream: RequestStream,
        dst: str,
        num_tokens: int,
        block_hashes: Sequence[int],
        lora_name: str | None = None,
    ) -> Handoff:
        """Open the handoff of a request just admitted with `num_tokens` tokens (its prompt:
        the KV its prefill leaves at the first token), their full-block `block_hashes` and the
        LoRA adapter it runs with."""
        handoff = Handoff(stream.request_id, dst.rstrip("/"))
        destination = self.service.destination  # this agent's KV geometry
        opening = PrefillOpening(
            num_tokens,
            block_hashes,
            destination.block_size,
            destination.kv_bytes_per_block,
            destination.model,
            lora_name,
        )
        task = asyncio.ensure_future(self._run(stream, handoff, opening))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return handoff

    async def _run(self, stream: RequestStream, handoff: Handoff, opening: PrefillOpening) -> None:
        began = time.perf_counter()
        first_token = asyncio.ensure_future(stream.started.wait())
        first_token_at: list[float] = []
        first_token.add_done_callback(lambda _: first_token_at.append(time.perf_counter()))

        async def before_final() -> None:
            # Held at its first token: the stop-and-copy waits for the first frame's write.
            await first_token
            if handoff.streamed:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(handoff.first_frame_sent.wait(), FIRST_FRAME_WAIT_S)

        try:
            async with self._turns:
                handoff.queued_s = time.perf_counter() - began
                loop = self.service.engine_loop
                if loop.stream_of(handoff.request_id) is not stream:
                    handoff.skipped = "stream_ended"  # the client left, or it finished and closed
                    return
                self._in_flight += 1
                handoff.in_flight = self._in_flight
                try:
                    handoff.outcome = await self.service.migrate(
                        MigrateOrder(handoff.request_id, handoff.dst),
                        self._stages,
                        MAX_HANDOFFS_OUT,
                        opening,
                        before_final,
                    )
                finally:
                    self._in_flight -= 1
        except Exception:  # a handoff must never take the request down: it decodes here
            log.exception("handoff of %s failed", handoff.request_id)
            handoff.skipped = "error"
        finally:
            if first_token_at:
                handoff.prefill_s = first_token_at[0] - began
                frame = handoff.first_frame_at
                if frame is not None and frame >= first_token_at[0]:
                    handoff.first_frame_s = frame - first_token_at[0]
                ended = time.perf_counter()
                handoff.duration_s = ended - max(frame or 0.0, first_token_at[0])
                if self.holds_first_token and _committed(handoff.outcome):
                    # Held since it sampled its first token (the session may have seen it
                    # later, with a live stage still landing).
                    handoff.held_s = ended - first_token_at[0]
            first_token.cancel()
            out = handoff.outcome
            if self.holds_first_token and not _committed(out):
                await self._release_held(handoff.request_id)
            key = handoff.report()["outcome"]
            self.outcomes[key] = self.outcomes.get(key, 0) + 1
            handoff.done.set()

    async def _release_held(self, request_id: str) -> None:
        """A held request whose handoff did not commit decodes here: resumed if suspended (the
        migration's abort path resumed it already, unless it never started), or no longer held
        if it is still prefilling (the handoff failed before its first token)."""
        if self.service.migrating(request_id):
            return  # another migration of it runs (and suspended it)

        def release(engine: LLMEngine) -> None:
            request = engine.scheduler.requests.get(request_id)
            if request is None:
                return
            if request.migration_phase == "suspended":
                engine.resume(request_id)
            else:
                engine.scheduler.cancel_hold(request_id)

        try:
            await self.service.engine_loop.call(release)
        except Exception:
            log.exception("releasing %s after its handoff failed", request_id)


def _committed(outcome: MigrationOutcome | None) -> bool:
    return outcome is not None and outcome.status is MigrationStatus.COMMITTED


def annotate(frames: AsyncIterator[bytes], handoff: Handoff) -> AsyncIterator[bytes]:
    """`frames` (a streamed request's SSE with the token ledger) with the handoff's ledger line;
    the handoff starts once the first token's frame has been sent."""
    handoff.streamed = True
    return _annotated(frames, handoff)


async def _annotated(frames: AsyncIterator[bytes], handoff: Handoff) -> AsyncIterator[bytes]:
    reported = False
    async for chunk in frames:
        if not reported:
            at = chunk.find(wire.NOTICE_PREFIX)
            if at >= 0:  # committed: the outcome is known before the notice is written
                await handoff.done.wait()
                chunk = chunk[:at] + handoff.ledger_line() + chunk[at:]
                reported = True
            elif handoff.done.is_set() or chunk.endswith(wire.SSE_DONE):
                chunk = handoff.ledger_line() + chunk
                reported = True
        yield chunk
        # Resumed: the server has written `chunk`. A frame with tokens names them in its ledger.
        if not handoff.first_frame_sent.is_set() and _TOKEN_LEDGER in chunk:
            handoff.first_frame_at = time.perf_counter()
            handoff.first_frame_sent.set()


def header_value(handoff: Handoff) -> str:
    """The `HANDOFF_HEADER` value of a non-streamed response."""
    return json.dumps(handoff.report(), separators=(",", ":"))
