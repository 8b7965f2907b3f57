"""Control messages survive JSON round trips, and bad input names the offending field."""

from __future__ import annotations

import json
from typing import Any

import pytest

from migration.core.protocol import (
    AbortReason,
    CommitRequest,
    MessageError,
    MigrateOrder,
    MigrationOutcome,
    MigrationStatus,
    RequestState,
    ReserveRequest,
    ReserveResponse,
    TransportEndpoint,
)


def _state() -> RequestState:
    return RequestState(
        request_id="r1",
        prompt_token_ids=[1, 2, 3, 4, 5],
        output_token_ids=[9, 8],
        sampling_params={"max_tokens": 10, "temperature": 0.7, "seed": 3},
        sampling_seed=3,
        num_computed_tokens=6,
        cache_salt="tenant-a",
        eos_token_id=2,
    )


def _wire(data: dict[str, Any]) -> Any:
    return json.loads(json.dumps(data))


def test_messages_round_trip_through_json() -> None:
    state = _state()
    assert RequestState.from_json(_wire(state.to_json())) == state
    commit = CommitRequest("m1", state)
    assert CommitRequest.from_json(_wire(commit.to_json())) == commit
    reserve = ReserveRequest("m1", "r1", "http://a:1", 0, 3, [1, 2**64 - 1])
    assert ReserveRequest.from_json(_wire(reserve.to_json())) == reserve
    answer = ReserveResponse(True, [4, 5], 1, TransportEndpoint("127.0.0.1", 29500, "g", 7))
    assert ReserveResponse.from_json(_wire(answer.to_json())) == answer
    outcome = MigrationOutcome(
        "m1", "r1", MigrationStatus.ABORTED, AbortReason.DST_REFUSED, stages=2, downtime_s=0.01
    )
    wire = _wire(outcome.to_json())
    assert wire["status"] == "aborted" and wire["reason"] == "dst_refused"
    assert MigrationOutcome.from_json(wire) == outcome


@pytest.mark.parametrize(
    ("cls", "data", "param"),
    [
        (MigrateOrder, {"request_id": "r"}, "dst"),
        (MigrateOrder, {"request_id": "", "dst": "http://x"}, "request_id"),
        (MigrateOrder, {"request_id": "r", "dst": "ftp://x"}, "dst"),
        (MigrateOrder, {"request_id": 5, "dst": "http://x"}, "request_id"),
        (MigrateOrder, {"request_id": "r", "dst": "http://x", "extra": 1}, "extra"),
        (
            ReserveRequest,
            {"migration_id": "m", "request_id": "r", "src": "s", "stage": -1, "num_blocks": 1},
            "stage",
        ),
        (
            ReserveRequest,
            {"migration_id": "m", "request_id": "r", "src": "s", "stage": 0, "num_blocks": True},
            "num_blocks",
        ),
        (
            ReserveRequest,
            {
                "migration_id": "m",
                "request_id": "r",
                "src": "s",
                "stage": 0,
                "num_blocks": 1,
                "block_hashes": [2**64],
            },
            "block_hashes",
        ),
        (
            ReserveRequest,
            {
                "migration_id": "m",
                "request_id": "r",
                "src": "s",
                "stage": 0,
                "num_blocks": 1,
                "block_hashes": ["a"],
            },
            "block_hashes",
        ),
        (CommitRequest, {"migration_id": "m", "state": []}, None),
        (CommitRequest, {"migration_id": "m", "state": {"request_id": "r"}}, "prompt_token_ids"),
    ],
)
def test_bad_messages_name_the_field(cls: Any, data: Any, param: str | None) -> None:
    with pytest.raises(MessageError) as err:
        cls.from_json(data)
    assert err.value.param == param


def test_state_rejects_impossible_progress() -> None:
    data = _state().to_json()
    for impossible in (0, 7, 8):  # 7 tokens: KV for 1..6 of them leaves one to compute
        data["num_computed_tokens"] = impossible
        with pytest.raises(MessageError, match="num_computed_tokens"):
            RequestState.from_json(data)
    assert _state().num_tokens == 7


def test_non_object_body_is_refused() -> None:
    with pytest.raises(MessageError, match="JSON object"):
        MigrateOrder.from_json(["r", "http://x"])
