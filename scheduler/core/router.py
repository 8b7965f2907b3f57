"""The scheduler core's entry point: request -> views -> policy -> decision -> optimistic charge.

Contract:
- `Router.route(request_id, token_ids=..., now=...)` hashes the prompt's full blocks with kvherd's
  `block_hash_chain` (tenant salt folded in), builds the `ClusterView`, asks the dispatch policy,
  charges the chosen instance at once (so a burst spreads before any load report arrives), records
  the chain in the approximate index, and returns a `Routed` (decision, request view, matched
  blocks, the blocks its KV events claim, for `scheduler.core.cache_truth`). Callers that
  already hashed pass `block_hashes` and `num_tokens` instead of tokens.
  The charge's prefill tokens leave out the prefix cached on any tier (lower tiers load it).
- Lifecycle: `on_first_token` (prefill done), `on_finish` (completed or aborted), `on_migrated`
  (the request now lives on another instance). Unknown request ids are ignored (a late event after
  an instance left must not crash the proxy). A retry calls `on_finish` and routes again with the
  failed instance in `exclude`.
- P/D disaggregation: with a `pd_policy` and a fleet where some instance only prefills or only
  decodes (`ClusterState.disaggregated`), the P/D policy pairs the request instead: the decision
  names the prefill instance (charged like any dispatch) and `Routed.decode_id` the instance to
  hand the request to after its first token (None: no handoff). When either phase has no
  candidate left (e.g. the prefill instance failed and is excluded), the dispatch policy chooses
  among what is left and the request runs there entirely. The decode instance counts the request
  as incoming from the pairing on (`InstanceState.incoming`) until `on_migrated` moves it there,
  `on_handoff_failed` says it stays where it was prefilled, or it ends.
- Cross-instance prefix pull (`pull`: `scheduler.core.prefix_pull.PullSettings`; None: off): a
  dispatch policy's pick (never a P/D pairing) is checked against the holder of a deeper prefix
  (`choose_pull`): ROUTE sends the request to the holder, PULL keeps it where the policy chose and
  charges it as cached up to the source's end; `Routed.pull` keeps the choice whenever a
  holder was worth a look, and the driver moves a PULL's blocks before the prefill. `peers`
  (`scheduler.core.prefix_pull.PullPeer` by instance id; None: all kvherd agents) says which
  instances can send blocks, of which kind and from which tiers: the rule picks no other.
- Models: `only` (a `scheduler.core.model_index.ModelIndex` answer) limits the view, and so every
  policy, to the instances that serve the request's model; `adapter` names its LoRA adapter
  (`RequestView.adapter`, counted on the chosen instance while in flight); `block_size` the
  model's (its chain's blocks; None: the cluster's); `slo_ttft_s` the TTFT the client asked for
  (`RequestView.slo_ttft_s`, for policies that route by predicted TTFT).
- Slow start (`slow_start`, `scheduler.core.slow_start`; off by default): an instance ramping in
  (`SlowStart.joined`) is left out of a request's candidates while its requests in flight reach
  its ramped share of its batch slots, unless no other candidate has a free batch slot.
- `choose(request, now, only)` asks the dispatch policy without routing (no charge, no record).
- `NoInstanceError` when nothing is dispatchable. Pure: times are arguments, no I/O or threads;
  the proxy and the simulator drive the same object.

Usage::

    from policies import load_dispatch_policy
    from scheduler.core.cluster_state import ClusterState
    from scheduler.core.load_report import parse_agent_state
    from scheduler.core.router import Router

    cluster = ClusterState(block_size=16)
    cluster.add_instance("a", has_kv_events=True)    # -> ResyncRequest: replay events from 0
    cluster.add_instance("b")                         # no events: approximate index
    cluster.apply_report("a", parse_agent_state(state_json), now=0.0)
    router = Router(cluster, load_dispatch_policy("kvherd"))
    routed = router.route("req-1", token_ids=prompt_ids, cache_salt=tenant_salt, now=0.01)
    routed.decision.instance_id        # where to forward; routed.decision.explain() for logs
    router.on_first_token("req-1", now=0.2)
    router.on_finish("req-1", now=1.5)
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

from kvherd.block_hash import block_hash_chain
from policies.base import DispatchPolicy, PDPolicy
from policies.views import (
    ClusterView,
    Decision,
    NoInstanceError,
    PDDecision,
    RequestView,
)
from scheduler.core.cluster_state import ClusterState
from scheduler.core.instance_state import Dispatch
from scheduler.core.prefix_pull import PullAction, PullChoice, PullPeer, PullSettings, choose_pull
from scheduler.core.slow_start import SlowStart


@dataclass(frozen=True, slots=True)
class Routed:
    decision: Decision
    request: RequestView
    matched_blocks: int  # leading blocks the chosen instance caches, as the index believes
    decode_id: str | None = None  # P/D: hand the request to this instance after its first token
    pull: PullChoice | None = None  # the prefix-pull choice, where a holder was worth a look
    tier_blocks: tuple[int, ...] = ()  # its hits per tier (`policies.views.TIERS`), when tiered
    claimed_blocks: int | None = None  # leading blocks its KV events say it holds (None: no events)

    @property
    def instance_id(self) -> str:
        return self.decision.instance_id


class Router:
    def __init__(
        self,
        cluster: ClusterState,
        policy: DispatchPolicy,
        pd_policy: PDPolicy | None = None,
        pull: PullSettings | None = None,
        peers: Callable[[str], PullPeer] | None = None,
        slow_start: SlowStart | None = None,
    ) -> None:
        self.cluster = cluster
        self.policy = policy
        self.pd_policy = pd_policy
        self.pull = pull
        self.peers = peers
        self.slow_start = SlowStart() if slow_start is None else slow_start
        self._where: dict[str, str] = {}  # request id -> instance id
        self._decode_of: dict[str, str] = {}  # request id -> its decode instance, until handed

    def set_policy(self, policy: DispatchPolicy) -> None:
        """Switch the dispatch policy; in-flight accounting is kept."""
        self.policy = policy

    def instance_of(self, request_id: str) -> str | None:
        return self._where.get(request_id)

    def route(
        self,
        request_id: str,
        token_ids: Sequence[int] | None = None,
        *,
        now: float,
        num_tokens: int | None = None,
        block_hashes: Sequence[int] | None = None,
        cache_salt: str | None = None,
        tenant: str | None = None,
        priority: int = 0,
        max_tokens: int | None = None,
        exclude: Collection[str] = (),
        only: frozenset[str] | None = None,
        adapter: str | None = None,
        block_size: int | None = None,
        slo_ttft_s: float | None = None,
    ) -> Routed:
        if request_id in self._where:
            raise ValueError(f"request {request_id!r} is already routed; finish it first")
        if block_size is None:
            block_size = self.cluster.block_size
        if block_hashes is None:
            if token_ids is None:
                raise ValueError("route() needs token_ids, or block_hashes and num_tokens")
            block_hashes = block_hash_chain(
                token_ids, block_size, cache_salt, self.cluster.hash_algo
            )
        if num_tokens is None:
            if token_ids is None:
                raise ValueError("num_tokens is required with precomputed block_hashes")
            num_tokens = len(token_ids)
        request = RequestView(
            request_id,
            num_tokens,
            tuple(block_hashes),
            block_size,
            tenant,
            priority,
            max_tokens,
            adapter,
            slo_ttft_s,
        )
        if self.slow_start.ramping:
            exclude = self._ramped(now, exclude, only)
        view = self.cluster.view(now, exclude, only)
        pair = self._pair(request, view, exclude)
        pull = None
        if pair is None:
            decision = self.policy.choose(request, view)
            decode_id = None
            if self.pull is not None:
                pull = choose_pull(request, view, decision.instance_id, self.pull, self.peers)
                if not pull.estimates:
                    pull = None
                elif pull.action is PullAction.ROUTE:
                    decision = Decision(pull.instance_id, decision.scores, pull.reason)
        else:
            decision = Decision(pair.prefill, reason=pair.reason)
            decode_id = pair.decode if pair.disaggregated else None
        if (
            decision.instance_id not in self.cluster
            or decision.instance_id in exclude
            or (only is not None and decision.instance_id not in only)
        ):
            raise ValueError(
                f"policy {self.policy.name!r} chose {decision.instance_id!r}, not a candidate"
            )
        matched = view.prefix_match_of(request, decision.instance_id)
        cached = matched
        tier_blocks: tuple[int, ...] = ()
        if self.cluster.prefix_index.has_lower_tiers():  # lower-tier hits load, never prefill
            column = view.prefix_match_tiers(request)[:, view.index_of(decision.instance_id)]
            tier_blocks = tuple(int(n) for n in column)
            cached = sum(tier_blocks)
        if pull is not None and pull.action is PullAction.PULL:  # cached once the pull lands
            cached = pull.first_block + pull.num_blocks
        cached_tokens = min(num_tokens, cached * block_size)
        faced = view.ttft_inputs(request, view[decision.instance_id], cached_tokens)
        self.cluster.ttft.dispatched(request_id, decision.instance_id, *faced, now)
        state = self.cluster.get(decision.instance_id)
        state.dispatch(request_id, num_tokens, num_tokens - cached_tokens, now, adapter)
        self.cluster.touch(decision.instance_id)
        self.cluster.note_routed(decision.instance_id, request.block_hashes, now, matched)
        self._where[request_id] = decision.instance_id
        if decode_id is not None:
            self._decode_of[request_id] = decode_id
            self.cluster.get(decode_id).incoming.add(request_id)
            self.cluster.touch(decode_id)
        claimed = None  # a P/D pair's prefill instance is not where its answer comes from
        if decode_id is None:
            claimed = self.cluster.claimed_depth(request.block_hashes, decision.instance_id)
        return Routed(decision, request, matched, decode_id, pull, tier_blocks, claimed)

    def choose(self, request: RequestView, now: float, only: frozenset[str] | None) -> Decision:
        """The dispatch policy's pick among `only`, charging nothing (where to load an adapter
        before the request is routed there)."""
        return self.policy.choose(request, self.cluster.view(now, (), only))

    def _pair(
        self, request: RequestView, view: ClusterView, exclude: Collection[str]
    ) -> PDDecision | None:
        """The P/D policy's pairing, or None when the dispatch policy decides alone."""
        if self.pd_policy is None or not self.cluster.disaggregated:
            return None
        try:
            pair = self.pd_policy.pair(request, view)
        except NoInstanceError:
            return None  # a phase has no instance left: the request runs where it is placed
        for chosen in (pair.prefill, pair.decode):
            if chosen not in self.cluster or chosen in exclude:
                raise ValueError(
                    f"P/D policy {self.pd_policy.name!r} chose {chosen!r}, not a candidate"
                )
        return pair

    def on_first_token(self, request_id: str, now: float) -> None:
        self.cluster.ttft.first_token(request_id, now)
        instance_id = self._where.get(request_id)
        if (
            instance_id is not None
            and instance_id in self.cluster
            and self.cluster.get(instance_id).first_token(request_id, now)
        ):
            self.cluster.touch(instance_id)

    def on_finish(self, request_id: str, now: float) -> None:
        """Completed or aborted: release the request's charges."""
        self._release(request_id, now)

    def on_migrated(self, request_id: str, dst: str, now: float) -> None:
        """A live migration committed: the request's charges move to `dst`."""
        self.on_handoff_failed(request_id)
        dispatch = self._release(request_id, now)
        if dispatch is not None and dst in self.cluster:
            self.cluster.get(dst).adopt(dispatch, now)
            self.cluster.touch(dst)
            self._where[request_id] = dst

    def _ramped(
        self, now: float, exclude: Collection[str], only: frozenset[str] | None
    ) -> Collection[str]:
        """`exclude` and the ramping instances at their share, while some other candidate has a
        free batch slot (a ramp never queues a request behind full instances)."""
        view = self.cluster.view(now, exclude, only)

        def requests(instance_id: str) -> int:
            return view[instance_id].inflight if instance_id in view else 0

        def slots(instance_id: str) -> int:
            return view[instance_id].batch_slots if instance_id in view else 0

        held = self.slow_start.held(now, requests, slots).difference(exclude)
        if not held:
            return exclude
        default_slots = self.slow_start.settings.default_slots
        for inst in view.dispatchable:  # excluded ones and those of other models are not
            if inst.instance_id not in held and inst.inflight < (inst.batch_slots or default_slots):
                return {*exclude, *held}
        return exclude

    def on_handoff_failed(self, request_id: str) -> None:
        """The request's P/D handoff is off (it decodes where it was prefilled), or done."""
        decode_id = self._decode_of.pop(request_id, None)
        if decode_id is not None and decode_id in self.cluster:
            self.cluster.get(decode_id).incoming.discard(request_id)
            self.cluster.touch(decode_id)

    def forget_instance(self, instance_id: str) -> list[str]:
        """Remove an instance; returns the requests that were in flight there."""
        orphans = self.cluster.remove_instance(instance_id)
        self.slow_start.left(instance_id)
        for request_id in orphans:
            self._where.pop(request_id, None)
        return orphans

    def _release(self, request_id: str, now: float) -> Dispatch | None:
        self.on_handoff_failed(request_id)
        self.cluster.ttft.discard(request_id)
        instance_id = self._where.pop(request_id, None)
        if instance_id is None or instance_id not in self.cluster:
            return None
        dispatch = self.cluster.get(instance_id).finish(request_id, now)
        self.cluster.touch(instance_id)
        return dispatch
