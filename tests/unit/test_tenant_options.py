"""Tenants' options in key specs (weight, priority): parsed, checked (a bad option is a
clear error, and ``kvherd serve`` exits 2 on it), shared by a tenant's keys; the fair share they
weight (`scheduler.core.fair_share`); and the priority a request names (400 when it is not an int)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvherd.cli import main
from kvherd.wire import OpenAIError
from scheduler.core.fair_share import TenantShares
from scheduler.core.tenancy import KeySpec, TenantOptions, build_registry, parse_key_spec
from scheduler.proxy.routed_request import parse_priority_header, resolve_priority


def test_options_follow_the_key_and_tenant() -> None:
    full = TenantOptions(weight=2.0, priority=1)
    assert parse_key_spec("k1 alice weight=2 priority=1") == KeySpec("k1", "alice", full)
    assert parse_key_spec("k1=alice priority=-3") == KeySpec(
        "k1", "alice", TenantOptions(priority=-3)
    )
    assert parse_key_spec("k1 weight=0.5") == KeySpec("k1", None, TenantOptions(weight=0.5))


@pytest.mark.parametrize(
    "spec",
    ["k t weight=0", "k t weight=inf", "k t colour=red", "k t priority=x", "k t rpm=0",
     "k t tpm=1.5", "k t rpm=-5", "k t rpm=1 rpm=2",
     "k t priority=1.5", "k t weight=1 weight=2", "k t extra"],
)  # fmt: skip
def test_a_bad_option_is_a_clear_error(spec: str) -> None:
    with pytest.raises(ValueError, match="bad API key spec"):
        parse_key_spec(spec)


def test_a_tenant_s_keys_share_its_options_and_may_not_differ() -> None:
    registry = build_registry(["a1=alice", "a2=alice weight=3", "b=bob"], salt_secret="s")
    one, two = registry.authenticate(b"Bearer a1"), registry.authenticate(b"Bearer a2")
    assert one is not None and two is not None and one == two and one.options.weight == 3
    assert registry.weight("alice") == 3 and registry.weight("bob") == 1
    with pytest.raises(ValueError, match="different options"):
        build_registry(["a1=alice weight=2", "a2=alice weight=3"], salt_secret="s")


def test_serve_exits_2_on_a_bad_keys_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    keys = tmp_path / "keys"
    keys.write_text("k1 alice weight=2\nk2 bob weight=-1\n")
    code = main(["serve", "--admin-token", "t", "--api-keys-file", str(keys)])
    assert code == 2
    err = capsys.readouterr().err
    assert f"{keys}:2" in err and "weight must be > 0" in err


def test_a_tenant_within_its_share_is_told_apart_from_one_over_it() -> None:
    shares = TenantShares(lambda t: 2.0 if t == "big" else 1.0, reserve=0.25)
    for _ in range(10):
        shares.admitted("flood")
    assert not shares.within_share("flood")  # alone: the ordinary rule
    assert shares.within_share("quiet") and shares.within_share("big")
    shares.admitted("quiet")
    assert shares.within_share("quiet") and not shares.within_share("flood")
    # Over its share, the flooder leaves the last quarter of the slots (at least one) free.
    assert shares.may_start("flood", free=3, slots=8) and not shares.may_start("flood", 2, 8)
    assert shares.may_start("quiet", free=1, slots=8) and shares.may_start(None, 0, 8)
    shares.finished("quiet")
    assert shares.may_start("flood", free=1, slots=8)  # alone again: idle share is all lent
    for _ in range(10):
        shares.finished("flood")
    shares.finished("flood")  # more than admitted: a no-op
    assert shares.active("flood") == 0


def test_the_priority_header_and_the_tenant_default() -> None:
    assert parse_priority_header(b" -2 ") == -2
    for bad in (b"high", b"1.5", b"", b"9" * 30):
        with pytest.raises(OpenAIError) as raised:
            parse_priority_header(bad)
        assert raised.value.status == 400
    tenant = build_registry(["k=alice priority=3"], salt_secret="s").authenticate(b"Bearer k")
    assert resolve_priority(None, tenant) == 3 and resolve_priority(1, tenant) == 1
    assert resolve_priority(None, None) == 0
