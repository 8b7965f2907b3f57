"""``kvherd up --launch``'s templates: placeholders filled per instance, a JSON flag's braces left
alone, and templates that cannot work refused before anything starts (exit 2, the reason said)."""

from __future__ import annotations

import subprocess
import sys

from scheduler.command_launcher import check_templates, fields_for, fill

FIELDS = fields_for("engine-3", [9000, 9001, 9002, 9003], 1, host="10.0.0.7")


def test_placeholders_are_filled_and_json_braces_kept() -> None:
    flag = '{"endpoint": "tcp://*:{port1}", "replay_endpoint": "tcp://127.0.0.1:{port2}"}'
    assert (
        fill(flag, FIELDS)
        == '{"endpoint": "tcp://*:9001", "replay_endpoint": "tcp://127.0.0.1:9002"}'
    )
    assert (
        fill("--host {host} --port {port} --name {id} {other}", FIELDS)
        == "--host 10.0.0.7 --port 9000 --name engine-3 {other}"
    )
    assert fields_for("engine-0", [1, 2, 3, 4], 0)["host"] == "127.0.0.1"
    assert check_templates("vllm serve --port {port}", "http://{host}:{port}") is None


def test_templates_that_cannot_work_are_named() -> None:
    assert check_templates("vllm serve --port {port}", "http://127.0.0.1:{port}") is None
    assert check_templates("   ", "http://127.0.0.1:{port}") == "--launch: empty command"
    bad = check_templates("vllm", "127.0.0.1:{port}")
    assert bad is not None and "expected http://host:port" in bad
    unknown = check_templates("vllm", "http://127.0.0.1:{port},speed=fast")
    assert unknown is not None and "unknown option" in unknown
    assert check_templates("vllm 'unclosed", "http://127.0.0.1:{port}") is not None


def test_up_refuses_a_bad_launch_before_starting_anything() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "kvherd", "up", "--launch", "vllm", "--launch-instance", "ftp://x"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 2, result.stderr
    assert "expected http://host:port" in result.stderr
    result = subprocess.run(
        [sys.executable, "-m", "kvherd", "up", "--launch", "vllm", "--prefill", "1"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 2 and "not with --prefill or --decode" in result.stderr
