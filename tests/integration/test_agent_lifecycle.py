"""Agent lifecycle on loopback: KV events vs state, replay after a gap, SIGTERM drain, registration."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
import uvicorn
import zmq
from agent_process import AgentProcess, agent_process, free_port
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from instance_agent.kv_publisher import END_SEQ
from kvherd.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    decode_batch,
)


def _poll(condition: Callable[[], bool], timeout: float = 30.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


def _complete(agent: AgentProcess, prompt: list[int], max_tokens: int = 4) -> None:
    body = {"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True}
    response = httpx.post(f"{agent.url}/v1/completions", json=body, timeout=30)
    assert response.status_code == 200, response.text


def _replay(endpoint: str, start: int) -> list[tuple[int, bytes]]:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.connect(endpoint)
    try:
        sock.send_multipart([b"", start.to_bytes(8, "big")])
        replies: list[tuple[int, bytes]] = []
        while True:
            assert sock.poll(10_000), "replay did not answer"
            _, _topic, seq_bytes, payload = sock.recv_multipart()
            if seq_bytes == END_SEQ:
                return replies
            replies.append((int.from_bytes(seq_bytes, "big"), payload))
    finally:
        sock.close(linger=0)
        ctx.term()


def _apply(cached: set[int], batch: KVEventBatch) -> None:
    for event in batch.events:
        if isinstance(event, BlockStored):
            cached.update(event.block_hashes)
        elif isinstance(event, BlockRemoved):
            cached.difference_update(event.block_hashes)
        elif isinstance(event, AllBlocksCleared):
            cached.clear()


def test_kv_events_match_state_and_replay_fills_gaps() -> None:
    # 24 blocks of 16 tokens: a dozen distinct 40-token prompts must evict, so removals flow too.
    with agent_process("--num-gpu-blocks", "24", kv_events=True) as agent:
        assert agent.kv_events_endpoint is not None and agent.replay_endpoint is not None
        prompts = [[(i * 37 + j) % 250 for j in range(40)] for i in range(16)]
        _complete(agent, prompts[0])  # published before anyone listens: a guaranteed gap
        ctx = zmq.Context()
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(agent.kv_events_endpoint)
        received: dict[int, bytes] = {}
        try:
            for prompt in prompts[1:]:
                _complete(agent, prompt)
                _receive(sub, received)
            # The agent is idle now: no event follows this snapshot.
            state = httpx.get(f"{agent.url}/kvherd/v1/state?block_hashes=true").json()
            last = state["last_kv_event_seq"]
            _poll(lambda: _receive(sub, received) and last in received, 10, "subscriber")
        finally:
            sub.close(linger=0)
            ctx.term()
        assert received, "the subscriber never received a batch"
        first_seen = min(received)
        assert first_seen > 0  # the first request's batches were missed
        replayed = dict(_replay(agent.replay_endpoint, 0))
        assert sorted(replayed) == list(range(last + 1))  # everything, in order, no gap
        for seq, payload in received.items():
            assert replayed[seq] == payload  # replay sends the very bytes that were published
        gap = _replay(agent.replay_endpoint, 0)[:first_seen]
        assert [seq for seq, _ in gap] == list(range(first_seen))

        cached: set[int] = set()
        removed = 0
        for seq in range(last + 1):
            batch = decode_batch(seq, replayed[seq])
            removed += sum(isinstance(e, BlockRemoved) for e in batch.events)
            _apply(cached, batch)
        assert removed > 0, "the small pool should have evicted blocks"
        assert cached == set(state["cached_block_hashes"])
        assert len(cached) == state["cached_blocks"] > 0


def _receive(sub: zmq.Socket, received: dict[int, bytes]) -> bool:
    """Take every batch already delivered to `sub` (always True, for use inside a poll)."""
    while sub.poll(0):
        topic, seq_bytes, payload = sub.recv_multipart()
        assert topic == b""  # the default topic, as vLLM's
        received[int.from_bytes(seq_bytes, "big")] = payload
    return True


def test_sigterm_drains_then_exits_zero() -> None:
    with agent_process() as agent:
        body = {"prompt": "drain me", "max_tokens": 1500, "ignore_eos": True, "stream": True}
        with (
            httpx.Client(timeout=60) as client,
            client.stream("POST", f"{agent.url}/v1/completions", json=body) as response,
        ):
            lines = response.iter_lines()
            next(line for line in lines if line.startswith("data: "))
            agent.process.send_signal(15)
            _poll(
                lambda: httpx.get(f"{agent.url}/health").status_code == 503, what="draining health"
            )
            refused = httpx.post(f"{agent.url}/v1/completions", json={"prompt": "x"})
            assert refused.status_code == 503
            assert "draining" in refused.json()["error"]["message"]
            assert httpx.get(f"{agent.url}/kvherd/v1/state").json()["draining"] is True
            rest = [line for line in lines if line.startswith("data: ")]
        assert rest[-1] == "data: [DONE]"
        final = json.loads(rest[-2][len("data: ") :])
        assert final["choices"][0]["finish_reason"] == "length"  # the open request finished
        assert agent.process.wait(30) == 0


def test_drain_timeout_aborts_what_is_left_and_exits_zero() -> None:
    with agent_process("--drain-timeout", "0.3") as agent:
        body = {"prompt": "too long", "max_tokens": 1900, "ignore_eos": True, "stream": True}
        with (
            httpx.Client(timeout=60) as client,
            client.stream("POST", f"{agent.url}/v1/completions", json=body) as response,
        ):
            lines = response.iter_lines()
            next(line for line in lines if line.startswith("data: "))
            agent.process.send_signal(15)
            rest = [line for line in lines if line.startswith("data: ")]
        assert rest[-1] == "data: [DONE]"
        error = json.loads(rest[-2][len("data: ") :])["error"]
        assert "aborted" in error["message"] and error["type"] == "server_error"
        assert agent.process.wait(30) == 0


@dataclass
class FakeScheduler:
    """A real HTTP server speaking the scheduler's admin API, recording what agents send."""

    calls: list[tuple[str, str, Any, str | None]] = field(default_factory=list)
    forget: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)

    def app(self) -> FastAPI:
        app = FastAPI()

        async def record(request: Request) -> None:
            body = json.loads(await request.body() or b"null")
            with self.lock:
                self.calls.append(
                    (request.method, request.url.path, body, request.headers.get("authorization"))
                )

        @app.post("/admin/v1/instances")
        async def register(request: Request) -> JSONResponse:
            await record(request)
            self.forget = False
            return JSONResponse({"ok": True})

        @app.post("/admin/v1/instances/{instance_id}/heartbeat")
        async def heartbeat(instance_id: str, request: Request) -> JSONResponse:
            await record(request)
            return JSONResponse({}, status_code=404 if self.forget else 200)

        @app.delete("/admin/v1/instances/{instance_id}")
        async def deregister(instance_id: str, request: Request) -> JSONResponse:
            await record(request)
            return JSONResponse({})

        return app

    def count(self, method: str, suffix: str) -> int:
        with self.lock:
            return sum(1 for m, p, _, _ in self.calls if m == method and p.endswith(suffix))


def _serve(fake: FakeScheduler, port: int) -> tuple[uvicorn.Server, threading.Thread]:
    server = uvicorn.Server(
        uvicorn.Config(fake.app(), host="127.0.0.1", port=port, log_level="warning")
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    _poll(lambda: server.started, what="fake scheduler start")
    return server, thread


def test_registration_heartbeat_reregistration_and_deregistration() -> None:
    fake_scheduler = FakeScheduler()
    scheduler_port = free_port()
    url = f"http://127.0.0.1:{scheduler_port}"
    args = ("--scheduler", url, "--heartbeat-interval", "0.1", "--instance-id", "agent-a")
    # The scheduler is not up yet: the agent must serve anyway and register once it appears.
    with agent_process(*args, kv_events=True, env={"KVHERD_ADMIN_TOKEN": "s3cret"}) as agent:
        server, thread = _serve(fake_scheduler, scheduler_port)
        try:
            _poll(lambda: fake_scheduler.count("POST", "/heartbeat") >= 2, what="heartbeats")
            method, path, body, auth = fake_scheduler.calls[0]
            assert (method, path, auth) == ("POST", "/admin/v1/instances", "Bearer s3cret")
            assert body == {
                "instance_id": "agent-a",
                "url": agent.url,
                "kv_events_endpoint": agent.kv_events_endpoint,
                "replay_endpoint": agent.replay_endpoint,
                "model": "tiny",
                "block_size": 16,
                "role": "mixed",  # its P/D role (kvherd agent --role)
                # its block server, which other agents pull prefixes from
                "pull_address": httpx.get(f"{agent.url}/kvherd/v1/state").json()["pull_address"],
                "runtime_lora": False,  # loads LoRA adapters on demand (--allow-runtime-lora)
            }
            assert body["pull_address"].startswith("tcp://127.0.0.1:")
            beat = next(b for m, p, b, _ in fake_scheduler.calls if p.endswith("/heartbeat"))
            assert beat["instance_id"] == "agent-a" and beat["num_running"] == 0
            assert beat["draining"] is False and "freeness" in beat
            # A scheduler that restarted answers 404 to heartbeats: the agent registers again.
            fake_scheduler.forget = True
            _poll(lambda: fake_scheduler.count("POST", "/instances") >= 2, what="re-registration")
            assert agent.terminate() == 0
            assert fake_scheduler.count("DELETE", "/instances/agent-a") == 1
        finally:
            server.should_exit = True
            thread.join(10)


def test_agent_joins_and_leaves_a_real_scheduler() -> None:
    """The registration contract end to end: `kvherd agent --scheduler` against `kvherd serve`."""
    port, admin_port = free_port(), free_port()
    env = {**os.environ, "KVHERD_ADMIN_TOKEN": "fleet-secret"}
    cmd = [sys.executable, "-m", "kvherd", "serve", "--port", str(port), "--admin-port",
           str(admin_port), "--log-level", "warning"]  # fmt: skip
    proxy = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    admin = f"http://127.0.0.1:{admin_port}/admin/v1/instances"
    auth = {"Authorization": "Bearer fleet-secret"}

    def instances() -> list[dict[str, Any]]:
        try:
            response = httpx.get(admin, headers=auth, timeout=5)
        except httpx.HTTPError:
            return []
        listed: list[dict[str, Any]] = response.json().get("data", [])
        return listed

    try:
        args = ("--scheduler", f"http://127.0.0.1:{admin_port}", "--heartbeat-interval", "0.2")
        with agent_process(*args, kv_events=True, env={"KVHERD_ADMIN_TOKEN": "fleet-secret"}) as a:
            _poll(lambda: len(instances()) == 1, what="registration with kvherd serve")
            assert a.url in json.dumps(instances())
            body = {"model": "tiny", "prompt": "via the proxy", "max_tokens": 3}
            routed = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=30)
            assert routed.status_code == 200, routed.text
            assert a.terminate() == 0
            _poll(lambda: instances() == [] and proxy.poll() is None, what="deregistration")
    finally:
        proxy.terminate()
        proxy.wait(30)
