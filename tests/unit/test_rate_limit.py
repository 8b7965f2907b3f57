"""Per-tenant rate limits (`scheduler.core.rate_limit`, `scheduler.proxy.rate_gate`): the token
buckets' exact accounting under many requests in flight at once (reservations taken before any
completes, corrected at completion), run-time changes, and the 429s and headers the proxy sends."""

from __future__ import annotations

import math
import random

import pytest

from scheduler.core.rate_limit import (
    DEFAULT_OUTPUT_RESERVE,
    REQUESTS,
    TOKENS,
    RateLimiter,
    RateLimits,
    TokenBucket,
    token_cost,
)
from scheduler.core.tenancy import build_registry
from scheduler.metrics import ProxyMetrics
from scheduler.proxy.admission_gate import Refused
from scheduler.proxy.rate_gate import RateGate, _duration


def test_a_bucket_holds_a_minute_and_refills_evenly() -> None:
    bucket = TokenBucket(3, now=0.0)
    assert [bucket.take(0.0, 1) for _ in range(3)] == [0.0, 0.0, 0.0]
    assert bucket.take(0.0, 1) == pytest.approx(20.0)  # one more in 60/3 s
    assert bucket.take(19.9, 1) == pytest.approx(0.1)
    assert bucket.take(20.0, 1) == 0.0
    assert bucket.take(20.0, 4) == math.inf  # more than the whole limit: never
    status = bucket.status(20.0)
    assert (status.limit, status.remaining, status.reset_s) == (3, 0, pytest.approx(60.0))
    assert bucket.status(1000.0).remaining == 3  # never above its capacity


def test_tokens_are_reserved_by_max_tokens_and_settled_by_the_real_count() -> None:
    limiter = RateLimiter()
    limiter.set_limits(0.0, "a", RateLimits(tpm=1000))
    assert token_cost(100, None) == 100 + DEFAULT_OUTPUT_RESERVE
    assert limiter.reserve(0.0, "a", token_cost(100, 400)) is None  # 500 held
    assert limiter.reserve(0.0, "a", 300) is None  # 800 held
    refused = limiter.reserve(0.0, "a", 300)
    assert refused is not None and refused.kind == TOKENS
    assert refused.wait_s == pytest.approx(100 * 60 / 1000)
    limiter.settle(0.0, "a", reserved=500, used=100 + 20)  # it stopped after 20 tokens
    assert limiter.status(0.0, "a")[TOKENS].remaining == 580
    assert limiter.reserve(0.0, "a", 300) is None
    limiter.settle(0.0, "a", reserved=300, used=900)  # the default reserve overdrawn: owed
    assert limiter.status(0.0, "a")[TOKENS].remaining == 0
    owed = limiter.reserve(0.0, "a", 1)
    assert owed is not None and owed.wait_s == pytest.approx(321 * 60 / 1000)
    assert limiter.reserve(0.0, "a", 1001) is not None
    assert limiter.reserve(0.0, "a", 1001).never  # type: ignore[union-attr]
    assert limiter.admit(0.0, "a") is None  # no rpm: requests are not counted
    assert limiter.admit(0.0, "nobody") is None and limiter.status(0.0, "nobody") == {}


def test_no_over_admission_under_concurrent_requests() -> None:
    """Requests arrive in bursts at random, many in flight at once, each completing later. At
    every moment since the start, the requests admitted are at most the rpm bucket plus its
    refill, and the tokens taken (what the finished ones used plus what those in flight hold)
    at most the tpm bucket plus its refill: exactly so with max_tokens named; with the default
    reserve, beyond it by what requests used over their reserve (owed: the level goes below zero
    and the next requests wait until it is repaid). A refusal only while the bucket held too
    little."""
    rng = random.Random(7)
    tpm, rpm = 6000, 40
    for named_max in (True, False):
        limiter = RateLimiter()
        limiter.set_limits(0.0, "t", RateLimits(rpm=rpm, tpm=tpm))
        now, in_flight, admitted, settled, owed = 0.0, [], 0, 0, 0
        for _ in range(3000):
            now += rng.expovariate(20.0)
            for _ in range(rng.randint(1, 8)):  # a burst: all check before any completes
                prompt = rng.randint(10, 400)
                max_tokens = rng.randint(1, 300) if named_max else None
                output = rng.randint(0, max_tokens or 2 * DEFAULT_OUTPUT_RESERVE)
                before = limiter.status(now, "t")
                if limiter.admit(now, "t") is not None:
                    assert before[REQUESTS].remaining < 1
                    continue
                cost = token_cost(prompt, max_tokens)
                if limiter.reserve(now, "t", cost) is not None:
                    limiter.give_back(now, "t", True, 0)
                    assert before[TOKENS].remaining < cost
                    continue
                admitted += 1
                in_flight.append((now + rng.uniform(0, 3), cost, prompt + output))
            for f in [f for f in in_flight if f[0] <= now]:
                in_flight.remove(f)
                limiter.settle(now, "t", f[1], f[2])
                settled += f[2]
                owed += max(0, f[2] - f[1])
            taken = settled + sum(f[1] for f in in_flight)
            refill = now / 60
            assert admitted <= rpm * (1 + refill) + 1e-6
            assert taken <= tpm * (1 + refill) + owed + 1e-6
            assert owed == 0 or not named_max
        # The limits bind: the run was refused often, and used most of what they allow.
        assert admitted > 0.9 * rpm * (1 + now / 60) or taken > 0.9 * tpm * (1 + now / 60)
        assert owed > 0 or named_max


def test_limits_change_at_run_time_and_the_minute_s_use_still_counts() -> None:
    limiter = RateLimiter()
    limiter.set_limits(0.0, "a", RateLimits(rpm=10))
    for _ in range(8):
        assert limiter.admit(0.0, "a") is None
    limiter.set_limits(0.0, "a", RateLimits(rpm=20, tpm=100))
    assert limiter.status(0.0, "a")[REQUESTS].remaining == 12
    assert limiter.status(0.0, "a")[TOKENS].remaining == 100  # new: starts full
    limiter.set_limits(0.0, "a", RateLimits(rpm=5))
    assert limiter.admit(0.0, "a") is not None  # 8 used of 5
    limiter.set_limits(0.0, "a", RateLimits())
    assert limiter.limits("a") is None and limiter.admit(0.0, "a") is None
    with pytest.raises(ValueError, match="positive integers"):
        RateLimits(rpm=0)


def test_the_proxy_refuses_with_openai_s_error_and_headers() -> None:
    registry = build_registry(["k1=a rpm=2 tpm=500", "k2=b"], salt_secret="s")
    gate = RateGate(registry, ProxyMetrics())
    assert gate.admit("b") is None and gate.admit(None) is None  # unlimited: no lease
    first = gate.admit("a")
    assert first is not None
    first.reserve(100, 200)
    headers = dict(first.headers())
    assert headers[b"x-ratelimit-limit-requests"] == b"2"
    assert headers[b"x-ratelimit-remaining-requests"] == b"1"
    assert headers[b"x-ratelimit-remaining-tokens"] == b"200"
    assert headers[b"x-ratelimit-reset-tokens"] == b"36s"
    second = gate.admit("a")
    assert second is not None
    with pytest.raises(Refused) as too_many:
        second.reserve(150, 100)
    assert too_many.value.code == "rate_limit_tokens" and too_many.value.retry_after_s == 6
    assert too_many.value.body()["error"]["type"] == "rate_limit_error"
    assert dict(too_many.value.headers)[b"x-ratelimit-remaining-requests"] == b"1"  # given back
    with pytest.raises(Refused) as never:
        gate.admit("a").reserve(400, 200)  # type: ignore[union-attr]
    assert never.value.code == "request_too_large" and never.value.retry_after_s is None
    first.settle(50)  # 150 used of 300 held
    assert dict(gate.admit("a").headers())[b"x-ratelimit-remaining-tokens"] == b"350"  # type: ignore[union-attr]
    with pytest.raises(Refused) as spent:
        gate.admit("a")
    assert spent.value.code == "rate_limit_requests" and spent.value.retry_after_s == 30
    [a, b] = gate.describe()
    assert (a["tenant"], a["rpm"], a["tpm"], a["remaining"]["requests"]["remaining"]) == (
        "a", 2, 500, 0,
    )  # fmt: skip
    assert (b["rpm"], b["tpm"], b["remaining"]) == (None, None, {})


def test_reset_times_read_as_openai_writes_them() -> None:
    assert [_duration(s) for s in (0.0, 0.0201, 1.0, 1.5, 59.0, 360.0, 61.25)] == [
        "0ms", "21ms", "1s", "1.5s", "59s", "6m0s", "1m1.25s",
    ]  # fmt: skip


def test_the_simulator_s_admission_applies_the_same_limits() -> None:
    """`kvherd sim`'s admission (`SimAdmission`) runs the same buckets: 20 requests a second for
    3 s from a tenant allowed 30 a minute serve 31 (the 30 and one refilled by 2 s), the rest
    refused ``rate_limit_requests``; a tenant allowed 1000 tokens a minute at 96 tokens a
    request serves 10 (the 11th would fit only after 3.3 s)."""
    from policies import load_dispatch_policy
    from scheduler.core.admission import AdmissionSettings
    from simulator.cluster import ClusterConfig, SimCluster
    from simulator.instance import InstanceConfig
    from simulator.latency import load_latency_model
    from simulator.traces import Trace, TraceRequest

    cfg = ClusterConfig(
        num_instances=2,
        instance=InstanceConfig(num_blocks=4096, block_size=16, max_num_seqs=8),
        admission=AdmissionSettings(),
        tenant_limits={"r": RateLimits(rpm=30), "t": RateLimits(tpm=1000)},
    )
    cluster = SimCluster(
        cfg,
        load_latency_model("roofline:llama-2-7b:a100-80gb"),
        load_dispatch_policy("round_robin"),
    )
    requests = [
        TraceRequest(i, i / 40, 64, 32, (2 * i, 2 * i + 1), "r" if i % 2 else "t")
        for i in range(120)
    ]
    cluster.run(Trace("limits", requests, block_size=32, has_prefix_info=True))
    stats = cluster.admission.stats  # type: ignore[union-attr]
    assert stats.refused["rate_limit_requests"] == stats.refused_by_tenant["r"] == 60 - 31
    assert stats.refused["rate_limit_tokens"] == stats.refused_by_tenant["t"] == 60 - 10
