"""KV bytes between two instances over torch.distributed point-to-point, in pairwise groups.

Contract:
- Every instance runs one `TransportHub`. It hosts a `TCPStore` that sources use to rendezvous with
  it, so there is no global process group and no fixed world: instances come and go, and any two
  of them form a two-rank group (source rank 0, destination rank 1) the first time they migrate.
- The destination names the group (`offer`) and starts its half of the rendezvous in the
  background; the source joins with the endpoint it got back (`connect`). Group names embed the
  destination's incarnation and a counter, so a restarted instance or a broken pair never reuses
  a stale group.
- Groups are cached per peer and reused by later migrations. Concurrent migrations over one group
  are kept apart by gloo/NCCL message tags (the endpoint's `tag`).
- Every send and receive waits at most `timeout_s`, a rendezvous at most `rendezvous_timeout_s`
  (it includes the peer getting round to joining); on any failure the channel is aborted and
  dropped (both sides), and `TransferError` is raised. A dead peer therefore costs at most one
  timeout, never a hang.
- A destination that is gone fails a source's `connect` fast, not after the rendezvous timeout:
  its store refusing connections `CONNECT_ATTEMPTS` times in a row (about 1.5 s, backing off) is
  a `TransferError` before any rendezvous starts, and while the source waits in the rendezvous it
  checks every `LIVENESS_POLL_S` that the destination's store still accepts connections (a
  channel that forms after the source gave up is closed).
- Payloads are byte tensors laid out by `migration.kv_copy` (`MigratableEngine.kv_block_views`).
  Large payloads go in chunks of at most `chunk_bytes`, bounding the staging memory on both sides.
- gloo moves CPU tensors; NCCL (CUDA builds) moves CUDA tensors between CUDA instances.
"""

from __future__ import annotations

import itertools
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from migration.core.protocol import TransportEndpoint

DEFAULT_CHUNK_BYTES = 16 << 20
# A destination's store refusing this many connection attempts in a row (0.1 s, then doubling
# waits in between: about 1.5 s in all) is gone; so is one that stops accepting mid-rendezvous.
CONNECT_ATTEMPTS = 5
CONNECT_BACKOFF_S = 0.1
LIVENESS_POLL_S = 0.5


class TransferError(RuntimeError):
    """A KV transfer or a group rendezvous failed or timed out."""


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a contiguous tensor (no copy)."""
    return tensor.contiguous().reshape(-1).view(torch.uint8)


class PairChannel:
    """One end of a two-rank group: this side's rank and the peer's."""

    def __init__(
        self, group: Any, name: str, rank: int, timeout_s: float, device: str, chunk_bytes: int
    ) -> None:
        if chunk_bytes < 1:
            raise ValueError("chunk_bytes must be positive")
        self._group = group
        self.chunk_bytes = chunk_bytes
        self.name = name
        self.rank = rank
        self.peer = 1 - rank
        self.timeout = timedelta(seconds=timeout_s)
        self.device = device
        self.closed = False

    def send(self, payload: torch.Tensor, tag: int) -> None:
        """Send a tensor's bytes in chunks, each completing within the timeout."""
        flat = as_bytes(payload)
        for chunk in _chunks(flat, self.chunk_bytes):
            self._transfer(self._group.send, chunk, tag, "send")

    def recv(
        self,
        nbytes: int,
        tag: int,
        sink: Callable[[int, torch.Tensor], None] | None = None,
    ) -> torch.Tensor:
        """Receive `nbytes` sent with the same `tag`.

        With `sink`, each chunk is handed over as it lands (`sink(offset, chunk)`) and the returned
        tensor is the staging buffer of the last chunk; without, the whole payload is returned."""
        if sink is None:
            return self.recv_into(torch.empty(nbytes, dtype=torch.uint8, device=self.device), tag)
        staging = torch.empty(min(nbytes, self.chunk_bytes), dtype=torch.uint8, device=self.device)
        offset = 0
        while offset < nbytes:
            chunk = staging[: min(self.chunk_bytes, nbytes - offset)]
            self._transfer(self._group.recv, chunk, tag, "recv")
            sink(offset, chunk)
            offset += chunk.numel()
        return staging

    def recv_into(self, out: torch.Tensor, tag: int) -> torch.Tensor:
        """Receive exactly `out`'s bytes into it, in place (it must be contiguous)."""
        if not out.is_contiguous():
            raise ValueError("recv_into needs a contiguous tensor (a copy would lose the bytes)")
        flat = as_bytes(out)
        for chunk in _chunks(flat, self.chunk_bytes):
            self._transfer(self._group.recv, chunk, tag, "recv")
        return out

    def close(self) -> None:
        """Abort the group: pending operations on both ends fail instead of waiting."""
        if self.closed:
            return
        self.closed = True
        abort = getattr(self._group, "abort", None)
        if abort is not None:
            abort()

    def _transfer(self, op: Any, chunk: torch.Tensor, tag: int, what: str) -> None:
        if self.closed:
            raise TransferError(f"{what} on closed channel {self.name}")
        try:
            op([chunk], self.peer, tag).wait(self.timeout)
        except RuntimeError as e:
            self.close()
            raise TransferError(f"{what} over {self.name} failed: {e}") from e


def _chunks(flat: torch.Tensor, chunk_bytes: int) -> Iterator[torch.Tensor]:
    if flat.numel() == 0:
        return
    for start in range(0, flat.numel(), chunk_bytes):
        yield flat[start : start + chunk_bytes]


def _new_group(backend: str, store: Any, rank: int, timeout_s: float) -> Any:
    timeout = timedelta(seconds=timeout_s)
    if backend == "gloo":
        return dist.ProcessGroupGloo(store, rank, 2, timeout)
    if backend == "nccl":
        nccl = getattr(dist, "ProcessGroupNCCL", None)
        if nccl is None or not torch.cuda.is_available():
            raise TransferError("the nccl backend needs a CUDA build of torch and a CUDA device")
        options = nccl.Options()
        options._timeout = timeout
        return nccl(store, rank, 2, options)
    raise ValueError(f"unknown transport backend {backend!r} (gloo or nccl)")


class TransportHub:
    """This instance's side of every pairwise KV channel."""

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        backend: str = "gloo",
        timeout_s: float = 10.0,
        rendezvous_timeout_s: float = 30.0,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    ) -> None:
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"unknown transport backend {backend!r} (gloo or nccl)")
        self.host = host
        self.backend = backend
        self.timeout_s = timeout_s
        self.rendezvous_timeout_s = rendezvous_timeout_s
        self.chunk_bytes = chunk_bytes
        self.device = "cuda" if backend == "nccl" else "cpu"
        self._store = dist.TCPStore(
            host, port, None, True, timedelta(seconds=rendezvous_timeout_s), wait_for_workers=False
        )
        self.port: int = self._store.port
        self.incarnation = uuid.uuid4().hex[:12]
        self._counter = itertools.count()
        self._tags = itertools.count(1)
        self._lock = threading.Lock()
        # Held while joining as a source: concurrent migrations to one destination must not
        # both join the same group (the second rank-0 join would never be matched).
        self._connect_lock = threading.Lock()
        self._accepting: dict[str, tuple[str, Future[PairChannel]]] = {}  # peer -> group
        self._connected: dict[tuple[str, int, str], PairChannel] = {}
        # Rendezvous blocks until the peer joins: it runs off the caller's thread.
        self._pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="kv-rendezvous")
        # Source-side joins, watched from the caller's thread (`_join_remote`).
        self._joins = ThreadPoolExecutor(max_workers=4, thread_name_prefix="kv-join")

    # -- destination side ------------------------------------------------------------------------
    def offer(self, peer: str) -> TransportEndpoint:
        """The endpoint `peer` (a source) must `connect` to; starts the rendezvous if needed."""
        with self._lock:
            current = self._accepting.get(peer)
            if current is None or _unusable(current[1]):
                name = f"kvherd/{self.incarnation}/{next(self._counter)}"
                future = self._pool.submit(self._accept, name)
                current = (name, future)
                self._accepting[peer] = current
            return TransportEndpoint(
                host=self.host,
                port=self.port,
                group=current[0],
                tag=next(self._tags),
                backend=self.backend,
                chunk_bytes=self.chunk_bytes,
            )

    def accepted(self, peer: str, group: str) -> PairChannel:
        """The channel `offer` set up for `peer`, once the source has joined."""
        with self._lock:
            current = self._accepting.get(peer)
        if current is None or current[0] != group:
            raise TransferError(f"no pending group {group!r} for {peer}")
        try:
            return current[1].result(timeout=self.rendezvous_timeout_s)
        except FutureTimeout:
            self._forget(peer, group)
            raise TransferError(f"{peer} did not join group {group!r} in time") from None
        except Exception as e:
            self._forget(peer, group)
            raise TransferError(f"rendezvous of {group!r} with {peer} failed: {e}") from e

    # -- source side -----------------------------------------------------------------------------
    def connect(self, endpoint: TransportEndpoint) -> PairChannel:
        """Join (or reuse) the group the destination offered."""
        if endpoint.backend != self.backend:
            raise TransferError(
                f"destination uses {endpoint.backend}, this instance {self.backend}"
            )
        key = (endpoint.host, endpoint.port, endpoint.group)
        with self._connect_lock:
            with self._lock:
                channel = self._connected.get(key)
            if channel is None or channel.closed:
                channel = self._join_remote(endpoint)
                with self._lock:
                    self._connected[key] = channel
            return channel

    def _join_remote(self, endpoint: TransportEndpoint) -> PairChannel:
        address = (endpoint.host, endpoint.port)
        if not _accepts(address, CONNECT_ATTEMPTS):
            raise TransferError(
                f"cannot reach {endpoint.host}:{endpoint.port}: connection refused "
                f"{CONNECT_ATTEMPTS} times (the destination is gone)"
            )
        joining = self._joins.submit(self._join_store, endpoint)
        while True:
            try:
                return joining.result(timeout=LIVENESS_POLL_S)
            except FutureTimeout:
                if not _accepts(address, 2):
                    joining.add_done_callback(_close_late)
                    raise TransferError(
                        f"{endpoint.host}:{endpoint.port} went away during the rendezvous of "
                        f"{endpoint.group!r}"
                    ) from None

    def _join_store(self, endpoint: TransportEndpoint) -> PairChannel:
        try:
            store = dist.TCPStore(
                endpoint.host,
                endpoint.port,
                None,
                False,
                timedelta(seconds=self.rendezvous_timeout_s),
            )
        except (RuntimeError, OSError) as e:
            raise TransferError(f"cannot reach {endpoint.host}:{endpoint.port}: {e}") from e
        return self._join(store, endpoint.group, 0, endpoint.chunk_bytes)

    # -- both ------------------------------------------------------------------------------------
    def drop(self, channel: PairChannel) -> None:
        """Abort a channel after a failure; the next migration with that peer makes a new group."""
        channel.close()
        with self._lock:
            for key, ch in list(self._connected.items()):
                if ch is channel:
                    del self._connected[key]
            for peer, (name, _) in list(self._accepting.items()):
                if name == channel.name:
                    del self._accepting[peer]

    def close(self) -> None:
        with self._lock:
            channels = list(self._connected.values())
            channels += [f.result() for _, f in self._accepting.values() if _ready(f)]
            self._connected.clear()
            self._accepting.clear()
        for channel in channels:
            channel.close()
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._joins.shutdown(wait=False, cancel_futures=True)

    def _accept(self, name: str) -> PairChannel:
        # A connection of its own to our store: rendezvous with several sources at once must not
        # queue behind one another's blocking waits on a shared connection.
        try:
            store = dist.TCPStore(
                self.host, self.port, None, False, timedelta(seconds=self.rendezvous_timeout_s)
            )
        except (RuntimeError, OSError) as e:
            raise TransferError(f"cannot reach this instance's own store: {e}") from e
        return self._join(store, name, 1, self.chunk_bytes)

    def _join(self, store: Any, name: str, rank: int, chunk_bytes: int) -> PairChannel:
        try:
            store = dist.PrefixStore(name, store)
            group = _new_group(self.backend, store, rank, self.rendezvous_timeout_s)
        except RuntimeError as e:
            raise TransferError(f"rendezvous of {name!r} failed: {e}") from e
        return PairChannel(group, name, rank, self.timeout_s, self.device, chunk_bytes)

    def _forget(self, peer: str, group: str) -> None:
        with self._lock:
            current = self._accepting.get(peer)
            if current is not None and current[0] == group:
                del self._accepting[peer]


def _accepts(address: tuple[str, int], attempts: int) -> bool:
    """Whether `address` accepts a TCP connection within `attempts` tries (only a refusal or an
    unreachable host is retried, with doubling waits from `CONNECT_BACKOFF_S`)."""
    for attempt in range(attempts):
        try:
            with socket.create_connection(address, timeout=1.0):
                return True
        except TimeoutError:
            return True  # slow, not gone: the rendezvous' own timeout applies
        except OSError:
            if attempt + 1 < attempts:
                time.sleep(CONNECT_BACKOFF_S * 2**attempt)
    return False


def _close_late(future: Future[PairChannel]) -> None:
    """A channel whose source already gave up on it is aborted once it forms."""
    if _ready(future):
        future.result().close()


def _ready(future: Future[PairChannel]) -> bool:
    return future.done() and not future.cancelled() and future.exception() is None


def _unusable(future: Future[PairChannel]) -> bool:
    return future.done() and (not _ready(future) or future.result().closed)
