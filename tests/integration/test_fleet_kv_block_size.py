"""The fleet against vLLM-shaped instances: block size learned, mismatches reported, lost history.

Real ZMQ sockets throughout (kvherd's publisher speaks vLLM 0.32's framing and map-form events);
the instances' HTTP side is absent, so load polls fail (and are counted).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import pytest

from instance_agent.kv_publisher import KVEventPublisher
from kvherd.block_hash import block_hash_chain
from kvherd.kv_events import BlockStored, KVEventBatch
from scheduler.fleet import Fleet, FleetError, FleetSettings, InstanceSpec
from scheduler.metrics import ProxyMetrics

TOKENS = list(range(1, 257))


def _vllm_store(seq: int, block_size: int, salt: str | None = None) -> KVEventBatch:
    blocks = len(TOKENS) // block_size
    keys: list[list[object] | None] = [None] * blocks
    if salt:
        keys[0] = [salt]
    event = BlockStored(
        [900 + seq * 10 + i for i in range(blocks)], None, TOKENS, block_size, None, "GPU", None,
        keys,
    )  # fmt: skip
    return KVEventBatch(seq, float(seq), [event])


async def _until(condition: Callable[[], bool], what: str) -> None:
    for _ in range(500):
        if condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"timed out waiting for {what}")


def _vllm_spec(name: str, publisher: KVEventPublisher, **extra: object) -> InstanceSpec:
    return InstanceSpec(
        name,
        "http://127.0.0.1:9",
        publisher.endpoint,
        publisher.replay_endpoint,
        kvherd_agent=False,
        **extra,  # type: ignore[arg-type]
    )


async def test_block_size_is_learned_and_a_mismatch_is_never_silent(
    caplog: pytest.LogCaptureFixture,
) -> None:
    first = KVEventPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*")
    second = KVEventPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*")
    first.publish(_vllm_store(0, 128, salt="tenant"))  # cached before kvherd started
    second.publish(_vllm_store(0, 64))
    metrics = ProxyMetrics()
    fleet = Fleet("kvherd", FleetSettings(load_interval_s=60.0), metrics)
    await fleet.start()
    try:
        with caplog.at_level(logging.WARNING):
            await fleet.add_instance(_vllm_spec("a", first))
            assert fleet.block_size == 16  # nothing known yet
            # Its replayed events say 128: the fleet settles on it and re-reads them.
            await _until(lambda: fleet.block_size == 128, "the learned block size")
            chain = block_hash_chain(TOKENS, 128, "tenant")
            await _until(lambda: fleet.cluster.match(chain, 0.0) == {"a": 2}, "the re-read")
            assert fleet.cluster.match(block_hash_chain(TOKENS, 128), 0.0) == {}
            described = fleet.describe_one("a")
            assert (described["block_size"], described["fleet_block_size"]) == (128, 128)
            assert described["block_size_mismatch"] is None
            # An instance that declares another block size is refused, saying both.
            with pytest.raises(FleetError) as refused:
                await fleet.add_instance(_vllm_spec("c", second, block_size=64))
            assert "64" in refused.value.message and "128" in refused.value.message
            assert "c" not in fleet.instances
            # One that only shows it in its events is reported once and routed approximately.
            await fleet.add_instance(_vllm_spec("b", second))
            await _until(lambda: fleet.instances["b"].block_size == 64, "b's block size")
            second.publish(_vllm_store(1, 64))
            await _until(
                lambda: (fleet.subscriber.stats("b") or {}).get("last_seq") == 1, "b's events"
            )
        mismatch = fleet.describe_one("b")["block_size_mismatch"]
        assert mismatch == {
            "instance_block_size": 64,
            "fleet_block_size": 128,
            "source": "its KV events",
        }
        assert fleet.describe_one("b")["kv_events"]["fallback"] is not None
        warned = [r for r in caplog.records if "block size 64" in r.getMessage()]
        assert len(warned) == 1 and warned[0].levelno == logging.WARNING
        assert b'kvherd_block_size_mismatch{instance="b"} 64.0' in metrics.render()
        assert fleet.cluster.prefix_index.num_blocks("b") == 0  # never indexed at the wrong size
    finally:
        await fleet.stop()
        first.close()
        second.close()


async def test_lost_history_falls_back_to_the_approximate_index() -> None:
    publisher = KVEventPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", buffer_steps=2)
    for seq in range(4):
        publisher.publish(_vllm_store(seq, 16))
    metrics = ProxyMetrics()
    fleet = Fleet("kvherd", FleetSettings(block_size=16, load_interval_s=60.0), metrics)
    await fleet.start()
    try:
        await fleet.add_instance(_vllm_spec("a", publisher))
        await _until(lambda: fleet.instances["a"].kv_fallback is not None, "the fallback")
        assert "0..1" in (fleet.instances["a"].kv_fallback or "")
        assert b'kvherd_kv_history_lost_total{instance="a"} 1.0' in metrics.render()
        # Routed chains now count whole, with the approximate TTL, as for an instance without
        # events; what the replay still had stays in the precise index.
        chain = block_hash_chain([7] * 64, 16)
        key = fleet.new_key("r")
        fleet.dispatch(key, 64, chain)
        assert fleet.cluster.approx_index.num_blocks("a") == 4
        assert fleet.cluster.match(chain, fleet.clock() + 60.0) == {"a": 4}
        # A re-join starts over (a new record, a new resync), and says so again.
        await fleet.add_instance(_vllm_spec("a", publisher))
        await _until(
            lambda: b'kvherd_kv_history_lost_total{instance="a"} 2.0' in metrics.render(),
            "the second report",
        )
        assert fleet.instances["a"].kv_fallback is not None
    finally:
        await fleet.stop()
        publisher.close()


def test_instance_options_for_vllm_topologies_and_block_size() -> None:
    from scheduler.serve_cli import parse_instance_spec

    assert parse_instance_spec("http://h:1,kv_events_bind=tcp://127.0.0.1:5557,block_size=128") == {
        "url": "http://h:1",
        "kv_events_bind": "tcp://127.0.0.1:5557",
        "block_size": 128,
    }
    assert (
        parse_instance_spec("http://h:1,topic=engine-1,replay=tcp://h:2")["kv_topic"] == "engine-1"
    )
    for bad in (
        "http://h:1,block_size=0",
        "http://h:1,kv_events=tcp://a:1,kv_events_bind=tcp://a:2",
    ):
        with pytest.raises(ValueError):
            parse_instance_spec(bad)
