"""Prefix hand-over on the proxy's clock: a leaving agent's hot prefixes pulled by survivors.

Contract:
- `hand_over(fleet, instance_id, client)` runs once an instance that is leaving has no running
  request (its agent asks for it from its drain: ``POST /admin/v1/instances/{id}/handover``). It
  reads the agent's cached prefixes, hottest first (``GET /kvherd/v1/prefixes``), keeps those a
  request hashes to the very same blocks (unsalted, no adapter: a keyed chain no request without
  the key could hit), asks the prefix index which survivor holds how much of each, plans with
  `scheduler.core.handover` (room: `share` of each survivor's free blocks), and sends each move
  to its survivor as a one-token greedy completion of the prefix that pulls its blocks from the
  leaving agent's block server first (`kvherd.kv_pull.PULL_HEADER`, with the fleet token).
- Survivors: healthy, not draining kvherd agents with a block server, serving the same model at
  the same block size. Only kvherd agents leave this way (a vLLM server has no prefix listing).
- It never raises for a survivor's or the leaver's failure: each is counted in the result and in
  ``kvherd_handover_blocks_total{outcome}`` (``pulled``, ``failed``).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

import httpx

from kvherd.block_hash import block_hash_chain
from kvherd.fleet_token import auth_headers
from kvherd.kv_pull import PULL_HEADER, PULL_OUTCOME_HEADER, PullAsk, parse_outcome
from scheduler.core.handover import Offer, plan_handover

if TYPE_CHECKING:
    from scheduler.fleet import Fleet

log = logging.getLogger("kvherd.handover")

MAX_BLOCKS = 4096  # the most blocks of a leaver's cache one hand-over considers
CONCURRENT_PULLS = 4


@dataclass(slots=True)
class HandoverResult:
    instance_id: str
    prefixes: int = 0  # prefixes the leaver listed
    keyed: int = 0  # left: salted or adapter chains
    held: int = 0  # left: a survivor holds them whole
    no_room: int = 0
    pulled_prefixes: int = 0
    pulled_blocks: int = 0  # blocks that landed on survivors
    failed_blocks: int = 0  # blocks planned to move that did not land
    error: str | None = None  # why nothing was handed over at all

    def body(self) -> dict[str, Any]:
        return asdict(self)


async def hand_over(
    fleet: Fleet,
    instance_id: str,
    client: httpx.AsyncClient,
    share: float = 0.5,
    max_blocks: int = MAX_BLOCKS,
) -> HandoverResult:
    result = HandoverResult(instance_id)
    leaver = fleet.instances[instance_id]
    address = leaver.spec.pull_address
    if not leaver.spec.kvherd_agent or address is None:
        result.error = "not a kvherd agent with a block server"
        return result
    token = fleet.settings.fleet_token
    try:
        listed = await client.get(
            f"{leaver.url}/kvherd/v1/prefixes",
            params={"max_blocks": max_blocks},
            headers=auth_headers(token),
        )
        listed.raise_for_status()
        answer = listed.json()
        model, block_size = answer["model"], int(answer["block_size"])
        prefixes = [(p["block_hashes"], p["token_ids"]) for p in answer["prefixes"]]
    except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
        result.error = f"could not list its prefixes: {exc!r}"
        return result
    result.prefixes = len(prefixes)
    cluster = fleet.cluster
    survivors = {
        i: inst
        for i, inst in fleet.instances.items()
        if i != instance_id
        and inst.spec.kvherd_agent
        and inst.spec.pull_address is not None
        and cluster.get(i).healthy
        and not cluster.get(i).draining
        and cluster.get(i).block_size == block_size
        and model in (fleet.models.models_of(i) or (inst.spec.model,))
    }
    index = cluster.prefix_index
    plain = [
        (chain, tokens)
        for chain, tokens in prefixes
        if block_hash_chain(tokens, block_size, algo=index.hash_algo) == chain
    ]
    result.keyed = len(prefixes) - len(plain)
    offers = [
        Offer(chain, {i: d for i, d in index.match(chain).items() if i in survivors})
        for chain, _ in plain
    ]
    room = {i: int(share * (cluster.get(i).report.num_free_blocks or 0)) for i in survivors}
    plan = plan_handover(offers, room)
    result.held, result.no_room = plan.held, plan.no_room
    gate = asyncio.Semaphore(CONCURRENT_PULLS)

    async def pull(survivor: str, tokens: list[int], num_blocks: int, moved: int) -> None:
        # One token past the prefix: every block of it is a prompt block the pull may fill.
        body = {"model": model, "prompt": [*tokens, tokens[-1]], "max_tokens": 1, "temperature": 0}
        headers = {PULL_HEADER: PullAsk(address, num_blocks).header(), **auth_headers(token)}
        told = None
        async with gate:
            try:
                r = await client.post(
                    f"{survivors[survivor].url}/v1/completions", json=body, headers=headers
                )
                if r.status_code == 200:
                    told = parse_outcome(r.headers.get(PULL_OUTCOME_HEADER, ""))
                else:
                    log.warning("hand-over to %s: %s %s", survivor, r.status_code, r.text[:200])
            except httpx.HTTPError as exc:
                log.warning("hand-over to %s failed: %r", survivor, exc)
        # The survivor pulls the blocks it lacks (it holds the rest), so those land or not.
        landed = 0 if told is None else min(moved, told.num_blocks)
        if landed:
            result.pulled_prefixes += 1
        result.pulled_blocks += landed
        result.failed_blocks += moved - landed

    await asyncio.gather(
        *(
            pull(
                move.survivor, plain[move.offer][1], offers[move.offer].num_blocks, move.num_blocks
            )
            for move in plan.moves
        )
    )
    fleet.metrics.handover_blocks.labels("pulled").inc(result.pulled_blocks)
    fleet.metrics.handover_blocks.labels("failed").inc(result.failed_blocks)
    log.info("hand-over of %s: %s", instance_id, result)
    return result
