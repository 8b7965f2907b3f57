"""Prefixes moved as the fleet changes size, on the proxy's clock: hand-over and warm-up.

Contract:
- `hand_over(fleet, id, client)` (scale-in), once a leaving engine runs nothing (an agent asks
  from its drain, ``POST /admin/v1/instances/{id}/handover``; a launched engine's retire calls it):
  survivors pull its hot prefixes, within `share` of each one's free blocks. `warm_up(fleet, id,
  client)` (scale-out), before a new engine takes traffic: it pulls every peer's hottest prefixes,
  each peer's within an equal part of `share` of its own free blocks. `WarmUps.start(id)` holds a
  new engine out of routing (drained), when some peer caches anything, until its first load
  report and its warm-up are done (or `timeout_s`), then lets it in unless it is leaving meanwhile,
  its traffic ramped (`Fleet.ramp`, with ``--slow-start``).
- A kvherd agent lists its prefixes hottest first (``GET /kvherd/v1/prefixes``; keyed chains, salt
  or adapter, are left); a vLLM server cannot, so its are the prompts the proxy routed to vLLM
  (`Fleet.prompts`, most recent first) as far as its KV events say it holds them. The prefix index
  says who holds how much; `scheduler.core.handover` plans; each move is a one-token greedy
  completion of the prefix sent to its target, asking it to pull from the source's block server:
  `kvherd.kv_pull.PULL_HEADER` (fleet token) to an agent, ``kv_transfer_params.kvherd_pull`` to
  vLLM's kvherd connector.
- Targets and peers: healthy, not draining engines of the source's kind with a block server,
  serving the model at the block size. Failures never raise: they are counted in the result and in
  ``kvherd_handover_blocks_total{cause,outcome}``."""

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

PULL_TIMEOUT_S = 30.0  # one survivor's pull of one prefix, and the listing
MAX_BLOCKS = 4096  # the most blocks of one instance's cache a hand-over or warm-up considers
CONCURRENT_PULLS = 4
WARM_UP_TIMEOUT_S = 30.0  # the longest a new agent is held out of routing to warm up
REPORT_POLL_S = 0.05  # how often a warm-up looks for the new agent's first load report


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
    fleet: Fleet, instance_id: str, client: httpx.AsyncClient | None = None, share: float = 0.5
) -> HandoverResult:
    """Scale-in: survivors pull the leaving `instance_id`'s prefixes (module contract), through
    `client` (None: one of its own, `PULL_TIMEOUT_S`)."""
    if client is None:
        async with httpx.AsyncClient(timeout=PULL_TIMEOUT_S, trust_env=False) as own:
            return await hand_over(fleet, instance_id, own, share)
    result = HandoverResult(instance_id)
    listed = await _listing(fleet, instance_id, client, result)
    if listed is not None:
        survivors = _peers(fleet, instance_id, *listed[:2])
        room = {i: int(share * _free_blocks(fleet, i)) for i in survivors}
        await _move(fleet, instance_id, listed, room, client, result, "scale_in")
    log.info("hand-over of %s: %s", instance_id, result)
    return result


async def warm_up(
    fleet: Fleet, instance_id: str, client: httpx.AsyncClient, share: float = 0.5
) -> HandoverResult:
    """Scale-out: the new `instance_id` pulls the hottest prefixes of every peer serving its
    model, each peer's within an equal part of `share` of its free blocks."""
    result = HandoverResult(instance_id)
    new = fleet.instances[instance_id]
    if new.spec.pull_address is None:
        result.error = "no block server"
        return result
    block_size = fleet.cluster.get(instance_id).block_size
    models = fleet.models.models_of(instance_id) or (new.spec.model,)
    donors = _peers(fleet, instance_id, None, block_size)
    budget = int(share * _free_blocks(fleet, instance_id)) // max(1, len(donors))
    for donor in donors:
        listed = await _listing(fleet, donor, client, result)
        if listed is not None and listed[0] in models:
            await _move(fleet, donor, listed, {instance_id: budget}, client, result, "scale_out")
    log.info("warm-up of %s: %s", instance_id, result)
    return result


Listing = tuple[str, int, list[tuple[list[int], list[int]]]]  # model, block size, prefixes


async def _listing(
    fleet: Fleet, source: str, client: httpx.AsyncClient, result: HandoverResult
) -> Listing | None:
    """`source`'s prefixes a request without a key hashes to the very same blocks; None (the
    reason in `result.error`) when it cannot be asked or answers nonsense."""
    inst = fleet.instances[source]
    if inst.spec.pull_address is None:
        result.error = f"{source} has no block server"
        return None
    if not inst.spec.kvherd_agent:
        return _booked(fleet, source, result)
    try:
        listed = await client.get(
            f"{inst.url}/kvherd/v1/prefixes",
            params={"max_blocks": MAX_BLOCKS},
            headers=auth_headers(fleet.settings.fleet_token),
        )
        listed.raise_for_status()
        answer = listed.json()
        model, block_size = str(answer["model"]), int(answer["block_size"])
        prefixes = [(p["block_hashes"], p["token_ids"]) for p in answer["prefixes"]]
    except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
        result.error = f"could not list {source}'s prefixes: {exc!r}"
        return None
    algo = fleet.cluster.prefix_index.hash_algo
    plain = [(c, t) for c, t in prefixes if block_hash_chain(t, block_size, algo=algo) == c]
    result.prefixes += len(prefixes)
    result.keyed += len(prefixes) - len(plain)
    return model, block_size, plain


def _booked(fleet: Fleet, source: str, result: HandoverResult) -> Listing:
    """What vLLM server `source` holds, as its KV events told the prefix index, of the prompts
    the proxy routed to vLLM servers (`Fleet.prompts`), most recently routed first."""
    inst = fleet.instances[source]
    block_size = fleet.cluster.get(source).block_size
    model = (fleet.models.models_of(source) or [inst.spec.model or ""])[0]
    index = fleet.cluster.prefix_index
    prefixes: list[tuple[list[int], list[int]]] = []
    blocks = 0
    for chain, tokens in fleet.prompts.recent():
        held = index.match(chain).get(source, 0)
        if held:
            prefixes.append((list(chain[:held]), tokens[: held * block_size].tolist()))
            blocks += held
            if blocks >= MAX_BLOCKS:
                break
    result.prefixes += len(prefixes)
    return model, block_size, prefixes


def _peers(fleet: Fleet, source: str, model: str | None, block_size: int) -> list[str]:
    """Instances that can pull from `source`: healthy, not draining engines of its kind (kvherd
    agents, or vLLM servers) with a block server, at `block_size`, serving `model` (None: any)."""
    cluster = fleet.cluster
    agent = fleet.instances[source].spec.kvherd_agent
    return [
        i
        for i, inst in fleet.instances.items()
        if i != source
        and inst.spec.kvherd_agent == agent
        and inst.spec.pull_address is not None
        and cluster.get(i).healthy
        and not cluster.get(i).draining
        and cluster.get(i).block_size == block_size
        and (model is None or model in (fleet.models.models_of(i) or (inst.spec.model,)))
    ]


def _free_blocks(fleet: Fleet, instance_id: str) -> int:
    return fleet.cluster.get(instance_id).report.num_free_blocks or 0


async def _move(
    fleet: Fleet,
    source: str,
    listed: Listing,
    room: dict[str, int],
    client: httpx.AsyncClient,
    result: HandoverResult,
    cause: str,
) -> None:
    """Plan `listed` (the prefixes of `source`) onto the instances of `room`, and pull."""
    model, block_size, plain = listed
    address = fleet.instances[source].spec.pull_address
    agent = fleet.instances[source].spec.kvherd_agent
    assert address is not None  # (`_listing` lists block servers only)
    token = fleet.settings.fleet_token
    index = fleet.cluster.prefix_index
    offers = [
        Offer(chain, {i: d for i, d in index.match(chain).items() if i in room})
        for chain, _ in plain
    ]
    plan = plan_handover(offers, room)
    result.held += plan.held
    result.no_room += plan.no_room
    gate = asyncio.Semaphore(CONCURRENT_PULLS)

    async def pull(target: str, tokens: list[int], num_blocks: int, moved: int) -> None:
        # One token past the prefix: every block of it is a prompt block the pull may fill.
        body: dict[str, Any] = {
            "model": model, "prompt": [*tokens, tokens[-1]], "max_tokens": 1, "temperature": 0,
        }  # fmt: skip
        headers = auth_headers(token)
        if agent:
            headers[PULL_HEADER] = PullAsk(address, num_blocks).header()
        else:  # vLLM: its kvherd connector pulls (`kvherd.vllm_connector`)
            body["kv_transfer_params"] = {"kvherd_pull": {"from": address, "tokens": len(tokens)}}
        pulled = 0
        async with gate:
            try:
                r = await client.post(
                    f"{fleet.instances[target].url}/v1/completions", json=body, headers=headers
                )
                if r.status_code == 200:
                    pulled = _pulled_blocks(r, agent, block_size)
                else:
                    log.warning("pull by %s: %s %s", target, r.status_code, r.text[:200])
            except (httpx.HTTPError, KeyError) as exc:  # (KeyError: it left meanwhile)
                log.warning("pull by %s failed: %r", target, exc)
        # The target pulls the blocks it lacks (it holds the rest), so those land or not.
        landed = min(moved, pulled)
        if landed:
            result.pulled_prefixes += 1
        result.pulled_blocks += landed
        result.failed_blocks += moved - landed
        fleet.metrics.handover_blocks.labels(cause, "pulled").inc(landed)
        fleet.metrics.handover_blocks.labels(cause, "failed").inc(moved - landed)

    await asyncio.gather(
        *(
            pull(
                move.survivor, plain[move.offer][1], offers[move.offer].num_blocks, move.num_blocks
            )
            for move in plan.moves
        )
    )


def _pulled_blocks(answer: httpx.Response, agent: bool, block_size: int) -> int:
    """The blocks a pull's answer says landed: a kvherd agent's `PULL_OUTCOME_HEADER`, vLLM's
    connector's ``kv_transfer_params.kvherd_pull`` (tokens loaded)."""
    if agent:
        told = parse_outcome(answer.headers.get(PULL_OUTCOME_HEADER, ""))
        return 0 if told is None else told.num_blocks
    try:
        loaded = answer.json()["kv_transfer_params"]["kvherd_pull"]
        return int(loaded["tokens"]) // block_size if loaded["outcome"] == "loaded" else 0
    except (ValueError, KeyError, TypeError):
        return 0


class WarmUps:
    """Newly registered agents warming up before they take traffic (module contract)."""

    def __init__(self, fleet: Fleet, timeout_s: float = WARM_UP_TIMEOUT_S) -> None:
        self.fleet = fleet
        self.timeout_s = timeout_s
        self._tasks: set[asyncio.Task[None]] = set()

    def start(self, instance_id: str) -> None:
        """Warm `instance_id` up, if some peer it could pull from caches anything."""
        fleet = self.fleet
        index = fleet.cluster.prefix_index
        peers = _peers(fleet, instance_id, None, fleet.cluster.get(instance_id).block_size)
        if not any(index.num_blocks(p) for p in peers if p in index):
            fleet.ramp(instance_id)
            return
        fleet.set_draining(instance_id, True)
        task = asyncio.create_task(self._warm(instance_id), name=f"kvherd-warm-up-{instance_id}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _warm(self, instance_id: str) -> None:
        fleet = self.fleet
        try:
            async with asyncio.timeout(self.timeout_s):
                while fleet.cluster.get(instance_id).report_time is None:  # its free blocks
                    await asyncio.sleep(REPORT_POLL_S)
                async with httpx.AsyncClient(timeout=self.timeout_s, trust_env=False) as client:
                    await warm_up(fleet, instance_id, client)
        except TimeoutError:
            log.warning("warm-up of %s took over %.0f s; letting it in", instance_id, self.timeout_s)
        except KeyError:  # it left meanwhile
            return
        finally:
            inst = fleet.instances.get(instance_id)
            if inst is not None and not inst.leaving:
                fleet.set_draining(instance_id, False)
                fleet.ramp(instance_id)
