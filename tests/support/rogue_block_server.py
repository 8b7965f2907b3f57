"""Test helper: a block server without the fleet token, speaking kvherd's block wire with junk.

`RogueBlockServer(count, claims_mac)` listens on a loopback port (`address`, ``tcp://...``) and
answers every block request (a length-prefixed JSON frame, `kvherd.kv_pull`'s wire) with a header
claiming `count` blocks (and MACs when `claims_mac`), then 2 MiB of random bytes: more than any
test model's block and its MAC. `asked` counts the requests it got; `close()` stops it.
"""

from __future__ import annotations

import json
import os
import socket
import struct
import threading


class RogueBlockServer:
    def __init__(self, count: int, claims_mac: bool) -> None:
        self.count = count
        self.claims_mac = claims_mac
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.address = f"tcp://127.0.0.1:{self.sock.getsockname()[1]}"
        self.asked = 0
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                try:
                    (length,) = struct.unpack(">I", conn.recv(4, socket.MSG_WAITALL))
                    conn.recv(length, socket.MSG_WAITALL)
                    self.asked += 1
                    header = json.dumps({"count": self.count, "mac": self.claims_mac}).encode()
                    conn.sendall(struct.pack(">I", len(header)) + header + os.urandom(1 << 21))
                except OSError:
                    pass

    def close(self) -> None:
        self.sock.close()
