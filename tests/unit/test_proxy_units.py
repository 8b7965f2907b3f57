"""The proxy's parts in isolation: forwarding over real sockets, KV event subscription with a lossy
link and the real publisher, outlier ejection, tenancy, registration patterns, body routing."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
import zmq
import zmq.asyncio

from instance_agent.kv_publisher import KVEventPublisher
from kvherd.kv_events import BlockStored, KVEventBatch
from kvherd.tokenizer import ByteTokenizer
from kvherd.wire import OpenAIError
from scheduler.core.cluster_state import ClusterState
from scheduler.core.outliers import Health, OutlierDetector
from scheduler.core.tenancy import KeySpec, build_registry, parse_key_spec, read_keys_file
from scheduler.forwarding import UpstreamConnectError, UpstreamPool, UpstreamTimeout
from scheduler.kv_subscriber import KVEventSubscriber
from scheduler.proxy.admin import RegistrationPolicy
from scheduler.proxy.routing_tokens import prompt_token_ids

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


@contextlib.asynccontextmanager
async def tcp_server(handler: Handler) -> AsyncIterator[str]:
    server = await asyncio.start_server(handler, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.close()
        await server.wait_closed()


async def _read_request(reader: asyncio.StreamReader) -> bytes:
    head = await reader.readuntil(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":")[1])
    return await reader.readexactly(length)


# -- forwarding --------------------------------------------------------------------------------
async def test_chunked_stream_is_relayed_exactly() -> None:
    pieces = [b'data: {"a": 1}\n\n', b'data: {"b"', b": 2}\n\n", b"x" * 70000, b"data: [DONE]\n\n"]

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        writer.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
            b"server: secret-instance\r\ntransfer-encoding: chunked\r\n\r\n"
        )
        for piece in pieces:
            writer.write(b"%x;ext=1\r\n%s\r\n" % (len(piece), piece))
            await writer.drain()
        writer.write(b"0\r\ntrailer: x\r\n\r\n")
        await writer.drain()

    pool = UpstreamPool()
    async with tcp_server(handler) as url:
        response = await pool.send(url, b"POST", b"/v1/completions", [], b"{}")
        assert response.status == 200 and response.streaming
        assert dict(response.headers) == {b"content-type": b"text/event-stream"}
        received = [chunk async for chunk in response.iter_body()]
    assert received == pieces


async def test_keepalive_reuse_and_transparent_retry_on_closed_idle_connection() -> None:
    connections = 0

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal connections
        connections += 1
        for _ in range(2):  # serve two requests per connection, then close it silently
            body = await _read_request(reader)
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))
            await writer.drain()
        writer.close()

    pool = UpstreamPool()
    async with tcp_server(handler) as url:
        for i in range(6):
            body = b'{"n": %d}' % i
            response = await pool.send(url, b"POST", b"/x", [], body)
            assert (response.status, response.body) == (200, body)
    assert connections == 3  # two requests per connection, none failed
    await pool.close()


async def test_connect_refused_and_head_timeout_are_distinct_errors() -> None:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{sock.getsockname()[1]}"
    pool = UpstreamPool(head_timeout=0.2)
    with pytest.raises(UpstreamConnectError):
        await pool.send(dead, b"POST", b"/x", [], b"{}")

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        await asyncio.sleep(5)

    async with tcp_server(silent) as url:
        with pytest.raises(UpstreamTimeout):
            await pool.send(url, b"POST", b"/x", [], b"{}")

    async def broken(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        writer.close()

    async with tcp_server(broken) as url:
        with pytest.raises(UpstreamConnectError):
            await pool.send(url, b"POST", b"/x", [], b"{}")

    async def garbage(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        writer.write(b"SPDY/9 two hundred\r\ncontent-length: lots\r\n\r\n")
        await writer.drain()

    async with tcp_server(garbage) as url:
        with pytest.raises(UpstreamConnectError):
            await pool.send(url, b"POST", b"/x", [], b"{}")


# -- KV event subscription -----------------------------------------------------------------------
class LossyLink:
    """A ZMQ SUB->PUB relay between a publisher and the subscriber that drops chosen batches."""

    def __init__(self, ctx: zmq.asyncio.Context, upstream: str) -> None:
        self.drop: set[int] = set()
        self._sub = ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.SUBSCRIBE, b"")
        self._sub.connect(upstream)
        self._pub = ctx.socket(zmq.PUB)
        self._pub.bind("tcp://127.0.0.1:*")
        self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self._task = asyncio.create_task(self._relay())

    async def _relay(self) -> None:
        while True:
            frames = await self._sub.recv_multipart()
            if int.from_bytes(frames[1], "big") not in self.drop:
                await self._pub.send_multipart(frames)

    async def close(self) -> None:
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        self._sub.close(linger=0)
        self._pub.close(linger=0)


def _stored(seq: int) -> KVEventBatch:
    tokens = [seq % 250] * 16
    return KVEventBatch(seq, float(seq), [BlockStored([1000 + seq], None, tokens, 16)])


async def _publish_until(
    publisher: KVEventPublisher,
    subscriber: KVEventSubscriber,
    start: int,
    until: Callable[[], bool],
) -> int:
    """Publish consecutive batches until `until()` holds (ZMQ links join asynchronously)."""
    seq = start
    for _ in range(400):
        publisher.publish(_stored(seq))
        seq += 1
        await asyncio.sleep(0.02)
        if until():
            return seq
    raise TimeoutError("subscriber never caught up")


@pytest.mark.parametrize("buffer_steps", [1000, 2])
async def test_subscriber_repairs_gaps_by_replay_or_resync(buffer_steps: int) -> None:
    publisher = KVEventPublisher(
        "tcp://127.0.0.1:*", "tcp://127.0.0.1:*", buffer_steps=buffer_steps
    )
    ctx = zmq.asyncio.Context()
    link = LossyLink(ctx, publisher.endpoint)
    cluster = ClusterState(block_size=16)
    cluster.add_instance("a", has_kv_events=True, trust_engine_hashes=True)
    subscriber = KVEventSubscriber(cluster)
    try:
        await subscriber.add("a", link.endpoint, publisher.replay_endpoint)

        def stats() -> dict[str, int]:
            found = subscriber.stats("a")
            assert found is not None
            return found

        seq = await _publish_until(publisher, subscriber, 0, lambda: stats()["last_seq"] >= 0)
        await _publish_until(publisher, subscriber, seq, lambda: stats()["last_seq"] == seq)
        seq += 1
        resyncs = stats()["resyncs"]
        # Lose three batches on the way; the next one reveals the gap.
        link.drop = {seq, seq + 1, seq + 2}
        for s in range(seq, seq + 4):
            publisher.publish(_stored(s))
        last = seq + 3
        for _ in range(200):
            if stats()["last_seq"] == last:
                break
            await asyncio.sleep(0.02)
        assert stats()["last_seq"] == last
        assert stats()["gaps"] >= 1
        held = cluster.prefix_index.blocks("a")
        if buffer_steps > 10:
            # Replay filled the gap: every batch ever published is in the index.
            assert held == {1000 + s for s in range(last + 1)}
            assert stats()["resyncs"] == resyncs
        else:
            # The buffer had lost the gap: resynced from what it still held; never invented.
            assert stats()["resyncs"] == resyncs + 1
            assert {1000 + last - 1, 1000 + last} <= held <= {1000 + s for s in range(last + 1)}
            assert 1000 + seq not in held
    finally:
        await subscriber.close()
        await link.close()
        ctx.term()
        publisher.close()


# -- health ----------------------------------------------------------------------------------------
def test_outlier_ejection_backoff_and_half_open() -> None:
    detector = OutlierDetector(consecutive_failures=3, base_ejection_s=5, max_ejection_s=12)
    detector.add("a")
    detector.add("b")  # the last healthy instance is never ejected
    assert detector.record_failure("a", 0) is None
    assert detector.record_failure("a", 1) is None
    assert detector.record_success("a", 2) is None  # resets the run
    assert detector.record_failure("a", 3) is None
    assert detector.record_failure("a", 4) is None
    assert detector.record_failure("a", 5) is Health.EJECTED
    assert not detector.healthy("a", 9.9)
    assert detector.state("a", 10) is Health.HALF_OPEN
    assert detector.admits("a", 10) and not detector.admits("a", 10)  # exactly one trial
    assert detector.record_failure("a", 10) is Health.EJECTED  # trial failed: 10 s now
    assert detector.state("a", 19.9) is Health.EJECTED
    assert detector.state("a", 20) is Health.HALF_OPEN
    assert detector.record_failure("a", 20) is Health.EJECTED  # capped at 12 s
    assert detector.state("a", 31.9) is Health.EJECTED
    assert detector.record_success("a", 32) is Health.HEALTHY
    assert detector.healthy("a", 32)
    for t in range(3):  # back-off was reset by the recovery
        detector.record_failure("a", 40 + t)
    assert detector.state("a", 47) is Health.HALF_OPEN
    assert not detector.healthy("unknown", 0)


# -- tenancy and registration ------------------------------------------------------------------------
def test_tenancy_keys_and_salts(tmp_path: Path) -> None:
    assert parse_key_spec("k1=alice") == KeySpec("k1", "alice")
    assert parse_key_spec("k2") == KeySpec("k2", None)
    with pytest.raises(ValueError):
        parse_key_spec("=alice")
    keys = tmp_path / "keys"
    keys.write_text("# team keys\nk3 carol\nk4=dave  # comment\n\nk5\n")
    assert read_keys_file(str(keys)) == [
        KeySpec("k3", "carol"),
        KeySpec("k4", "dave"),
        KeySpec("k5"),
    ]
    registry = build_registry(["k1=alice", "k2"], str(keys), salt_secret="fleet secret")
    assert registry.enabled and not build_registry([], None).enabled
    alice = registry.authenticate(b"Bearer k1")
    assert alice is not None and alice.name == "alice"
    assert registry.authenticate(b"bearer  k1 ") == alice
    assert registry.authenticate(b"Bearer nope") is None
    assert registry.authenticate(b"k1") is None and registry.authenticate(None) is None
    k2 = registry.authenticate(b"Bearer k2")
    assert k2 is not None and k2.name == "k2"
    salts = {t.cache_salt for t in (alice, k2)}
    assert len(salts) == 2
    # Stable across processes with the same secret, different with another.
    assert build_registry(["x=alice"], salt_secret="fleet secret").salt_for("alice") == (
        alice.cache_salt
    )
    assert build_registry(["x=alice"], salt_secret="s").salt_for("alice") != alice.cache_salt
    assert not registry.salt_secret_generated


def test_tenant_salts_are_never_keyed_by_a_public_constant(monkeypatch: pytest.MonkeyPatch) -> None:
    import hashlib
    import hmac

    monkeypatch.delenv("KVHERD_TENANT_SALT_SECRET", raising=False)
    public = "kvherd-tenant-" + hmac.new(b"kvherd", b"alice", hashlib.sha256).hexdigest()[:32]
    one, two = build_registry(["k=alice"]), build_registry(["k=alice"])
    assert one.salt_secret_generated and two.salt_secret_generated
    assert len({one.salt_for("alice"), two.salt_for("alice"), public}) == 3
    monkeypatch.setenv("KVHERD_TENANT_SALT_SECRET", "from the environment")
    shared = build_registry(["k=alice"])
    assert not shared.salt_secret_generated
    assert shared.salt_for("alice") == build_registry(
        [], salt_secret="from the environment"
    ).salt_for("alice")


def test_registration_patterns() -> None:
    loopback = RegistrationPolicy()
    assert loopback.allows_host("127.0.0.1") and loopback.allows_host("127.8.9.1")
    assert loopback.allows_host("::1") and loopback.allows_host("[::1]")
    assert loopback.allows_host("localhost")
    assert not loopback.allows_host("10.0.0.1") and not loopback.allows_host("evil.example")
    custom = RegistrationPolicy(["10.0.0.0/8", "*.gpu.internal"])
    assert custom.allows_host("10.2.3.4") and custom.allows_host("node7.gpu.internal")
    assert not custom.allows_host("127.0.0.1") and not custom.allows_host("gpu.internal.evil")


# -- routing input -----------------------------------------------------------------------------------
def test_prompt_token_ids_for_routing() -> None:
    tok = ByteTokenizer()
    assert prompt_token_ids({"prompt": "ab"}, False, tok) == [97, 98]
    assert prompt_token_ids({"prompt": [5, 6]}, False, tok) == [5, 6]
    assert prompt_token_ids({"prompt": ["ab", "cd"]}, False, tok) == [97, 98]  # batch: first
    assert prompt_token_ids({"prompt": [[7], [8]]}, False, tok) == [7]
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    assert prompt_token_ids(chat, True, tok) == tok.encode("<|user|>\nhi<|end|>\n<|assistant|>\n")
    bad_bodies: list[dict[str, Any]] = [
        {},
        {"prompt": 3},
        {"prompt": []},
        {"prompt": [1, "a"]},
        {"prompt": [-1]},
        {"prompt": [True]},
        {"prompt": [[]]},
        {"prompt": ["a", 1]},
    ]
    for bad in bad_bodies:
        with pytest.raises(OpenAIError) as info:
            prompt_token_ids(bad, False, tok)
        assert info.value.status == 400 and info.value.param == "prompt"
    bad_chats: list[dict[str, Any]] = [
        {},
        {"messages": []},
        {"messages": "hi"},
        {"messages": [{"content": "a message without a role"}]},
    ]
    for bad_chat in bad_chats:
        with pytest.raises(OpenAIError):
            prompt_token_ids(bad_chat, True, tok)


# -- command line and config file -------------------------------------------------------------------
def test_instance_specs_and_config_file(tmp_path: Path) -> None:
    from scheduler.serve_cli import load_config, parse_instance_spec

    assert parse_instance_spec("http://h:1/") == {"url": "http://h:1"}
    assert parse_instance_spec("http://h:1,kv_events=tcp://h:2,replay=tcp://h:3,id=x") == {
        "url": "http://h:1",
        "kv_events_endpoint": "tcp://h:2",
        "replay_endpoint": "tcp://h:3",
        "id": "x",
    }
    for bad in ("h:1", "http://h:1,color=red", "http://h:1,kv_events"):
        with pytest.raises(ValueError):
            parse_instance_spec(bad)
    config = tmp_path / "kvherd.yaml"
    config.write_text(
        "policy: {name: llmd, parameters: {seed: 3}}\n"
        "instances: [http://127.0.0.1:9, {url: 'http://127.0.0.1:10', id: b}]\n"
        "api_keys: ['k=alice']\n"
    )
    loaded = load_config(str(config))
    assert loaded["policy"]["name"] == "llmd" and len(loaded["instances"]) == 2
    pipeline = tmp_path / "pipeline.yaml"
    pipeline.write_text("scorers: [{type: queue-scorer, weight: 1}]\n")
    assert load_config(str(pipeline)) == {"policy": str(pipeline)}
    assert load_config(None) == {}
    listing = tmp_path / "list.yaml"
    listing.write_text("- 1\n- 2\n")
    with pytest.raises(ValueError):
        load_config(str(listing))


# -- retries before the first byte, through a whole proxy -------------------------------------------
async def test_stream_dying_before_first_chunk_is_retried_elsewhere() -> None:
    import argparse

    import httpx
    from agent_process import free_port

    from scheduler.serve_cli import add_arguments, serve_fleet

    sse = b'data: {"choices":[{"index":0,"text":"ok"}]}\n\n'

    async def dies_after_head(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        writer.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
            b"transfer-encoding: chunked\r\n\r\n"
        )
        await writer.drain()
        writer.close()  # killed during prefill: headers out, no token yet

    async def healthy(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError):
            while True:
                await _read_request(reader)
                writer.write(
                    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                    b"transfer-encoding: chunked\r\n\r\n"
                )
                for piece in (sse, b"data: [DONE]\n\n"):
                    writer.write(b"%x\r\n%s\r\n" % (len(piece), piece))
                writer.write(b"0\r\n\r\n")
                await writer.drain()

    async with tcp_server(dies_after_head) as bad, tcp_server(healthy) as good:
        parser = argparse.ArgumentParser()
        add_arguments(parser)
        port = free_port()
        args = parser.parse_args(
            ["--port", str(port), "--admin-port", str(free_port()), "--admin-token", "t",
             "--policy", "round_robin", "--instance", f"{bad},id=bad",
             "--instance", f"{good},id=good", "--log-level", "error", "--health-interval", "60"]
        )  # fmt: skip
        stop = asyncio.Event()
        ready = asyncio.Event()

        async def on_ready(_: object) -> None:
            ready.set()

        task = asyncio.create_task(
            serve_fleet(args, on_ready=on_ready, stop=stop, handle_signals=False)
        )
        await asyncio.wait_for(ready.wait(), 30)
        async with httpx.AsyncClient(timeout=30) as client:
            for i in range(4):
                response = await client.post(
                    f"http://127.0.0.1:{port}/v1/completions",
                    json={"prompt": f"p{i}", "stream": True},
                )
                assert response.status_code == 200
                assert response.content == sse + b"data: [DONE]\n\n"
            metrics = (await client.get(f"http://127.0.0.1:{port}/metrics")).text
        stop.set()
        assert await task == 0
    retries = next(
        float(line.split()[1])
        for line in metrics.splitlines()
        if line.startswith("kvherd_retries_total")
    )
    assert retries >= 1  # round robin sent at least one request to the dying instance first


async def test_slow_start_holds_a_ramping_instance_to_its_share_through_the_proxy() -> None:
    """``--slow-start``: an instance that joined a serving fleet (`Fleet.ramp`) takes a quarter of
    its 8 batch slots at first; round robin would give it half of 8 concurrent streams."""
    import argparse

    import httpx
    from agent_process import free_port

    from scheduler.fleet import Fleet
    from scheduler.serve_cli import add_arguments, serve_fleet

    release = asyncio.Event()
    got: dict[str, int] = {"old": 0, "new": 0}
    sse = b'data: {"choices":[{"index":0,"text":"ok"}]}\n\n'

    def backend(name: str) -> Handler:
        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError):
                while True:
                    body = await _read_request(reader)
                    if b"prompt" not in body:  # a probe (models, health): not served here
                        writer.write(b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\n\r\n")
                        await writer.drain()
                        continue
                    got[name] += 1
                    writer.write(
                        b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                        b"transfer-encoding: chunked\r\n\r\n"
                    )
                    await writer.drain()
                    await release.wait()  # in flight until the test lets it end
                    for piece in (sse, b"data: [DONE]\n\n"):
                        writer.write(b"%x\r\n%s\r\n" % (len(piece), piece))
                    writer.write(b"0\r\n\r\n")
                    await writer.drain()

        return handle

    async with tcp_server(backend("old")) as old, tcp_server(backend("new")) as new:
        parser = argparse.ArgumentParser()
        add_arguments(parser)
        port = free_port()
        args = parser.parse_args(
            ["--port", str(port), "--admin-port", str(free_port()), "--admin-token", "t",
             "--policy", "round_robin", "--slow-start", "600",
             "--instance", f"{old},id=old,max_num_seqs=8",
             "--instance", f"{new},id=new,max_num_seqs=8", "--log-level", "error",
             "--health-interval", "60"]
        )  # fmt: skip
        stop = asyncio.Event()
        ready = asyncio.Event()

        async def on_ready(fleet: Fleet) -> None:
            fleet.ramp("new")
            ready.set()

        task = asyncio.create_task(
            serve_fleet(args, on_ready=on_ready, stop=stop, handle_signals=False)
        )
        await asyncio.wait_for(ready.wait(), 30)
        async with httpx.AsyncClient(timeout=30) as client:

            async def one(i: int) -> httpx.Response:
                return await client.post(
                    f"http://127.0.0.1:{port}/v1/completions",
                    json={"prompt": f"p{i}", "stream": True},
                )

            sent = []
            for i in range(8):
                sent.append(asyncio.create_task(one(i)))
                while sum(got.values()) <= i:  # one at a time: each routed on the last's charge
                    await asyncio.sleep(0.01)
            assert got == {"old": 6, "new": 2}
            release.set()
            responses = await asyncio.gather(*sent)
        stop.set()
        assert await task == 0
    assert [r.status_code for r in responses] == [200] * 8


# -- live migration driver ---------------------------------------------------------------------------
async def test_migration_driver_sends_orders_and_moves_charges() -> None:
    """The source agent's documented ``POST /kvherd/v1/migrate`` contract, served over a real
    socket: the driver turns a drain plan into that call and, on commit, moves the charges."""
    import json

    from policies.registry import load_migration_policy
    from scheduler.core.load_report import parse_agent_state
    from scheduler.fleet import Fleet, FleetSettings, InstanceSpec
    from scheduler.metrics import ProxyMetrics
    from scheduler.migration_driver import MigrationDriver

    calls: list[dict[str, Any]] = []

    async def source_agent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        order = json.loads(await _read_request(reader))
        calls.append(order)
        outcome = json.dumps(
            {
                "migration_id": "m1",
                "request_id": order["request_id"],
                "status": "committed",
                "stages": 2,
            }
        ).encode()
        writer.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\n\r\n%s" % (len(outcome), outcome)
        )
        await writer.drain()
        writer.close()

    async with tcp_server(source_agent) as src_url, tcp_server(source_agent) as dst_url:
        fleet = Fleet("round_robin", FleetSettings(block_size=16), ProxyMetrics())
        await fleet.add_instance(InstanceSpec("src", src_url))
        await fleet.add_instance(InstanceSpec("dst", dst_url))
        instance, _ = fleet.dispatch("req-1", 64, [])
        src = instance.instance_id
        dst = "dst" if src == "src" else "src"
        state = {
            "num_total_blocks": 100,
            "num_free_blocks": 90,
            "block_size": 16,
            "running": [{"request_id": "req-1", "num_tokens": 64}],
            "waiting": [],
        }
        fleet.cluster.apply_report(src, parse_agent_state(state), fleet.clock())
        fleet.cluster.apply_report(dst, parse_agent_state({**state, "running": []}), fleet.clock())
        fleet.set_draining(src, True)
        driver = MigrationDriver(fleet, load_migration_policy("drain"), interval_s=0.0)
        driver.tick()
        for _ in range(200):
            if driver.loop.stats.succeeded:
                break
            await asyncio.sleep(0.01)
        await driver.stop()
        await fleet.stop()
    assert calls == [{"request_id": "req-1", "dst": fleet.instances[dst].url}]
    assert driver.loop.stats.succeeded == 1 and not driver.loop.in_flight
    assert fleet.router.instance_of("req-1") == dst
    assert "req-1" in fleet.cluster.get(dst).inflight
    assert "req-1" not in fleet.cluster.get(src).inflight


# -- fleet accounting -----------------------------------------------------------------------------
async def test_fleet_saturation_exclusion_and_reregistration() -> None:
    from scheduler.fleet import Fleet, FleetSettings, InstanceSpec, NoCapacityError
    from scheduler.metrics import ProxyMetrics

    fleet = Fleet("least_requests", FleetSettings(max_inflight_per_instance=1), ProxyMetrics())
    woken: list[str] = []

    class Listener:
        def capacity_freed(self) -> None:
            woken.append("capacity")

        def instance_lost(self, instance_id: str, url: str) -> None:
            woken.append(f"lost {instance_id}")

    fleet.subscribe(Listener())
    assert await fleet.add_instance(InstanceSpec("a", "http://127.0.0.1:1"))
    inst, _ = fleet.dispatch("r1", 32, [])
    with pytest.raises(NoCapacityError) as full:
        fleet.dispatch("r2", 32, [])
    assert full.value.saturated  # waits in the admission queue
    with pytest.raises(NoCapacityError) as tried:
        fleet.dispatch("r2", 32, [], exclude={"a"})
    assert not tried.value.saturated  # nothing left to try: fail at once
    # The instance re-registers while r1 is in flight; r1 finishes on the new record.
    assert not await fleet.add_instance(InstanceSpec("a", "http://127.0.0.1:1"))
    assert fleet.inflight.count("a") == 1 and fleet.inflight.saturated == {"a"}
    woken.clear()
    fleet.request_finished("r1", inst)
    assert fleet.inflight.count("a") == 0 and fleet.instances["a"].served == 1
    assert woken == ["capacity"] and fleet.inflight.completed == 1
    again, _ = fleet.dispatch("r2", 32, [])
    fleet.request_failed("r2", again)
    assert fleet.instances["a"].failures == 1 and fleet.inflight.count("a") == 0
    # Keys are the fleet's own: a client reusing an X-Request-Id in flight gets a fresh one, and
    # the client's id names the first holder for operators.
    first = fleet.new_key("r3")
    fleet.dispatch(first, 8, [])
    second = fleet.new_key("r3")
    assert len({first, second, "r3"}) == 3
    assert fleet.request_key("r3") == first and fleet.request_key(first) == first
    fleet.request_finished(first, fleet.instances["a"])
    third = fleet.new_key("r3")  # the id is free again: it names the new request
    fleet.dispatch(third, 8, [])
    assert fleet.request_key("r3") == third
    await fleet.remove_instance("a")
    assert woken[-1] == "lost a"
    await fleet.stop()


async def test_load_poller_falls_back_to_prometheus_then_backs_off() -> None:
    from scheduler.core.load_report import LoadReport
    from scheduler.load_poller import LoadPoller

    metrics_text = (
        b'vllm:num_requests_running{model_name="m"} 3\n'
        b'vllm:num_requests_waiting{model_name="m"} 2\n'
        b'vllm:kv_cache_usage_perc{model_name="m"} 0.25\n'
    )
    hits: list[bytes] = []
    serve_metrics = True

    async def plain_vllm(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError):
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                path = head.split(b" ")[1]
                hits.append(path)
                if path == b"/metrics" and serve_metrics:
                    writer.write(
                        b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%s"
                        % (len(metrics_text), metrics_text)
                    )
                else:
                    writer.write(b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\n\r\n")
                await writer.drain()

    reports: list[tuple[str, LoadReport]] = []
    async with tcp_server(plain_vllm) as url:
        poller = LoadPoller(lambda: {"v": url}, lambda i, r: reports.append((i, r)), lambda i: 16)
        await poller.poll_all()
        await poller.poll_all()
        assert hits == [b"/kvherd/v1/state", b"/metrics", b"/metrics"]
        assert reports[-1][0] == "v"
        assert (reports[-1][1].num_running, reports[-1][1].num_waiting) == (3, 2)
        assert reports[-1][1].kv_usage == 0.25
        serve_metrics = False  # no load endpoint at all: asked again only after a while
        await poller.poll_all()
        await poller.poll_all()
        assert hits[3:] == [b"/metrics"]
        await poller.stop()


def test_loop_histogram_exposes_what_prometheus_client_would() -> None:
    from prometheus_client import CollectorRegistry, Histogram, generate_latest

    from scheduler.metrics import LoopHistogram

    bounds = (0, 1, 2, 4, 8, 16)
    values = [0, 0.5, 1, 1.5, 2, 3, 4, 8, 8.5, 16, 17, 1000]
    registry = CollectorRegistry()
    reference = Histogram("blocks", "doc", buckets=bounds, registry=registry)
    ours = LoopHistogram("blocks", "doc", bounds)
    for value in values:
        reference.observe(value)
        ours.observe(value)

    def samples(text: str) -> list[str]:
        return [line for line in text.splitlines() if line.startswith("blocks_")]

    expected = [s for s in samples(generate_latest(registry).decode()) if "_created" not in s]

    class Collector:
        def collect(self) -> list[Any]:
            return [ours.family()]

    theirs = CollectorRegistry()
    theirs.register(Collector())
    assert samples(generate_latest(theirs).decode()) == expected
    assert 'blocks_bucket{le="1.0"} 3.0' in expected  # 1 lands in le=1 (le is "<=")
