"""Whole-block KV pulls between engine workers over plain TCP: a bounded block store, its server, a fetch.

Contract:
- `BlockStore(capacity_blocks)`: block hash (bytes) -> one block's KV bytes (every layer, one
  layout), LRU by put, never above its capacity; thread-safe. `prefix(hashes)` is the longest
  stored prefix; `put` returns what it evicted, `touch` is a put of a held hash without its bytes.
  `BlockIndex(capacity_blocks)` is the same policy on hashes alone: a mirror.
- `BlockServer(source, layout, host, port, token=)` serves any `BlockSource` (a `BlockStore`, an engine's
  cache) and answers each connection's one request (a frame: the
  layout key and up to `MAX_PULL_BLOCKS` hashes) with a header (``count`` blocks it holds, in
  order, from the first) and then those blocks. A layout other than its own gets ``count`` 0 and an
  error. At most `MAX_CONNECTIONS` are served at once; a stalled peer is dropped after `io_timeout_s`.
- `fetch_blocks(address, layout, hashes, sink, timeout_s, token=)` asks ``tcp://host:port`` for `hashes`
  and calls ``sink(i, block)`` per block as it arrives (one block buffered at a time); it returns
  how many came, raises `PullError` on a refusal, a short stream, or `timeout_s` passing overall.
- Trust (``token``, the fleet token, on both ends): the request carries a fresh nonce and
  HMAC-SHA256(key, nonce, layout, hashes); a server with a token refuses a request without that
  MAC (``refused``, counted in `BlockServer.refused`). Each block sent is followed by
  HMAC(key, nonce, index, the hash asked at that index, its bytes); a fetcher with a token calls
  `sink` only for a block whose MAC checks out, and raises `PullError` reason ``untrusted`` at the
  first that does not (or at a server that sends no MACs): what landed before it stays, the rest
  recomputes. The key is derived from the token, which never crosses the wire. No token on either
  end: the wire is open, as the control routes are.
- `Pull.from_params(kv_transfer_params)` reads ``{"kvherd_pull": {"from": ADDR, "tokens": N?}}``
  (vLLM's connector); between kvherd agents the proxy asks in `PULL_HEADER` (`PullAsk`) and the
  agent answers what happened in `PULL_OUTCOME_HEADER` (`parse_outcome`).
Frames are a 4-byte big-endian length and a JSON object (hashes in hex: vLLM's python has no
msgpack); blocks follow as raw bytes of the layout's block size, each then its 32-byte MAC when
authenticated. Only the standard library is used.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import secrets
import socket
import struct
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

MAX_PULL_BLOCKS = 4096  # one request's hashes: a 512k-token prompt at block size 128
MAX_FRAME_BYTES = 1 << 20  # a request of MAX_PULL_BLOCKS hex 32-byte hashes fits with room
MAX_CONNECTIONS = 4  # concurrent pulls served; each buffers at most one block
_LENGTH = struct.Struct(">I")
_INDEX = struct.Struct(">I")
MAC_BYTES = 32  # HMAC-SHA256
_NONCE_BYTES = 16


PULL_HEADER = "x-kvherd-pull"  # "tcp://HOST:PORT blocks=N": the holder and its depth in blocks
PULL_OUTCOME_HEADER = "x-kvherd-pull-outcome"  # "OUTCOME blocks=N bytes=B seconds=S"
PULL_OUTCOMES = ("landed", "partial", "nothing_to_pull", "no_room", "failed")


class PullError(Exception):
    """A pull that did not deliver what it asked for; the caller recomputes. `reason` is a
    metric label: timeout, stream_cut, refused, protocol, unreachable, untrusted (a block or a
    server that failed the fleet token's check), or the caller's own."""

    def __init__(self, message: str, reason: str = "protocol") -> None:
        super().__init__(message)
        self.reason = reason


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


@dataclass(frozen=True, slots=True)
class PullAsk:
    """The proxy's ask to an agent: pull the prompt's leading blocks from `address` first."""

    address: str
    num_blocks: int  # leading prompt blocks the holder holds

    @classmethod
    def parse(cls, header: str) -> PullAsk:
        """`PULL_HEADER`'s value; ValueError for anything else."""
        address, _, rest = header.strip().partition(" ")
        key, _, value = rest.partition("=")
        if key != "blocks" or not value.isdigit():
            raise ValueError(f"{PULL_HEADER} must be 'tcp://HOST:PORT blocks=N', not {header!r}")
        try:
            parse_address(address)
        except PullError as exc:
            raise ValueError(f"{PULL_HEADER}: {exc}") from None
        return cls(address, int(value))

    def header(self) -> str:
        return f"{self.address} blocks={self.num_blocks}"


class PullOutcome(NamedTuple):
    """What an agent says in `PULL_OUTCOME_HEADER` about the pull it was asked for."""

    outcome: str  # one of `PULL_OUTCOMES`
    num_blocks: int  # blocks that landed
    num_bytes: int
    seconds: float


def parse_outcome(header: str) -> PullOutcome | None:
    """`PULL_OUTCOME_HEADER`'s value; None when malformed."""
    outcome, *fields = header.split() or [""]
    values = dict(field.partition("=")[::2] for field in fields)
    try:
        told = PullOutcome(
            outcome, int(values["blocks"]), int(values["bytes"]), float(values["seconds"])
        )
    except (KeyError, ValueError):
        return None
    return told if outcome in PULL_OUTCOMES else None


def parse_address(address: str) -> tuple[str, int]:
    """``tcp://host:port`` -> (host, port); `PullError` for anything else."""
    rest = address.removeprefix("tcp://")
    host, _, port = rest.rpartition(":")
    if rest == address or not host or not port.isdigit():
        raise PullError(f"not a tcp://host:port address: {address!r}", "unreachable")
    return host, int(port)


class BlockIndex:
    """Bounded LRU of block hashes. Fed the same puts, it holds exactly what a `BlockStore` of the
    same capacity holds: the vLLM scheduler's mirror of its worker's store (another process)."""

    def __init__(self, capacity_blocks: int) -> None:
        self.capacity_blocks = max(1, capacity_blocks)
        self.evicted = 0
        self._order: OrderedDict[bytes, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, block_hash: object) -> bool:
        return block_hash in self._order

    def put(self, block_hash: bytes) -> tuple[bool, list[bytes]]:
        """Add or touch `block_hash`: (whether it is new, the hashes evicted to make room)."""
        if block_hash in self._order:
            self._order.move_to_end(block_hash)
            return False, []
        evicted: list[bytes] = []
        while len(self._order) >= self.capacity_blocks:
            evicted.append(self._order.popitem(last=False)[0])
        self.evicted += len(evicted)
        self._order[block_hash] = None
        return True, evicted

    def prefix_len(self, hashes: Sequence[bytes]) -> int:
        """How many of `hashes`, from the first, are held (nothing is touched)."""
        n = 0
        while n < len(hashes) and hashes[n] in self._order:
            n += 1
        return n


class BlockSource(Protocol):
    def prefix(self, hashes: Sequence[bytes]) -> list[bytes]:
        """The blocks of the longest held prefix of `hashes`, as immutable bytes."""
        ...


class BlockStore:
    """Bounded LRU of whole blocks keyed by block hash (see the module contract)."""

    def __init__(self, capacity_blocks: int) -> None:
        self._index = BlockIndex(capacity_blocks)
        self._blocks: dict[bytes, bytes] = {}
        self._lock = threading.Lock()

    @property
    def evicted(self) -> int:
        return self._index.evicted

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, block_hash: object) -> bool:
        with self._lock:
            return block_hash in self._blocks

    def put(self, block_hash: bytes, block: bytes) -> list[tuple[bytes, bytes]]:
        """Keep `block` (a held hash is only touched: one hash names one block's KV); returns
        the (hash, block) evicted to make room, least recently put first."""
        with self._lock:
            added, evicted = self._index.put(block_hash)
            dropped = [(h, self._blocks.pop(h)) for h in evicted]
            if added:
                self._blocks[block_hash] = block
            return dropped

    def touch(self, block_hash: bytes) -> bool:
        """`put` of a held hash without its bytes (False, and nothing done, when not held)."""
        with self._lock:
            if block_hash not in self._blocks:
                return False
            self._index.put(block_hash)
            return True

    def get(self, block_hash: bytes) -> bytes | None:
        """The held block, or None (nothing is touched)."""
        with self._lock:
            return self._blocks.get(block_hash)

    def prefix(self, hashes: Sequence[bytes]) -> list[bytes]:
        """The stored blocks of the longest prefix of `hashes` (nothing is touched, so that a
        mirror `BlockIndex` stays exact). The bytes are immutable: a block evicted while it is
        being sent stays valid."""
        with self._lock:
            n = self._index.prefix_len(hashes)
            return [self._blocks[h] for h in hashes[:n]]

    def check_integrity(self) -> None:
        with self._lock:
            assert len(self._blocks) == len(self._index) <= self._index.capacity_blocks
            assert all(h in self._index for h in self._blocks)


def _send_frame(sock: socket.socket, payload: dict[str, Any]) -> None:
    data = json.dumps(payload, separators=(",", ":")).encode()
    sock.sendall(_LENGTH.pack(len(data)) + data)


def _recv_exact(sock: socket.socket, view: memoryview, deadline: float | None) -> None:
    got = 0
    while got < len(view):
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise PullError("pull timed out", "timeout")
            sock.settimeout(left)
        n = sock.recv_into(view[got:])
        if n == 0:
            raise PullError(f"peer closed after {got} of {len(view)} bytes", "stream_cut")
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


def wire_key(token: str | None) -> bytes | None:
    """The block wire's MAC key for a fleet token (None: an open wire)."""
    if not token:
        return None
    return hashlib.sha256(b"kvherd-block-wire\0" + token.encode()).digest()


def _request_mac(key: bytes, nonce: bytes, layout: str, hashes_hex: Sequence[str]) -> str:
    message = b"\0".join((b"request", nonce, layout.encode(), ",".join(hashes_hex).encode()))
    return hmac.new(key, message, hashlib.sha256).hexdigest()


def _block_mac(key: bytes, nonce: bytes, index: int, block_hash: bytes, block: Any) -> bytes:
    mac = hmac.new(key, b"block\0" + nonce + _INDEX.pack(index) + block_hash, hashlib.sha256)
    mac.update(block)
    return mac.digest()


def _authenticated(key: bytes, ask: dict[str, Any], layout: str, hashes: list[str]) -> bytes | None:
    """The request's nonce when its MAC checks out under `key`, else None."""
    nonce, mac = ask.get("nonce"), ask.get("mac")
    if not isinstance(nonce, str) or not isinstance(mac, str):
        return None
    try:
        raw = bytes.fromhex(nonce)
    except ValueError:
        return None
    expected = _request_mac(key, raw, layout, hashes)
    return raw if hmac.compare_digest(expected, mac) else None


class BlockServer:
    """Serves a `BlockSource`'s blocks to `fetch_blocks` callers from a daemon thread."""

    def __init__(
        self,
        store: BlockSource,
        layout: str,
        host: str = "127.0.0.1",
        port: int = 0,
        io_timeout_s: float = 10.0,
        token: str | None = None,
        on_refused: Callable[[], None] | None = None,
    ) -> None:
        self.store = store
        self.layout = layout
        self.io_timeout_s = io_timeout_s
        self.served_blocks = 0
        self.refused = 0  # requests without the fleet token's MAC
        self._key = wire_key(token)
        self._on_refused = on_refused
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
                hashes, layout = ask.get("hashes"), ask.get("layout")
                if (
                    not isinstance(hashes, list)
                    or len(hashes) > MAX_PULL_BLOCKS
                    or not all(isinstance(h, str) for h in hashes)
                    or not isinstance(layout, str)
                ):
                    _send_frame(conn, {"count": 0, "error": "bad request"})
                    return
                # The token first: a peer without it learns nothing, not even the layout.
                key, nonce = self._key, None
                if key is not None:
                    nonce = _authenticated(key, ask, layout, hashes)
                    if nonce is None:
                        self.refused += 1
                        if self._on_refused is not None:
                            self._on_refused()
                        _send_frame(conn, {"count": 0, "error": "unauthenticated"})
                        return
                if layout != self.layout:
                    _send_frame(conn, {"count": 0, "error": f"layout {self.layout}"})
                    return
                wanted = [bytes.fromhex(h) for h in hashes]
                blocks = self.store.prefix(wanted)
                _send_frame(conn, {"count": len(blocks), "mac": nonce is not None})
                for i, block in enumerate(blocks):
                    self.served_blocks += 1  # counted first: the peer may read it before we return
                    conn.sendall(block)
                    if key is not None and nonce is not None:
                        conn.sendall(_block_mac(key, nonce, i, wanted[i], block))
        except Exception:  # a dead peer, a bad frame, a source that failed: the peer's fetch fails
            return  # on its side and it recomputes
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
    token: str | None = None,
) -> int:
    """Pull `hashes` from the server at `address` (see the module contract); returns the count."""
    if len(hashes) > MAX_PULL_BLOCKS:
        raise PullError(f"{len(hashes)} blocks asked, at most {MAX_PULL_BLOCKS}")
    deadline = time.monotonic() + timeout_s
    host, port = parse_address(address)
    key = wire_key(token)
    hashes_hex = [h.hex() for h in hashes]
    ask: dict[str, Any] = {"layout": layout, "hashes": hashes_hex}
    nonce = secrets.token_bytes(_NONCE_BYTES)  # unused on an open wire
    if key is not None:
        ask["nonce"], ask["mac"] = nonce.hex(), _request_mac(key, nonce, layout, hashes_hex)
    try:
        with socket.create_connection((host, port), timeout=timeout_s) as sock:
            _send_frame(sock, ask)
            header = _recv_frame(sock, deadline)
            if "error" in header:
                raise PullError(f"{address} refused: {header['error']}", "refused")
            count = header.get("count")
            if not isinstance(count, int) or not 0 <= count <= len(hashes):
                raise PullError(f"{address} sent a bad header {header!r}")
            if key is not None and count and header.get("mac") is not True:
                raise PullError(f"{address} sends blocks without the fleet's MAC", "untrusted")
            buffer = memoryview(bytearray(block_bytes + (MAC_BYTES if key is not None else 0)))
            block, mac = buffer[:block_bytes], buffer[block_bytes:]
            for i in range(count):
                _recv_exact(sock, buffer, deadline)
                if key is not None and not hmac.compare_digest(
                    _block_mac(key, nonce, i, hashes[i], block), mac
                ):
                    raise PullError(f"block {i} from {address} fails its MAC", "untrusted")
                sink(i, block)
            return count
    except (OSError, ValueError) as exc:
        reason = "timeout" if isinstance(exc, TimeoutError) else "unreachable"
        raise PullError(f"pull from {address}: {exc}", reason) from exc
