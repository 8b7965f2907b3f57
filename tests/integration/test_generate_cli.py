"""`kvherd generate`: output shape, determinism, and clean refusals (exit 2, message, no traceback)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kvherd.cli import main


def test_json_output_is_deterministic(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["generate", "--model", "tiny", "--prompt-token-ids", "1,2,3", "--max-tokens", "9"]
    assert main([*argv, "--json"]) == 0
    first = json.loads(capsys.readouterr().out)
    assert main([*argv, "--json"]) == 0
    second = json.loads(capsys.readouterr().out)
    assert first == second
    assert len(first["token_ids"]) == 9 or first["finish_reason"] == "stop"
    assert first["num_prompt_tokens"] == 3 and isinstance(first["text"], str)


def test_text_prompt_greedy_streams_text(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["generate", "--prompt", "Hello", "--max-tokens", "12", "--temperature", "0"]
    assert main([*argv, "--json", "--ignore-eos"]) == 0
    expected = json.loads(capsys.readouterr().out)["text"]
    assert main([*argv, "--ignore-eos"]) == 0
    assert capsys.readouterr().out == expected + "\n"


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        (["--prompt-token-ids", "1,x"], "comma-separated integers"),
        (["--prompt-token-ids", "1,99999"], "out of range"),
        (["--prompt", "hi", "--temperature", "-1"], "temperature"),
        (["--prompt", "hi", "--max-tokens", "0"], "max_tokens"),
        (["--prompt", "", "--max-tokens", "3"], "empty"),
        (["--prompt", "hi", "--max-tokens", "5000"], "maximum context length"),
        (["--model", "/no/such/model", "--prompt", "hi"], "unknown model"),
    ],
)
def test_bad_input_exits_2_with_message(
    extra: list[str], needle: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["generate", *extra]) == 2
    captured = capsys.readouterr()
    assert needle in captured.err and "Traceback" not in captured.err
    assert captured.out == ""


def test_bad_checkpoint_dir_exits_2(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "config.json").write_text('{"model_type": "gpt2"}')
    assert main(["generate", "--model", str(tmp_path), "--prompt", "hi"]) == 2
    assert "unsupported model_type 'gpt2'" in capsys.readouterr().err


def test_console_script_help_and_error() -> None:
    cmd = [sys.executable, "-m", "kvherd", "generate"]
    help_run = subprocess.run([*cmd, "--help"], capture_output=True, text=True, timeout=60)
    assert help_run.returncode == 0 and "--prompt-token-ids" in help_run.stdout
    bad = subprocess.run(
        [*cmd, "--prompt", "hi", "--top-p", "2"], capture_output=True, text=True, timeout=120
    )
    assert bad.returncode == 2 and "top_p" in bad.stderr and "Traceback" not in bad.stderr
