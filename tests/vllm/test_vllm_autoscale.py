"""``kvherd up --launch``: the autoscaler starts and removes real vLLM servers from a command template.

One vLLM server at start (``-n 1``); a load step of 4 streams (each server sized for 2 in flight)
makes the controller launch a second from the same template (the load pauses while it starts),
which the proxy adds once its ``/health`` answers (its KV events subscribed) and once it has
pulled the first's hottest prefixes through kvherd's KV connector (the warm-up); the grown fleet
serves part of the step's new conversations; when the load falls to one stream the second is
drained, the first pulls the prefixes only the second holds (the hand-over), and the second is
removed and stopped: its port is closed and no process of it is left. Every request
answers 200 with the same greedy text per prompt on either server (same checkpoint), and the
scale events are counted.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import time
from pathlib import Path

import httpx
import pytest
from kvherd_up import running_up
from step_load import StepLoad, until
from vllm_fleet import REPO_ROOT, connector_config

TOKEN = "vllm-autoscale-admin-token"
MAX_NUM_SEQS = 4


def _launch_command(python: str, model: Path) -> str:
    events = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": "tcp://*:{port1}",
        "replay_endpoint": "tcp://127.0.0.1:{port2}",
    }
    connector = json.dumps(connector_config(0)).replace('"port": 0', '"port": {port3}')
    argv = [
        "env", "-u", "VIRTUAL_ENV", "-u", "PYTHONHASHSEED",
        f"PYTHONPATH={REPO_ROOT}",  # this tree's kvherd connector
        "VLLM_CPU_OMP_THREADS_BIND={cpu}",
        python, "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model), "--served-model-name", "tiny",
        "--host", "127.0.0.1", "--port", "{port}", "--dtype", "float32",
        "--max-model-len", "4096", "--max-num-seqs", str(MAX_NUM_SEQS),
        "--enable-prefix-caching", "--enable-prompt-tokens-details",
        "--kv-events-config", json.dumps(events), "--kv-transfer-config", connector,
    ]  # fmt: skip
    return shlex.join(argv)


def _stat(entry: Path) -> tuple[str, int] | None:
    """A process's state and process group (None: it is gone)."""
    try:
        fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return fields[0], int(fields[2])


def _group_of(argument: str) -> int:
    """The process group of the live process whose command line holds the word `argument`."""
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                words = (entry / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue  # it exited meanwhile
            stat = _stat(entry)
            if argument.encode() in words and stat is not None and stat[0] != "Z":
                return stat[1]
    raise AssertionError(f"no process runs with {argument!r}")


def _live_members(group: int) -> list[int]:
    return [
        int(entry.name)
        for entry in Path("/proc").iterdir()
        if entry.name.isdigit()
        and (stat := _stat(entry)) is not None
        and stat[1] == group
        and stat[0] != "Z"
    ]


def test_the_autoscaler_launches_and_retires_a_vllm_server(
    vllm_python: str, tiny_model: Path, tmp_path: Path
) -> None:
    env = {
        **{k: v for k, v in os.environ.items() if k != "KVHERD_ADMIN_TOKEN"},
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }
    instance = (
        "http://127.0.0.1:{port},kv_events=tcp://127.0.0.1:{port1},"
        f"replay=tcp://127.0.0.1:{{port2}},pull_address=tcp://127.0.0.1:{{port3}},"
        f"max_num_seqs={MAX_NUM_SEQS}"
    )
    args = ["-n", "1", "--autoscale", "--min", "1", "--max", "2", "--model", str(tiny_model),
            "--launch", _launch_command(vllm_python, tiny_model), "--launch-instance", instance,
            "--log-dir", str(tmp_path), "--autoscale-slots", str(MAX_NUM_SEQS),
            "--target-utilization", "0.5", "--scale-in-delay", "10", "--scale-cooldown", "2",
            "--stop-timeout", "30", "--startup-timeout", "600", "--load-interval", "0.2",
            "--max-queue-wait", "600", "--standing-queue-wait", "600"]  # fmt: skip

    def prompts(k: int) -> str:
        """New conversations keep arriving (every other request), spread by load; the returning
        ones are cached on engine-0 and stay there by cache affinity."""
        conversation = k if k % 2 else k % 8
        return f"Scaling a fleet of vLLM servers, conversation {conversation}. " * 12

    with running_up(args, env, TOKEN) as up:

        def log() -> str:
            engine_log = tmp_path / "engine-1.log"
            tail = engine_log.read_text(errors="replace")[-3000:] if engine_log.exists() else ""
            return up.log() + "\n--- engine-1:\n" + tail

        up.wait_ready(600)
        assert up.serving() == ["engine-0"], log()
        step = StepLoad(up.base, 4, prompts, 64, model="tiny")
        until(lambda: "autoscale: out engine-1" in "".join(up.output), 120, "a scale-out", log)
        # The launched server's cold start competes with the step for the 2 cores (it took over
        # 10 minutes so in the full suite): the load pauses while it starts, which cannot scale
        # the fleet back in (never while an instance starts).
        step.join()
        until(lambda: up.serving() == ["engine-0", "engine-1"], 600, "engine-1 serving", log)
        engine_1 = str(up.listed()["engine-1"]["url"])
        group = _group_of(engine_1.rsplit(":", 1)[1])  # its API server, EngineCore and worker
        assert len(_live_members(group)) >= 2, "vLLM's engine core runs in the server's group"
        # The step goes on with conversations the first part never sent.
        grown = StepLoad(up.base, 4, lambda k: prompts(k + 1_000_000), 64, model="tiny")
        time.sleep(6.0)
        grown.join()
        trickle = StepLoad(up.base, 1, prompts, 64, model="tiny")
        until(lambda: up.serving() == ["engine-0"], 120, "back to engine-0 alone", log)
        until(lambda: "engine-1" not in up.listed(), 60, "engine-1 removed", log)
        trickle.join()

        # Removed from the fleet first, then stopped: SIGTERM, SIGKILL after --stop-timeout (30 s).
        # Until its processes are gone the closing server may still accept and reset a connection.
        until(lambda: not _live_members(group), 60, "engine-1's processes gone", log)
        with pytest.raises(httpx.ConnectError):  # stopped: nothing listens on its port
            httpx.get(f"{engine_1}/health", timeout=5)
        metrics = httpx.get(f"{up.base}/metrics", timeout=10).text
        outs = re.search(
            r'kvherd_scale_events_total\{direction="out",reason="load"\} (\S+)', metrics
        )
        ins = re.search(r'kvherd_scale_events_total\{direction="in",reason="load"\} (\S+)', metrics)
        assert outs and float(outs.group(1)) >= 1 and ins and float(ins.group(1)) >= 1, metrics
        # engine-1 warmed up from engine-0's conversations; engine-0 took engine-1's over.
        for cause in ("scale_out", "scale_in"):
            pulled = re.search(
                rf'kvherd_handover_blocks_total{{cause="{cause}",outcome="pulled"}} (\S+)', metrics
            )
            assert pulled and float(pulled.group(1)) > 0, (cause, metrics, log())
        answers = step.answers + grown.answers + trickle.answers
        failed = [a for a in answers if a[1] != 200]
        assert not failed, failed[:5]
        texts: dict[str, set[str]] = {}
        for prompt, _, text, _ in answers:
            texts.setdefault(prompt, set()).add(text)
        assert all(len(t) == 1 for t in texts.values()), texts  # greedy: one text per prompt
        assert {instance for *_, instance in grown.answers} == {"engine-0", "engine-1"}
