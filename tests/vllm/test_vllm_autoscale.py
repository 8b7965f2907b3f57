"""``kvherd up --launch``: the autoscaler starts and removes real vLLM servers from a command template.

One vLLM server at start (``-n 1``); a load step of 4 streams (each server sized for 2 in flight)
makes the controller launch a second from the same template (the load pauses while it starts),
which the proxy adds once its ``/health`` answers (its KV events subscribed) and once it has
pulled the first's hottest prefixes through kvherd's KV connector (the warm-up); the grown fleet
serves part of the step's new conversations; when the load falls to one stream the one whose
removal loses least (after the warm-up, either) is drained, the survivor pulls the prefixes only
it holds (the hand-over), and it is removed and stopped: its port is closed and no process of it
is left. Every request
answers 200 with the same greedy text per prompt on either server (same checkpoint), and the
scale events are counted.
"""

from __future__ import annotations

import json
import os
import shlex
import time
from pathlib import Path

import httpx
import pytest
from kvherd_up import running_up
from step_load import StepLoad, assert_served, until
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
            logs = [up.log()]
            for name in ("engine-0", "engine-1"):
                path = tmp_path / f"{name}.log"
                if path.exists():
                    logs.append(f"--- {name}:\n" + path.read_text(errors="replace")[-2000:])
            return "\n".join(logs)

        up.wait_ready(600)
        assert up.serving() == ["engine-0"], log()
        step = StepLoad(up.base, 4, prompts, 64, model="tiny")
        until(lambda: "autoscale: out engine-1" in "".join(up.output), 120, "a scale-out", log)
        # The launched server's cold start competes with the step for the 2 cores (it took over
        # 10 minutes so in the full suite): the load pauses while it starts, which cannot scale
        # the fleet back in (never while an instance starts).
        step.join()
        until(lambda: up.serving() == ["engine-0", "engine-1"], 600, "engine-1 serving", log)
        urls = {i: str(d["url"]) for i, d in up.listed().items()}
        # Each server's API server, EngineCore and worker share its process group.
        groups = {i: _group_of(url.rsplit(":", 1)[1]) for i, url in urls.items()}
        assert len(_live_members(groups["engine-1"])) >= 2, "vLLM's engine core runs in its group"
        # The step goes on with conversations the first part never sent.
        grown = StepLoad(up.base, 4, lambda k: prompts(k + 1_000_000), 64, model="tiny")
        time.sleep(6.0)
        grown.join()
        trickle = StepLoad(up.base, 1, prompts, 64, model="tiny")
        until(lambda: len(up.serving()) == 1, 120, "back to one server", log)
        # The one whose removal loses least goes: after engine-1's warm-up, either may.
        (gone,) = set(urls) - set(up.serving())
        until(lambda: gone not in up.listed(), 60, f"{gone} removed", log)
        trickle.join()

        # Removed from the fleet first, then stopped: SIGTERM, SIGKILL after --stop-timeout (30 s).
        # Until its processes are gone the closing server may still accept and reset a connection.
        until(lambda: not _live_members(groups[gone]), 60, f"{gone}'s processes gone", log)
        with pytest.raises(httpx.ConnectError):  # stopped: nothing listens on its port
            httpx.get(f"{urls[gone]}/health", timeout=5)
        assert up.metric("kvherd_scale_events_total", direction="out", reason="load") >= 1
        assert up.metric("kvherd_scale_events_total", direction="in", reason="load") >= 1
        # engine-1 warmed up from engine-0's conversations; the survivor took the other's over.
        for cause in ("scale_out", "scale_in"):
            pulled = up.metric("kvherd_handover_blocks_total", cause=cause, outcome="pulled")
            assert pulled > 0, (cause, log())
        assert_served(step, grown, trickle)
        assert {instance for *_, instance in grown.answers} == {"engine-0", "engine-1"}
