"""A migration destination that is gone fails the source's transport `connect` in seconds, not
after the 30 s rendezvous timeout (which held the source's one outgoing-migration slot)."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import pytest
from agent_process import free_port

from migration.core.protocol import TransportEndpoint
from migration.transport import TransferError, TransportHub

pytestmark = pytest.mark.timeout(120)

# A destination's store that never joins the group (it dies during the rendezvous).
_STORE = """
import sys, time
from datetime import timedelta
import torch.distributed as dist
store = dist.TCPStore("127.0.0.1", int(sys.argv[1]), None, True, timedelta(seconds=60),
                      wait_for_workers=False)
print("ready", flush=True)
time.sleep(120)
"""


def endpoint(port: int) -> TransportEndpoint:
    return TransportEndpoint(
        host="127.0.0.1", port=port, group="kvherd/gone/0", tag=1, backend="gloo",
        chunk_bytes=1 << 20,
    )  # fmt: skip


def test_connection_refused_fails_fast() -> None:
    hub = TransportHub(rendezvous_timeout_s=30.0)
    try:
        start = time.monotonic()
        with pytest.raises(TransferError, match="connection refused"):
            hub.connect(endpoint(free_port()))
        elapsed = time.monotonic() - start
    finally:
        hub.close()
    print(f"\nrefused: failed after {elapsed:.2f} s")
    assert elapsed < 10.0  # was the 30 s rendezvous timeout


def test_destination_killed_during_the_rendezvous_fails_fast() -> None:
    port = free_port()
    store = subprocess.Popen(
        [sys.executable, "-c", _STORE, str(port)], stdout=subprocess.PIPE, text=True
    )
    hub = TransportHub(rendezvous_timeout_s=30.0)
    try:
        assert store.stdout is not None and store.stdout.readline().strip() == "ready"
        # The destination dies 1.5 s into the source's join (its group never forms).
        killer = threading.Timer(1.5, store.kill)
        start = time.monotonic()
        killer.start()
        with pytest.raises(TransferError, match=r"went away|cannot reach|failed"):
            hub.connect(endpoint(port))
        elapsed = time.monotonic() - start
    finally:
        store.kill()
        store.wait()
        hub.close()
    print(f"\nkilled mid-rendezvous: failed after {elapsed:.2f} s (killed at 1.5 s)")
    assert elapsed < 10.0  # was the 30 s rendezvous timeout
