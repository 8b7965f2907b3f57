"""`kvherd agent` command line: light imports, endpoint defaults, clean refusal of bad settings."""

from __future__ import annotations

import subprocess
import sys

from agent_process import free_port

from instance_agent.agent_cli import _advertised, _replay_default


def test_endpoint_helpers() -> None:
    assert _replay_default("tcp://*:5557") == "tcp://*:5558"
    assert _replay_default("tcp://127.0.0.1:*") == "tcp://127.0.0.1:*"
    assert _advertised("tcp://0.0.0.0:5557", "node-3") == "tcp://node-3:5557"
    assert _advertised("tcp://*:5557", "node-3") == "tcp://node-3:5557"
    assert _advertised("tcp://127.0.0.1:5557", "node-3") == "tcp://127.0.0.1:5557"
    assert _advertised(None, "node-3") is None


def test_argument_parsing_imports_nothing_heavy() -> None:
    code = (
        "import sys; from kvherd import cli; cli._build_parser('agent');"
        "heavy = {'torch', 'fastapi', 'uvicorn', 'zmq'} & set(sys.modules); print(sorted(heavy))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def _agent(*args: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "kvherd", "agent", "--port", str(free_port()), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


def test_bad_settings_exit_2_with_a_message() -> None:
    result = _agent("--model", "/no/such/checkpoint")
    assert result.returncode == 2
    assert "cannot start the engine" in result.stderr and "unknown model" in result.stderr
    result = _agent("--kv-events-endpoint", "tcp://999.1.1.1:5")
    assert result.returncode == 2 and "cannot bind KV event sockets" in result.stderr
