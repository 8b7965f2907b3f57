"""The online TTFT model: recovers the weights of the engines it watches, never negative ones,
predicts from the fleet's fit until an instance has its own, and reports its honest error."""

from __future__ import annotations

import itertools
import random

import numpy as np
import pytest

from kvherd.block_hash import block_hash_chain
from kvherd.kv_events import BlockStored, KVEventBatch
from policies import load_dispatch_policy
from policies.views import Decision
from scheduler.core.cluster_state import ClusterState
from scheduler.core.router import Router
from scheduler.core.ttft_model import TERMS, TtftModel, TtftSettings, features, nnls

TRUE = (0.02, 0.05, 0.05, 0.001, 0.002, 0.004)  # base s, s per k-token uncached / queued, ...


def _ttft(w: tuple[float, ...], uncached: int, queued: int, running: int, host: int = 0) -> float:
    return sum(a * b for a, b in zip(w, features(uncached, queued, running, host), strict=True))


def _feed(model: TtftModel, instance: str, w: tuple[float, ...], n: int, seed: int) -> None:
    rng = random.Random(seed)
    now = 0.0
    for k in range(n):
        uncached, queued, running = rng.randrange(4096), rng.randrange(8192), rng.randrange(64)
        host = rng.randrange(32)
        rid = f"{instance}-{k}"
        model.dispatched(rid, instance, uncached, queued, running, host, now)
        ttft = _ttft(w, uncached, queued, running, host) * rng.uniform(0.95, 1.05)
        assert model.first_token(rid, now + ttft) == pytest.approx(ttft)
        now += 1.0


def test_recovers_the_engines_weights_and_reports_its_quality() -> None:
    model = TtftModel()
    assert model.predict("a", 1000, 0, 0) is None  # nothing learned yet
    _feed(model, "a", TRUE, 400, seed=1)
    coef = model.coefficients("a")
    assert coef is not None and len(coef) == len(TERMS)
    expected = _ttft(TRUE, 2000, 1000, 8, 5)
    assert model.predict("a", 2000, 1000, 8, 5) == pytest.approx(expected, rel=0.05)
    quality = model.quality("a")
    assert quality.r2 > 0.98
    assert quality.error_ratio < 0.06  # the noise is +-5%: predictions made before each TTFT
    assert quality.predicted > 200 and quality.samples == 256


def test_weights_are_never_negative() -> None:
    model = TtftModel()
    # TTFT falls with the running requests in this data: the fit drops the term, not negates it.
    rng = random.Random(2)
    for k in range(200):
        uncached, running = rng.randrange(4096), rng.randrange(32)
        model.dispatched(str(k), "a", uncached, 0, running, 0, 0.0)
        model.first_token(str(k), max(0.001, 0.05 * uncached / 1000 - 0.002 * running))
    coef = model.coefficients("a")
    assert coef is not None and min(coef) >= 0.0


def test_a_new_instance_is_predicted_by_the_fleet_until_it_has_its_own_fit() -> None:
    model = TtftModel(TtftSettings(min_samples=16))
    _feed(model, "a", TRUE, 100, seed=3)
    assert model.coefficients("b") == model.coefficients("nobody")
    slow = tuple(2 * w for w in TRUE)
    _feed(model, "b", slow, 200, seed=4)
    fast, twice = model.predict("a", 2000, 0, 4, 16), model.predict("b", 2000, 0, 4, 16)
    assert fast is not None and twice is not None and twice == pytest.approx(2 * fast, rel=0.1)


def test_discarded_and_unknown_requests_are_not_observed() -> None:
    model = TtftModel()
    model.dispatched("r", "a", 100, 0, 0, 0, 0.0)
    model.discard("r")
    assert model.first_token("r", 1.0) is None
    assert model.first_token("never", 1.0) is None
    model.dispatched("s", "a", 100, 0, 0, 0, 0.0)
    model.remove_instance("a")
    assert model.first_token("s", 1.0) is None
    assert model.quality("a").samples == 0


def test_settings_are_checked() -> None:
    with pytest.raises(ValueError):
        TtftSettings(window=1)
    with pytest.raises(ValueError):
        TtftSettings(min_samples=300)


def test_nnls_is_the_best_non_negative_fit() -> None:
    rng = np.random.default_rng(0)
    for _ in range(100):
        x, y = rng.normal(size=(40, 6)), rng.normal(size=40)
        w = nnls(x.T @ x, x.T @ y)
        assert w.min() >= 0.0
        best = np.inf  # every subset's least squares that came out non-negative
        for k in range(1, 7):
            for subset in itertools.combinations(range(6), k):
                ws = np.linalg.lstsq(x[:, list(subset)], y, rcond=None)[0]
                if ws.min() >= 0.0:
                    full = np.zeros(6)
                    full[list(subset)] = ws
                    best = min(best, float(np.square(x @ full - y).sum()))
        assert float(np.square(x @ w - y).sum()) <= best + 1e-9


def _slo_fleet(**params: object) -> tuple[ClusterState, Router, list[int]]:
    """a holds the prompt's prefix, b does not; a was learned slow (about 1 s), b fast."""
    cluster = ClusterState(block_size=16)
    for name in ("a", "b"):
        cluster.add_instance(name, has_kv_events=True, trust_engine_hashes=True)
    router = Router(cluster, load_dispatch_policy("kvherd", **params))
    prefix = [(7 * k) % 30000 for k in range(640)]
    chain = block_hash_chain(prefix, 16)
    cluster.apply_kv_batch("a", KVEventBatch(0, 0.0, [BlockStored(chain, None, prefix, 16)]))
    return cluster, router, prefix


def _learn(router: Router, seconds: dict[str, float], n: int = 32) -> None:
    now = 0.0
    for k in range(n):
        for name, ttft in seconds.items():
            other = {"a": "b", "b": "a"}[name]
            rid = f"learn-{name}-{k}"
            router.route(
                rid, [(k * 13 + j) % 30000 + 1 for j in range(32)], now=now, exclude={other}
            )
            router.on_first_token(rid, now + ttft)
            router.on_finish(rid, now + ttft)
            now += 2.0


def _routed(router: Router, prompt: list[int], now: float, slo: float | None) -> Decision:
    routed = router.route("probe", prompt, now=now, slo_ttft_s=slo)
    router.on_finish("probe", now)
    return routed.decision


def test_a_ttft_slo_moves_a_request_off_an_instance_predicted_too_slow() -> None:
    _, router, prefix = _slo_fleet()
    prompt = [*prefix, 1, 2, 3]
    assert _routed(router, prompt, 0.0, None).instance_id == "a"  # the prefix attracts it
    assert _routed(router, prompt, 0.0, 0.5).instance_id == "a"  # nothing learned yet
    _learn(router, {"a": 1.0, "b": 0.1})
    now = 1000.0
    assert _routed(router, prompt, now, None).instance_id == "a"
    assert _routed(router, prompt, now, 5.0).instance_id == "a"  # a meets it
    moved = _routed(router, prompt, now, 0.5)
    assert moved.instance_id == "b" and "within the TTFT SLO" in moved.reason
    missed = _routed(router, prompt, now, 0.01)  # neither does: the soonest
    assert missed.instance_id == "b" and "none predicted" in missed.reason


def test_learned_cost_takes_the_soonest_predicted_once_it_can_predict() -> None:
    _, router, prefix = _slo_fleet(learned_cost=True)
    prompt = [*prefix, 1, 2, 3]
    assert _routed(router, prompt, 0.0, None).instance_id == "a"  # the formula, until learned
    _learn(router, {"a": 1.0, "b": 0.1})
    soonest = _routed(router, prompt, 1000.0, None)
    assert soonest.instance_id == "b" and "soonest predicted" in soonest.reason


def test_host_requests_counts_the_requests_of_the_instances_sharing_a_host() -> None:
    cluster = ClusterState(block_size=16)
    for name, host in (("a", "n1"), ("b", "n1"), ("c", "n2"), ("d", None)):
        cluster.add_instance(name, host=host)
    running = {"a": 2, "b": 3, "c": 4, "d": 5}
    for name, n in running.items():
        for k in range(n):
            cluster.get(name).dispatch(f"{name}{k}", 16, 16, 0.0)
    view = cluster.view(0.0)
    assert {i: view.host_requests(i) for i in running} == {"a": 3, "b": 2, "c": 0, "d": 0}


def test_learned_cost_keeps_to_one_instance_of_a_host_whose_instances_slow_each_other() -> None:
    """Two instances on one machine (two CPU engines on shared cores): each one's TTFT grows
    with what runs on the other far more than with what runs on itself. Once that is learned,
    a request goes where requests already run, not to the idle host-mate."""
    cluster = ClusterState(block_size=16)
    for name in ("a", "b"):
        cluster.add_instance(name, host="127.0.0.1")
    router = Router(cluster, load_dispatch_policy("kvherd", learned_cost=True))
    rng = random.Random(5)
    now = 0.0
    for k in range(64):  # observations with both loaded in turn: 10 ms per own, 80 per mate's
        name = "ab"[k % 2]
        own, mate = rng.randrange(4), rng.randrange(4)
        rid = f"learn-{k}"
        router.cluster.ttft.dispatched(rid, name, 500, 0, own, mate, now)
        router.cluster.ttft.first_token(rid, now + 0.03 + 0.01 * own + 0.08 * mate)
        now += 1.0
    cluster.get("a").dispatch("busy", 16, 16, now)  # a runs one request, b none
    routed = router.route("probe", [(3 * j) % 30000 + 1 for j in range(64)], now=now)
    assert routed.decision.instance_id == "a" and "soonest predicted" in routed.decision.reason
