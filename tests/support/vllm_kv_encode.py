"""vLLM's own KV event encoder, driven from stdin: run with a vLLM installation's python.

    python vllm_kv_encode.py

Reads one JSON batch per line (``{"ts": float, "dp_rank": int | null, "events": [{"type":
"BlockStored", ...}, ...]}``, fields as vLLM names them), builds vLLM's msgspec event structs and
prints the hex of the payload vLLM's `ZmqEventPublisher` sends for it (its msgpack `Encoder`).
Tests compare kvherd's bytes for the same events with these.
"""

from __future__ import annotations

import json
import sys


def main() -> None:
    import msgspec
    from vllm.distributed.kv_events import (
        AllBlocksCleared,
        BlockRemoved,
        BlockStored,
        KVEventBatch,
    )

    encoder = msgspec.msgpack.Encoder()  # what ZmqEventPublisher packs with
    kinds = {"BlockStored": BlockStored, "BlockRemoved": BlockRemoved}
    for line in sys.stdin:
        wire = json.loads(line)
        events = []
        for item in wire["events"]:
            kind = item.pop("type")
            if kind == "AllBlocksCleared":
                events.append(AllBlocksCleared())
                continue
            if item.get("extra_keys") is not None:
                item["extra_keys"] = [None if k is None else tuple(k) for k in item["extra_keys"]]
            events.append(kinds[kind](**item))
        batch = KVEventBatch(ts=wire["ts"], events=events, data_parallel_rank=wire["dp_rank"])
        print(encoder.encode(batch).hex(), flush=True)


if __name__ == "__main__":
    main()
