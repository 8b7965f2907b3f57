"""vLLM's own `ZmqEventPublisher`, driven from stdin: run with a vLLM installation's python.

    python vllm_kv_publisher.py ENDPOINT REPLAY_ENDPOINT [TOPIC] [BUFFER_STEPS]

Prints ``ready`` once the sockets exist, then reads one JSON batch per line
(``{"ts": float, "events": [{"type": "BlockStored", ...}, ...]}``, fields as vLLM names them),
builds vLLM's msgspec event structs from it and publishes it; ``quit`` (or end of input) stops.
Every published line is acknowledged with ``ok``. Tests use it to meet the very bytes and socket
behaviour a vLLM engine has (PUB bind or connect, ROUTER replay framing, sequence numbers).
"""

from __future__ import annotations

import json
import sys


def main() -> None:
    from vllm.distributed.kv_events import (
        AllBlocksCleared,
        BlockRemoved,
        BlockStored,
        KVEventBatch,
        ZmqEventPublisher,
    )

    endpoint, replay = sys.argv[1], sys.argv[2]
    topic = sys.argv[3] if len(sys.argv) > 3 else ""
    buffer_steps = int(sys.argv[4]) if len(sys.argv) > 4 else 10_000
    publisher = ZmqEventPublisher(
        0, endpoint=endpoint, replay_endpoint=replay, topic=topic, buffer_steps=buffer_steps
    )
    kinds = {"BlockStored": BlockStored, "BlockRemoved": BlockRemoved}
    print("ready", flush=True)
    for line in sys.stdin:
        if line.strip() == "quit":
            break
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
        publisher.publish(KVEventBatch(ts=wire["ts"], events=events))
        print("ok", flush=True)
    publisher.shutdown()


if __name__ == "__main__":
    main()
