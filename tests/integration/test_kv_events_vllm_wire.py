"""KV events as vLLM 0.32 puts them on the wire: bytes, replay framing, both topologies, salts.

The byte fixtures below were written by vLLM 0.32's own encoder (msgspec, `KVEventBatch` of
`BlockStored` / `BlockRemoved` / `AllBlocksCleared`); the last test drives vLLM's own
`ZmqEventPublisher` when a vLLM installation is named by $KVHERD_VLLM_PYTHON (default: the
project's /work/venvs/vllm), and says why it skipped otherwise.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
import zmq
import zmq.asyncio
from agent_process import free_port

from instance_agent.kv_publisher import KVEventPublisher
from kvherd.block_hash import block_hash_chain
from kvherd.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    decode_batch,
    encode_batch,
)
from scheduler.core.cluster_state import ClusterState
from scheduler.core.prefix_index import PrefixIndex
from scheduler.kv_subscriber import KVEventSubscriber

# vLLM 0.32: a salted two-block prompt (extra_keys [["abc"], None], group_idx and
# kv_cache_spec_kind set), its one-block extension, a removal and a clear, data-parallel rank 0.
VLLM_SALTED_BATCH = bytes.fromhex(
    "93cb41dac3a1bc8da365948ba474797065ab426c6f636b53746f726564ac626c6f636b5f68617368657392cf9e716a"
    "78da30cd66cfec0980d436a86eebb1706172656e745f626c6f636b5f68617368c0a9746f6b656e5f6964739801cd02"
    "73cd024bcd0253cd0278cd018ccd022bcd010baa626c6f636b5f73697a6504a76c6f72615f6964c0a66d656469756d"
    "a3475055a96c6f72615f6e616d65c0aa65787472615f6b6579739291a3616263c0a967726f75705f69647800b26b76"
    "5f63616368655f737065635f6b696e64ae66756c6c5f617474656e74696f6e8ba474797065ab426c6f636b53746f72"
    "6564ac626c6f636b5f68617368657391cf04e7aec9176d62b1b1706172656e745f626c6f636b5f68617368cfec0980"
    "d436a86eeba9746f6b656e5f69647394cd0194cd018f11cd027faa626c6f636b5f73697a6504a76c6f72615f6964c0"
    "a66d656469756da3475055a96c6f72615f6e616d65c0aa65787472615f6b65797391c0a967726f75705f69647800b2"
    "6b765f63616368655f737065635f6b696e64ae66756c6c5f617474656e74696f6e84a474797065ac426c6f636b5265"
    "6d6f766564ac626c6f636b5f68617368657391cf04e7aec9176d62b1a66d656469756da3475055a967726f75705f69"
    "64780081a474797065b0416c6c426c6f636b73436c656172656400"
)
# vLLM 0.32: BlockStored([5, 6], None, [1..8], 4, medium "GPU"), no extra keys given (so omitted),
# BlockRemoved([5], "GPU"), AllBlocksCleared, ts 1.5, rank 0.
VLLM_PLAIN_BATCH = bytes.fromhex(
    "93cb3ff80000000000009388a474797065ab426c6f636b53746f726564ac626c6f636b5f686173686573920506b170"
    "6172656e745f626c6f636b5f68617368c0a9746f6b656e5f696473980102030405060708aa626c6f636b5f73697a65"
    "04a76c6f72615f6964c0a66d656469756da3475055a96c6f72615f6e616d65c083a474797065ac426c6f636b52656d"
    "6f766564ac626c6f636b5f6861736865739105a66d656469756da347505581a474797065b0416c6c426c6f636b7343"
    "6c656172656400"
)
PROMPT = [1, 627, 587, 595, 632, 396, 555, 267, 404, 399, 17, 639]


def test_decode_reads_vllm_032_bytes() -> None:
    batch = decode_batch(7, VLLM_SALTED_BATCH)
    assert (batch.seq, batch.dp_rank) == (7, 0)
    first, extension, removed, cleared = batch.events
    assert first == BlockStored(
        [11417023597650169190, 17008267116679818987],
        None,
        PROMPT[:8],
        4,
        None,
        "GPU",
        None,
        [["abc"], None],
    )
    assert extension.parent_block_hash == 17008267116679818987
    assert extension.extra_keys == [None]
    assert removed == BlockRemoved([353443274476577457], "GPU")
    assert cleared == AllBlocksCleared()


def test_encode_is_byte_identical_to_vllm() -> None:
    stored = BlockStored([5, 6], None, list(range(1, 9)), 4, None, "GPU")
    batch = KVEventBatch(0, 1.5, [stored, BlockRemoved([5], "GPU"), AllBlocksCleared()], 0)
    assert encode_batch(batch) == VLLM_PLAIN_BATCH
    # With extra keys they are sent as vLLM sends them, and read back unchanged.
    keyed = BlockStored([5], None, [1, 2, 3, 4], 4, None, "GPU", "adapter", [["adapter", "s"]])
    again = decode_batch(1, encode_batch(KVEventBatch(1, 2.0, [keyed], 0))).events[0]
    assert again == keyed


def test_salted_blocks_match_only_their_own_salt() -> None:
    index = PrefixIndex(block_size=4)
    index.add_instance("vllm")
    index.apply_events("vllm", decode_batch(0, VLLM_SALTED_BATCH).events[:2])  # the two stores
    assert index.match(block_hash_chain(PROMPT, 4, "abc")) == {"vllm": 3}
    assert index.match(block_hash_chain(PROMPT, 4)) == {}  # unsalted never hits salted blocks
    assert index.match(block_hash_chain(PROMPT, 4, "abd")) == {}
    # A multi-modal key kvherd cannot produce keeps the block apart from every text request.
    image = BlockStored([9], None, PROMPT[:4], 4, None, "GPU", None, [[["img-1", 0]]])
    index.add_instance("mm")
    index.apply_events("mm", [image])
    assert index.num_blocks("mm") == 1
    assert index.match(block_hash_chain(PROMPT, 4)) == {}
    assert "mm" not in index.match(block_hash_chain(PROMPT, 4, "img-1"))


def test_lora_blocks_match_lora_requests_exactly() -> None:
    index = PrefixIndex(block_size=4)
    index.add_instance("lora")
    lora = BlockStored([1, 2], None, PROMPT[:8], 4, 3, "GPU", "sql", [["sql", "abc"], ["sql"]])
    index.apply_events("lora", [lora])
    assert index.match(block_hash_chain(PROMPT, 4, "abc", lora_name="sql")) == {"lora": 2}
    assert index.match(block_hash_chain(PROMPT, 4, "abc", lora_name="other")) == {}
    assert index.match(block_hash_chain(PROMPT, 4, lora_name="sql")) == {}


# -- sockets ---------------------------------------------------------------------------------------
class _Observer:
    def __init__(self) -> None:
        self.block_sizes: list[tuple[str, int]] = []
        self.lost: list[tuple[str, str]] = []
        self.silent: list[str] = []

    def kv_block_size_seen(self, instance_id: str, block_size: int) -> None:
        self.block_sizes.append((instance_id, block_size))

    def kv_history_lost(self, instance_id: str, detail: str) -> None:
        self.lost.append((instance_id, detail))

    def kv_events_silent(self, instance_id: str, silent_s: float) -> None:
        self.silent.append(instance_id)


def _stored(seq: int, block_size: int = 16) -> KVEventBatch:
    tokens = [seq % 250 + 1] * block_size
    return KVEventBatch(seq, float(seq), [BlockStored([1000 + seq], None, tokens, block_size)])


async def _until(condition: Callable[[], bool], what: str) -> None:
    for _ in range(500):
        if condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"timed out waiting for {what}")


def _stat(subscriber: KVEventSubscriber, instance_id: str, name: str) -> object:
    stats = subscriber.stats(instance_id)
    assert stats is not None
    return stats[name]


async def test_join_replays_history_and_a_rolled_buffer_says_so() -> None:
    publisher = KVEventPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", buffer_steps=3)
    for seq in range(5):  # published before kvherd subscribed; the buffer keeps 2, 3, 4
        publisher.publish(_stored(seq))
    cluster = ClusterState(block_size=16)
    cluster.add_instance("a", has_kv_events=True, trust_engine_hashes=True)
    observer = _Observer()
    subscriber = KVEventSubscriber(cluster, observer=observer)
    try:
        await subscriber.add("a", publisher.endpoint, publisher.replay_endpoint)
        await _until(lambda: _stat(subscriber, "a", "last_seq") == 4, "the replay at join")
        assert cluster.prefix_index.blocks("a") == {1002, 1003, 1004}
        assert [i for i, _ in observer.lost] == ["a"]
        assert "0..1" in observer.lost[0][1] and "replay buffer" in observer.lost[0][1]
        assert observer.block_sizes == [("a", 16)]
        assert _stat(subscriber, "a", "history_lost") == 1
    finally:
        await subscriber.close()
        publisher.close()


async def test_gap_is_filled_by_vllm_framed_replay() -> None:
    publisher = KVEventPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", topic="kv")
    cluster = ClusterState(block_size=16)
    cluster.add_instance("a", has_kv_events=True, trust_engine_hashes=True)
    observer = _Observer()
    subscriber = KVEventSubscriber(cluster, observer=observer)
    try:
        await subscriber.add("a", publisher.endpoint, publisher.replay_endpoint)
        seq = 0
        while _stat(subscriber, "a", "last_seq") == -1:  # until the subscription has landed
            publisher.publish(_stored(seq))
            seq += 1
            await asyncio.sleep(0.02)
        await _until(lambda: _stat(subscriber, "a", "last_seq") == seq - 1, "live batches")
        # The engine publishes three batches the subscriber never sees (a PUB drop), then one.
        with publisher._lock:
            for s in range(seq, seq + 3):
                publisher._buffer.append((s, encode_batch(_stored(s))))
        publisher.publish(_stored(seq + 3))
        await _until(lambda: _stat(subscriber, "a", "last_seq") == seq + 3, "the gap's replay")
        assert cluster.prefix_index.blocks("a") == {1000 + s for s in range(seq + 4)}
        assert _stat(subscriber, "a", "gaps") == 1
        assert observer.lost == []
    finally:
        await subscriber.close()
        publisher.close()


async def test_engine_that_connects_its_pub_reaches_a_bound_sub() -> None:
    """vLLM with ``tcp://host:P`` connects its PUB: kvherd binds, per instance or shared by topic."""
    own, shared = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    cluster = ClusterState(block_size=16)
    for name in ("own", "t1", "t2"):
        cluster.add_instance(name, has_kv_events=True, trust_engine_hashes=True)
    subscriber = KVEventSubscriber(cluster)
    ctx = zmq.asyncio.Context()
    pubs = []
    try:
        assert await subscriber.bind_shared(shared) == shared
        await subscriber.add("own", own, None, bind=True)
        await subscriber.add("t1", None, None, topic="engine-1")
        await subscriber.add("t2", None, None, topic="engine-2")
        for endpoint, topic in ((own, b""), (shared, b"engine-1"), (shared, b"engine-2")):
            pub = ctx.socket(zmq.PUB)
            pub.setsockopt(zmq.LINGER, 0)
            pub.connect(endpoint)
            pubs.append((pub, topic))
        stray = ctx.socket(zmq.PUB)
        stray.setsockopt(zmq.LINGER, 0)
        stray.connect(shared)
        pubs.append((stray, b"nobody"))
        offsets = {"own": 0, "t1": 100, "t2": 200}

        def got_all() -> bool:
            return all(_stat(subscriber, i, "last_seq") == 0 for i in offsets)

        for _ in range(300):  # a connecting PUB drops messages until the link is up
            for (pub, topic), offset in zip(pubs, (0, 100, 200, 300), strict=True):
                batch = KVEventBatch(0, 0.0, [BlockStored([offset], None, [1] * 16, 16)])
                await pub.send_multipart([topic, (0).to_bytes(8, "big"), encode_batch(batch)])
            await asyncio.sleep(0.02)
            if got_all() and subscriber.unclaimed_topics:
                break
        assert got_all()
        for name, offset in offsets.items():
            assert cluster.prefix_index.blocks(name) == {offset}
        assert b"nobody" in subscriber.unclaimed_topics
    finally:
        for pub, _ in pubs:
            pub.close(linger=0)
        await subscriber.close()
        ctx.term()


async def test_silence_after_traffic_is_reported_once() -> None:
    now = [0.0]
    publisher = KVEventPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*")
    cluster = ClusterState(block_size=16)
    cluster.add_instance("a", has_kv_events=True, trust_engine_hashes=True)
    observer = _Observer()
    subscriber = KVEventSubscriber(
        cluster, observer=observer, silence_warn_s=10.0, clock=lambda: now[0]
    )
    try:
        await subscriber.add("a", publisher.endpoint, publisher.replay_endpoint)
        await _until(lambda: _stat(subscriber, "a", "resyncs") == 1, "the join")
        assert subscriber.check_silence() == []  # no traffic yet: silence is fine
        subscriber.note_traffic("a")
        now[0] = 5.0
        subscriber.note_traffic("a")  # still waiting since 0.0
        assert subscriber.check_silence() == []
        now[0] = 10.5
        assert subscriber.check_silence() == ["a"]
        assert subscriber.check_silence() == []  # once
        assert observer.silent == ["a"] and _stat(subscriber, "a", "silent") is True
        seq = 0
        while _stat(subscriber, "a", "silent"):  # an event ends the silence
            publisher.publish(_stored(seq))
            seq += 1
            await asyncio.sleep(0.02)
        subscriber.note_traffic("a")
        now[0] = 30.0
        assert subscriber.check_silence() == ["a"]
    finally:
        await subscriber.close()
        publisher.close()


# -- vLLM's own publisher ----------------------------------------------------------------------------
VLLM_PYTHON = os.environ.get("KVHERD_VLLM_PYTHON", "/work/venvs/vllm/bin/python")
SUPPORT = Path(__file__).resolve().parent.parent / "support" / "vllm_kv_publisher.py"


@pytest.mark.skipif(not Path(VLLM_PYTHON).exists(), reason=f"no vLLM installation at {VLLM_PYTHON}")
async def test_vllm_publisher_connecting_salted_events_and_replay() -> None:
    """vLLM's ZmqEventPublisher, PUB connecting to kvherd's bound SUB: what it published before
    kvherd bound comes by replay, salted blocks match exactly the salted request."""
    pub_endpoint = f"tcp://127.0.0.1:{free_port()}"
    replay = f"tcp://127.0.0.1:{free_port()}"
    engine = subprocess.Popen(
        [VLLM_PYTHON, str(SUPPORT), pub_endpoint, replay],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    assert engine.stdin is not None and engine.stdout is not None
    cluster = ClusterState(block_size=4)
    cluster.add_instance("vllm", has_kv_events=True, trust_engine_hashes=False)
    observer = _Observer()
    subscriber = KVEventSubscriber(cluster, observer=observer)
    loop = asyncio.get_running_loop()

    async def send(batch: dict[str, object]) -> None:
        assert engine.stdin is not None and engine.stdout is not None
        engine.stdin.write(json.dumps(batch) + "\n")
        engine.stdin.flush()
        assert (await loop.run_in_executor(None, engine.stdout.readline)).strip() == "ok"

    def stored(hashes: list[int], parent: int | None, tokens: list[int], keys: object) -> dict:
        return {
            "type": "BlockStored",
            "block_hashes": hashes,
            "parent_block_hash": parent,
            "token_ids": tokens,
            "block_size": 4,
            "lora_id": None,
            "medium": "GPU",
            "lora_name": None,
            "extra_keys": keys,
        }

    try:
        line = await loop.run_in_executor(None, engine.stdout.readline)
        assert line.strip() == "ready", line
        # Nobody listens yet: vLLM's connecting PUB drops this batch; only replay has it.
        await send({"ts": 1.0, "events": [stored([11, 12], None, PROMPT[:8], [["abc"], None])]})
        await subscriber.add("vllm", pub_endpoint, replay, bind=True)
        await _until(lambda: _stat(subscriber, "vllm", "last_seq") == 0, "the replay at join")
        assert cluster.match(block_hash_chain(PROMPT, 4, "abc"), 0.0) == {"vllm": 2}
        seq = 1
        while _stat(subscriber, "vllm", "last_seq") < 1:  # live, once the link is up
            await send({"ts": 2.0, "events": [stored([13], 12, PROMPT[8:12], [None])]})
            seq += 1
            await asyncio.sleep(0.05)
        await _until(lambda: _stat(subscriber, "vllm", "last_seq") == seq - 1, "live batches")
        assert cluster.match(block_hash_chain(PROMPT, 4, "abc"), 0.0) == {"vllm": 3}
        assert cluster.match(block_hash_chain(PROMPT, 4), 0.0) == {}
        assert observer.lost == [] and observer.block_sizes == [("vllm", 4)]
        assert cluster.prefix_index.stats.unknown_parent == 0
    finally:
        if engine.stdin is not None:
            engine.stdin.write("quit\n")
            engine.stdin.close()
        try:
            engine.wait(timeout=10)
        except subprocess.TimeoutExpired:
            engine.kill()
            engine.wait()
        await subscriber.close()
