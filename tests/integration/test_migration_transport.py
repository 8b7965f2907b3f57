"""Pairwise KV channels between two real processes on loopback: rendezvous, chunking, tags, timeouts,
and a dead peer."""

from __future__ import annotations

import multiprocessing as mp
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import torch

from migration.core.protocol import TransportEndpoint
from migration.kv_copy import recv_blocks, send_blocks
from migration.transport import PairChannel, TransferError, TransportHub

pytestmark = pytest.mark.timeout(120)


def payload(nbytes: int, seed: int) -> torch.Tensor:
    return ((torch.arange(nbytes, dtype=torch.int64) * 31 + seed) % 251).to(torch.uint8)


def source_main(endpoint: dict[str, Any], plan: list[tuple[int, int]], exit_early: bool) -> None:
    """A source instance: joins the destination's group and sends `plan` [(nbytes, tag)]."""
    hub = TransportHub(timeout_s=10.0)  # the chunk size comes from the destination's endpoint
    channel = hub.connect(TransportEndpoint(**endpoint))
    if exit_early:
        return  # the process dies with the group open
    for nbytes, tag in plan:
        channel.send(payload(nbytes, tag), tag)
    # Stay up until the destination is done with the last message.
    channel.recv(1, tag=999)
    hub.close()


def start_source(
    endpoint: TransportEndpoint, plan: list[tuple[int, int]], exit_early: bool = False
):
    ctx = mp.get_context("spawn")
    proc = ctx.Process(
        target=source_main,
        args=({k: getattr(endpoint, k) for k in endpoint.__slots__}, plan, exit_early),
        daemon=True,
    )
    proc.start()
    return proc


@pytest.fixture
def hub():
    hub = TransportHub(timeout_s=10.0, chunk_bytes=1 << 20)
    yield hub
    hub.close()


def test_payloads_arrive_intact_in_chunks_and_by_tag(hub: TransportHub) -> None:
    first = hub.offer("src-a")
    second = hub.offer("src-a")
    assert first.group == second.group and first.tag != second.tag  # one group per peer
    plan = [(3 << 20 | 17, first.tag), (5000, second.tag), (0, first.tag)]
    proc = start_source(first, plan)
    channel = hub.accepted("src-a", first.group)
    received: list[tuple[int, torch.Tensor]] = []
    staged = channel.recv(
        plan[0][0], first.tag, sink=lambda off, chunk: received.append((off, chunk.clone()))
    )
    assert staged.numel() == 1 << 20  # staging memory is bounded by the chunk size
    assert [off for off, _ in received] == [0, 1 << 20, 2 << 20, 3 << 20]
    assert torch.equal(torch.cat([c for _, c in received]), payload(plan[0][0], first.tag))
    assert torch.equal(channel.recv(5000, second.tag), payload(5000, second.tag))
    assert channel.recv(0, first.tag).numel() == 0
    channel.send(torch.zeros(1, dtype=torch.uint8), tag=999)
    proc.join(30)
    assert proc.exitcode == 0
    # The group is reused by the next migration with the same peer.
    assert hub.offer("src-a").group == first.group


def test_a_receive_nobody_sends_times_out_and_drops_the_group() -> None:
    hub = TransportHub(timeout_s=2.0)  # the rendezvous may take longer: the child imports torch
    try:
        endpoint = hub.offer("src-b")
        proc = start_source(endpoint, [])
        channel = hub.accepted("src-b", endpoint.group)
        start = time.monotonic()
        with pytest.raises(TransferError, match="recv"):
            channel.recv(16, tag=5)
        assert time.monotonic() - start < 8
        assert channel.closed
        hub.drop(channel)
        assert hub.offer("src-b").group != endpoint.group
        proc.join(30)
    finally:
        hub.close()


def test_a_dead_source_fails_the_receive_instead_of_hanging(hub: TransportHub) -> None:
    endpoint = hub.offer("src-c")
    proc = start_source(endpoint, [], exit_early=True)
    channel: PairChannel = hub.accepted("src-c", endpoint.group)
    proc.join(30)
    start = time.monotonic()
    with pytest.raises(TransferError):
        channel.recv(1 << 20, tag=endpoint.tag)
    assert time.monotonic() - start < 12


def test_a_source_that_never_joins_fails_the_rendezvous() -> None:
    hub = TransportHub(timeout_s=1.0, rendezvous_timeout_s=1.0)
    try:
        endpoint = hub.offer("src-d")
        with pytest.raises(TransferError):
            hub.accepted("src-d", endpoint.group)
        assert hub.offer("src-d").group != endpoint.group
        with pytest.raises(TransferError, match="no pending group"):
            hub.accepted("src-d", "kvherd/other/0")
    finally:
        hub.close()


def test_unreachable_destination_and_backend_mismatch() -> None:
    hub = TransportHub(timeout_s=1.0, rendezvous_timeout_s=1.0)
    try:
        with pytest.raises(TransferError, match="nccl"):
            hub.connect(TransportEndpoint("127.0.0.1", hub.port, "g", 1, backend="nccl"))
        with pytest.raises(TransferError, match="cannot reach"):
            hub.connect(TransportEndpoint("127.0.0.1", 1, "g", 1))
        with pytest.raises(ValueError):
            TransportHub(backend="mpi")
    finally:
        hub.close()


@pytest.mark.parametrize(
    ("src_ids", "dst_ids"),
    [
        (list(range(3, 13)), list(range(20, 30))),  # both runs: straight from and into the cache
        ([9, 2, 7, 4, 0, 11, 5, 1, 3, 8], list(range(20, 30))),  # gather on the source only
        (list(range(3, 13)), [29, 21, 25, 20, 27, 22, 28, 24, 26, 23]),  # scatter only
        ([9, 2, 7, 4, 0, 11, 5, 1, 3, 8], [29, 21, 25, 20, 27, 22, 28, 24, 26, 23]),
    ],
    ids=["runs", "gather", "scatter", "both"],
)
@pytest.mark.parametrize("chunk_bytes", [4 * 48, 1 << 20], ids=["per-view", "one-message"])
def test_blocks_move_between_caches_with_or_without_staging(
    src_ids: list[int], dst_ids: list[int], chunk_bytes: int
) -> None:
    # Two "engines" in one process: per layer and K/V, a cache of 32 blocks of 3x4 floats.
    src_views = [torch.randn(32, 3, 4) for _ in range(4)]
    dst_views = [torch.zeros(32, 3, 4) for _ in range(4)]
    untouched = [v.clone() for v in dst_views]
    # 4 * 48 bytes: the 10 blocks go in pieces of 4, one message per view; 1 MiB: one message.
    src_hub = TransportHub(timeout_s=10.0, chunk_bytes=chunk_bytes)
    dst_hub = TransportHub(timeout_s=10.0, chunk_bytes=chunk_bytes)
    try:
        endpoint = dst_hub.offer("src")
        with ThreadPoolExecutor(2) as pool:
            accepted = pool.submit(dst_hub.accepted, "src", endpoint.group)
            sender = src_hub.connect(endpoint)
            receiver = accepted.result()
            receiving = pool.submit(recv_blocks, receiver, dst_views, dst_ids, endpoint.tag)
            send_blocks(sender, src_views, src_ids, endpoint.tag)
            receiving.result(timeout=30)
        for src, dst, before in zip(src_views, dst_views, untouched, strict=True):
            assert torch.equal(dst[dst_ids], src[src_ids])
            others = [b for b in range(32) if b not in dst_ids]
            assert torch.equal(dst[others], before[others])  # nothing else was written
    finally:
        src_hub.close()
        dst_hub.close()


def test_receiving_into_a_strided_view_is_refused() -> None:
    channel = PairChannel(None, "g", 1, 1.0, "cpu", 1024)  # refused before any transport use
    with pytest.raises(ValueError, match="contiguous"):
        channel.recv_into(torch.zeros(4, 4).t(), tag=1)
