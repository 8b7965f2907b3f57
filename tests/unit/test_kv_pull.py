"""kvherd.kv_pull: the bounded block store, and pulls over loopback including the ways they fail."""

from __future__ import annotations

import json
import socket
import threading

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvherd.kv_pull import (
    MAX_PULL_BLOCKS,
    BlockIndex,
    BlockServer,
    BlockStore,
    Pull,
    PullError,
    fetch_blocks,
    parse_address,
)

BLOCK = 64
LAYOUT = "float32:2x2x16x4"


def _block(i: int) -> bytes:
    return bytes([i % 256]) * BLOCK


@given(st.lists(st.integers(0, 20), max_size=80), st.integers(1, 6))
def test_store_stays_within_capacity_and_its_mirror_index_stays_exact(
    keys: list[int], capacity: int
) -> None:
    store, mirror = BlockStore(capacity), BlockIndex(capacity)
    for key in keys:
        block_hash = key.to_bytes(4, "big")
        store.put(block_hash, _block(key))
        mirror.put(block_hash)
        store.check_integrity()
        probe = [k.to_bytes(4, "big") for k in range(21)]
        assert {h for h in probe if h in store} == {h for h in probe if h in mirror}
    if keys:
        assert store.prefix([keys[-1].to_bytes(4, "big")]) == [_block(keys[-1])]


def test_store_prefix_stops_at_the_first_missing_block_and_evicts_lru() -> None:
    store = BlockStore(capacity_blocks=3)
    for i in range(3):
        store.put(bytes([i]), _block(i))
    assert store.prefix([b"\x00", b"\x01", b"\x09", b"\x02"]) == [_block(0), _block(1)]
    store.put(b"\x00", _block(0))  # touched: 1 is now the least recently put
    store.put(b"\x03", _block(3))
    assert b"\x01" not in store and store.evicted == 1
    assert len(store) == 3
    assert BlockIndex(2).put(b"a") == (True, [])


@pytest.fixture
def server() -> BlockServer:
    store = BlockStore(capacity_blocks=100)
    for i in range(10):
        store.put(bytes([i]), _block(i))
    srv = BlockServer(store, LAYOUT, io_timeout_s=2.0)
    yield srv
    srv.close()


def _fetch(address: str, hashes: list[bytes], layout: str = LAYOUT, timeout_s: float = 5.0):
    got: dict[int, bytes] = {}
    count = fetch_blocks(
        address, layout, hashes, BLOCK, lambda i, b: got.__setitem__(i, bytes(b)), timeout_s
    )
    return count, got


def test_pull_delivers_the_held_prefix_in_order(server: BlockServer) -> None:
    address = f"tcp://127.0.0.1:{server.port}"
    count, got = _fetch(address, [bytes([3]), bytes([4]), b"missing", bytes([5])])
    assert count == 2 and got == {0: _block(3), 1: _block(4)}
    assert server.served_blocks == 2


def test_pull_refuses_another_layout(server: BlockServer) -> None:
    with pytest.raises(PullError, match="refused"):
        _fetch(f"tcp://127.0.0.1:{server.port}", [bytes([1])], layout="bfloat16:other")


def test_pull_from_nobody_fails_fast() -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]  # bound, never listening: connection refused
        with pytest.raises(PullError):
            _fetch(f"tcp://127.0.0.1:{port}", [b"x"], timeout_s=2.0)


def _fake_source(behaviour: str) -> tuple[socket.socket, threading.Event]:
    """A source that answers "2 blocks" and then dies mid-block ("die") or stalls ("stall")."""
    listener = socket.create_server(("127.0.0.1", 0))
    done = threading.Event()

    def run() -> None:
        conn, _ = listener.accept()
        conn.recv(65536)
        frame = json.dumps({"count": 2}).encode()
        conn.sendall(len(frame).to_bytes(4, "big") + frame + _block(1)[: BLOCK // 2])
        if behaviour == "stall":
            done.wait(10.0)
        conn.close()

    threading.Thread(target=run, daemon=True).start()
    return listener, done


@pytest.mark.parametrize("behaviour", ["die", "stall"])
def test_a_source_lost_mid_pull_is_a_pull_error(behaviour: str) -> None:
    listener, done = _fake_source(behaviour)
    try:
        with pytest.raises(PullError):
            _fetch(f"tcp://127.0.0.1:{listener.getsockname()[1]}", [b"a", b"b"], timeout_s=1.0)
    finally:
        done.set()
        listener.close()


def test_pull_params_and_addresses() -> None:
    assert Pull.from_params({"kvherd_pull": {"from": "tcp://h:1", "tokens": 256}}) == Pull(
        "tcp://h:1", 256
    )
    assert Pull.from_params({"kvherd_pull": {"from": "tcp://h:1"}}) == Pull("tcp://h:1", None)
    assert Pull.from_params({"other": 1}) is None and Pull.from_params(None) is None
    assert parse_address("tcp://10.0.0.1:5000") == ("10.0.0.1", 5000)
    for bad in ("10.0.0.1:5000", "tcp://nohost", "tcp://:1"):
        with pytest.raises(PullError):
            parse_address(bad)
    with pytest.raises(PullError, match="at most"):
        _fetch("tcp://127.0.0.1:1", [b"x"] * (MAX_PULL_BLOCKS + 1))


def _store() -> BlockStore:
    store = BlockStore(capacity_blocks=10)
    for i in range(4):
        store.put(bytes([i]), _block(i))
    return store


def _fetch_with(address: str, token: str | None, hashes: list[bytes]) -> dict[int, bytes]:
    got: dict[int, bytes] = {}
    fetch_blocks(address, LAYOUT, hashes, BLOCK, lambda i, b: got.__setitem__(i, bytes(b)), 5.0,
                 token)  # fmt: skip
    return got


def test_the_fleet_token_authenticates_both_ways_of_the_wire() -> None:
    refused: list[int] = []
    srv = BlockServer(_store(), LAYOUT, token="tok", on_refused=lambda: refused.append(1))
    address = f"tcp://127.0.0.1:{srv.port}"
    try:
        got = _fetch_with(address, "tok", [bytes([0]), bytes([1])])
        assert got == {0: _block(0), 1: _block(1)}
        for token in (None, "other"):  # no MAC, or the MAC of another token
            with pytest.raises(PullError) as exc:
                _fetch_with(address, token, [bytes([0])])
            assert exc.value.reason == "refused"
        # Refused before the layout is checked: a peer without the token learns nothing.
        with pytest.raises(PullError, match="unauthenticated"):
            fetch_blocks(address, "other:layout", [bytes([0])], BLOCK, lambda i, b: None, 5.0)
        assert len(refused) == srv.refused == 3 and srv.served_blocks == 2
    finally:
        srv.close()
    # A fetcher with the token refuses a server that sends blocks without MACs.
    open_srv = BlockServer(_store(), LAYOUT)
    try:
        with pytest.raises(PullError) as exc:
            _fetch_with(f"tcp://127.0.0.1:{open_srv.port}", "tok", [bytes([0])])
        assert exc.value.reason == "untrusted"
    finally:
        open_srv.close()


def test_a_block_whose_mac_does_not_bind_the_hash_asked_is_dropped() -> None:
    # The MAC binds the nonce, the index, the hash asked and the bytes: a man in the middle that
    # changes one byte of a block cannot make it land.
    srv = BlockServer(_store(), LAYOUT, token="tok")
    address = f"tcp://127.0.0.1:{srv.port}"
    host, port = parse_address(address)
    relay = socket.create_server(("127.0.0.1", 0))

    def tamper() -> None:
        conn, _ = relay.accept()
        with conn, socket.create_connection((host, port)) as up:
            up.sendall(conn.recv(1 << 16))
            data = b""
            while chunk := up.recv(1 << 16):
                data += chunk
            flipped = bytearray(data)
            flipped[-40] ^= 0xFF  # inside the block's bytes, before its 32-byte MAC
            conn.sendall(bytes(flipped))

    threading.Thread(target=tamper, daemon=True).start()
    try:
        with pytest.raises(PullError) as exc:
            _fetch_with(f"tcp://127.0.0.1:{relay.getsockname()[1]}", "tok", [bytes([2])])
        assert exc.value.reason == "untrusted"
    finally:
        relay.close()
        srv.close()
