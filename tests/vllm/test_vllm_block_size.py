"""Block size against real vLLM: the CPU build's 128 is discovered, a wrong declaration is loud.

Nobody tells kvherd the block size here: it must read it from vLLM (``vllm:cache_config_info``, the
events' ``block_size``). An instance declared with ``block_size=32`` while vLLM runs 128 must
never be silent: a WARNING, ``kvherd_block_size_mismatch{instance}`` and the admin field
``block_size_mismatch``; a fleet whose instances disagree at start-up is refused, naming both.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from agent_process import free_port
from vllm_fleet import (
    VLLM_BLOCK_SIZE,
    KvherdFactory,
    KvherdServe,
    Prompts,
    VllmServer,
    assert_index_matches,
    complete,
    indexed_blocks,
    instance_arg,
    kvherd_serve,
    poll_until,
)


def test_default_block_size_128_is_discovered(
    vllm_pair: tuple[VllmServer, VllmServer], kvherd_fleet: KvherdFactory, prompts: Prompts
) -> None:
    a, b = vllm_pair
    assert a.block_size() == b.block_size() == VLLM_BLOCK_SIZE
    prompt = prompts.make("block-size")
    with kvherd_fleet() as proxy:
        for server in (a, b):
            described = proxy.instance(server.spec.name)
            assert described["block_size"] == VLLM_BLOCK_SIZE, described
            assert described.get("block_size_mismatch") is None, described
        served = complete(proxy.url, prompt)
        assert served.instance is not None
        assert_index_matches(proxy, a, b)
        blocks = indexed_blocks(proxy, served.instance)
        assert blocks is not None and blocks >= prompts.full_blocks(prompt)
        stream = proxy.instance(served.instance)["kv_events"]["stream"]
        assert stream["block_size"] == VLLM_BLOCK_SIZE, stream
        assert proxy.metric("kvherd_block_size_mismatch") == 0


def test_declared_block_size_that_vllm_does_not_run_is_reported(
    vllm_pair: tuple[VllmServer, VllmServer], tiny_model: Path, prompts: Prompts
) -> None:
    a, _ = vllm_pair
    args = ["--instance", instance_arg(a, {"block_size": 32}), "--tokenizer", str(tiny_model)]
    with kvherd_serve(*args) as proxy:
        complete(a.url, prompts.make("block-size-mismatch"))  # events with block_size 128

        def reported() -> dict[str, object] | None:
            found: dict[str, object] | None = proxy.instance("a").get("block_size_mismatch")
            return found

        mismatch = poll_until(reported)
        assert mismatch is not None, f"{proxy.instance('a')}\n{proxy.log()}"
        assert mismatch["instance_block_size"] == VLLM_BLOCK_SIZE
        assert mismatch["fleet_block_size"] == 32
        assert proxy.metric("kvherd_block_size_mismatch", instance="a") == VLLM_BLOCK_SIZE
        warnings = _mismatch_warnings(proxy.log())
        assert len(warnings) == 1, proxy.log()
        assert "128" in warnings[0] and "32" in warnings[0]
        seen = a.held_blocks()
        complete(a.url, prompts.make("block-size-mismatch-again"))
        assert poll_until(lambda: len(a.held_blocks()) > len(seen))
        assert poll_until(lambda: _batches(proxy) == _vllm_batches(a), timeout_s=10), proxy.log()
        assert len(_mismatch_warnings(proxy.log())) == 1  # once per instance


def _batches(proxy: KvherdServe) -> int | None:
    kv = proxy.instance("a").get("kv_events") or {}
    stream = kv.get("stream") or {}
    return stream.get("batches")


def _vllm_batches(server: VllmServer) -> int:
    return len(server.replay_batches())


def _mismatch_warnings(log: str) -> list[str]:
    return [
        line
        for line in log.splitlines()
        if "WARNING" in line and "block size" in line and "instance a " in line
    ]


def test_fleet_that_disagrees_on_block_size_is_refused(
    vllm_pair: tuple[VllmServer, VllmServer], tiny_model: Path
) -> None:
    a, b = vllm_pair
    ports = ["--port", str(free_port()), "--admin-port", str(free_port())]
    cmd = [sys.executable, "-m", "kvherd", "serve", "--admin-token", "t", *ports]
    cmd += ["--instance", instance_arg(a, {"block_size": 32}), "--instance", instance_arg(b)]
    cmd += ["--kv-events-bind", b.kv_endpoint, "--tokenizer", str(tiny_model)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert "128" in done.stderr and "32" in done.stderr, done.stderr
