"""Whole-block KV pulls between engine workers over plain TCP: a bounded block store, its server, a fetch.

Contract:
- `BlockStore(capacity_bytes)`: block hash (bytes) -> one block's KV bytes (every layer, one layout),
  LRU, never above its capacity; thread-safe. `prefix(hashes)` is the longest stored prefix.
- `BlockServer(store, layout, host, port)` answers each connection's one request (a frame: the
  layout key and up to `MAX_PULL_BLOCKS` hashes) with a header (``count`` blocks it holds, in
  order, from the first) and then those blocks. A layout other than its own gets ``count`` 0 and an
  error. At most `MAX_CONNECTIONS` are served at once; a stalled peer is dropped after `io_timeout_s`.
- `fetch_blocks(address, layout, hashes, sink, timeout_s)` asks ``tcp://host:port`` for `hashes`
  and calls ``sink(i, block)`` per block as it arrives (one block buffered at a time); it returns
  how many came, raises `PullError` on a refusal, a short stream, or `timeout_s` passing overall.
- `Pull.from_params(kv_transfer_params)` reads ``{"kvherd_pull": {"from": ADDR, "tokens": N?}}``.
Frames are a 4-byte big-endian length and a JSON object (hashes in hex: vLLM's python has no
msgpack); blocks follow as raw bytes of the layout's block size. Only the standard library is used.
"""

from __future__ import annotations

import contextlib
import json
import socket
import struct
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

MAX_PULL_BLOCKS = 4096  # one request's hashes: a 512k-token prompt at block size 128
MAX_FRAME_BYTES = 1 << 20  # a request of MAX_PULL_BLOCKS hex 32-byte hashes fits with room
MAX_CONNECTIONS = 4  # concurrent pulls served; each buffers at most one block
_LENGTH = struct.Struct(">I")


class PullError(Exception):
    """A pull that did not deliver what it asked for; the caller recomputes."""


@dataclass(frozen=True, slots=True)
class Pull:
    """A request's ask to load its prefix from another instance's block server."""

    source: str  # tcp://host:port of the source worker's `BlockServer`
    tokens: int | None  # the prefix the source holds (None: every full prompt block)

    @classmethod
    def from_params(cls, params: dict[str, Any] | None) -> Pull | None:
        ask = (params or {}).get("kvherd_pull")
        if not isinstance(ask, dict) or not isinstance(ask.get("from"), str):
            return None
        tokens = ask.get("tokens")
        return cls(ask["from"], tokens if isinstance(tokens, int) and tokens >= 0 else None)


def parse_address(address: str) -> tuple[str, int]:
    """``tcp://host:port`` -> (host, port); `PullError` for anything else."""
    rest = address.removeprefix("tcp://")
    host, _, port = rest.rpartition(":")
    if rest == address or not host or not port.isdigit():
        raise PullError(f"not a tcp://host:port address: {address!r}")
    return host, int(port)


class BlockStore:
    """Bounded LRU of whole blocks keyed by block hash (see the module contract)."""

    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = capacity_bytes
        self.used_bytes = 0
        self.evicted = 0
        self._blocks: OrderedDict[bytes, bytes] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, block_hash: object) -> bool:
        with self._lock:
            return block_hash in self._blocks

    def put(self, block_hash: bytes, block: bytes) -> None:
        if len(block) > self.capacity_bytes:
            return
        with self._lock:
            old = self._blocks.pop(block_hash, None)
            if old is not None:
                self.used_bytes -= len(old)
            while self.used_bytes + len(block) > self.capacity_bytes:
                _, dropped = self._blocks.popitem(last=False)
                self.used_bytes -= len(dropped)
                self.evicted += 1
            self._blocks[block_hash] = block
            self.used_bytes += len(block)

    def prefix(self, hashes: Sequence[bytes]) -> list[bytes]:
        """The stored blocks of the longest prefix of `hashes`, each touched as recently used.

        The bytes are immutable, so a block evicted while it is being sent stays valid."""
        found: list[bytes] = []
        with self._lock:
            for block_hash in hashes:
                block = self._blocks.get(block_hash)
                if block is None:
                    break
                self._blocks.move_to_end(block_hash)
                found.append(block)
        return found

    def check_integrity(self) -> None:
        assert self.used_bytes == sum(len(b) for b in self._blocks.values())
        assert self.used_bytes <= self.capacity_bytes


def _send_frame(sock: socket.socket, payload: dict[str, Any]) -> None:
    data = json.dumps(payload, separators=(",", ":")).encode()
    sock.sendall(_LENGTH.pack(len(data)) + data)


def _recv_exact(sock: socket.socket, view: memoryview, deadline: float | None) -> None:
    got = 0
    while got < len(view):
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise PullError("pull timed out")
            sock.settimeout(left)
        n = sock.recv_into(view[got:])
        if n == 0:
            raise PullError(f"peer closed after {got} of {len(view)} bytes")
        got += n


def _recv_frame(sock: socket.socket, deadline: float | None) -> dict[str, Any]:
    head = bytearray(_LENGTH.size)
    _recv_exact(sock, memoryview(head), deadline)
    (size,) = _LENGTH.unpack(head)
    if size > MAX_FRAME_BYTES:
        raise PullError(f"frame of {size} bytes")
    body = bytearray(size)
    _recv_exact(sock, memoryview(body), deadline)
    frame = json.loads(body)
    if not isinstance(frame, dict):
        raise PullError("frame is not a map")
    return frame


class BlockServer:
    """Serves a `BlockStore`'s blocks to `fetch_blocks` callers from a daemon thread."""

    def __init__(
        self,
        store: BlockStore,
        layout: str,
        host: str = "127.0.0.1",
        port: int = 0,
        io_timeout_s: float = 10.0,
    ) -> None:
        self.store = store
        self.layout = layout
        self.io_timeout_s = io_timeout_s
        self.served_blocks = 0
        self._listener = socket.create_server((host, port), reuse_port=False)
        self.port = self._listener.getsockname()[1]
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        self._closed = threading.Event()
        self._thread = threading.Thread(
            target=self._accept, name="kvherd-block-server", daemon=True
        )
        self._thread.start()

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return  # closed
            if not self._slots.acquire(blocking=False):
                conn.close()  # the peer sees a short stream and recomputes
                continue
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            with conn:
                conn.settimeout(self.io_timeout_s)
                ask = _recv_frame(conn, time.monotonic() + self.io_timeout_s)
                hashes = ask.get("hashes")
                if ask.get("layout") != self.layout:
                    _send_frame(conn, {"count": 0, "error": f"layout {self.layout}"})
                    return
                if not isinstance(hashes, list) or len(hashes) > MAX_PULL_BLOCKS:
                    _send_frame(conn, {"count": 0, "error": "bad hashes"})
                    return
                blocks = self.store.prefix([bytes.fromhex(h) for h in hashes])
                _send_frame(conn, {"count": len(blocks)})
                for block in blocks:
                    self.served_blocks += 1  # counted first: the peer may read it before we return
                    conn.sendall(block)
        except (OSError, PullError, ValueError, TypeError):
            return  # the peer's fetch fails on its side and it recomputes
        finally:
            self._slots.release()

    def close(self) -> None:
        self._closed.set()
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        self._thread.join(timeout=5.0)


def fetch_blocks(
    address: str,
    layout: str,
    hashes: Sequence[bytes],
    block_bytes: int,
    sink: Callable[[int, memoryview], None],
    timeout_s: float,
) -> int:
    """Pull `hashes` from the server at `address` (see the module contract); returns the count."""
    if len(hashes) > MAX_PULL_BLOCKS:
        raise PullError(f"{len(hashes)} blocks asked, at most {MAX_PULL_BLOCKS}")
    deadline = time.monotonic() + timeout_s
    host, port = parse_address(address)
    try:
        with socket.create_connection((host, port), timeout=timeout_s) as sock:
            _send_frame(sock, {"layout": layout, "hashes": [h.hex() for h in hashes]})
            header = _recv_frame(sock, deadline)
            if "error" in header:
                raise PullError(f"{address} refused: {header['error']}")
            count = header.get("count")
            if not isinstance(count, int) or not 0 <= count <= len(hashes):
                raise PullError(f"{address} sent a bad header {header!r}")
            buffer = memoryview(bytearray(block_bytes))
            for i in range(count):
                _recv_exact(sock, buffer, deadline)
                sink(i, buffer)
            return count
    except (OSError, ValueError) as exc:
        raise PullError(f"pull from {address}: {exc}") from exc
