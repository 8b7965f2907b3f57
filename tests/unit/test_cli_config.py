"""``--config FILE`` takes a command's flags as YAML: the run the flags give, flags win, bad keys exit 2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvherd.cli import _build_parser, main

ROOT = Path(__file__).resolve().parents[2]
TRACE = str(ROOT / "traces" / "mooncake" / "synthetic_trace_600.jsonl")


def _parse(command: str, argv: list[str]) -> dict[str, object]:
    full = [command, *argv]
    return vars(_build_parser(command, full).parse_args(full))


def _summary(out: Path) -> dict[str, object]:
    return json.loads((out / "summary.json").read_text())


def test_a_sim_run_from_the_file_equals_the_run_from_flags(tmp_path: Path) -> None:
    flags = ["--instances", "3", "--policy", "kvherd", "--max-requests", "40", "--no-plots"]
    assert main(["sim", TRACE, *flags, "--quiet", "--out", str(tmp_path / "flags")]) == 0
    config = tmp_path / "sim.yaml"
    config.write_text(
        f"trace: {TRACE}\ninstances: 3\npolicy: kvherd\nmax_requests: 40\nno-plots: true\n"
        f"quiet: true\nout: {tmp_path / 'file'}\n"
    )
    assert main(["sim", "--config", str(config)]) == 0
    assert _summary(tmp_path / "file") == _summary(tmp_path / "flags")


def test_flags_given_win_over_the_file(tmp_path: Path) -> None:
    config = tmp_path / "agent.yaml"
    config.write_text("port: 9100\nmax-num-seqs: 8\nkv_events_endpoint: tcp://*:5599\n")
    args = _parse("agent", ["--config", str(config), "--port", "9200"])
    assert (args["port"], args["max_num_seqs"]) == (9200, 8)
    assert args["kv_events_endpoint"] == "tcp://*:5599"


def test_a_string_value_is_parsed_as_on_the_command_line(tmp_path: Path) -> None:
    config = tmp_path / "agent.yaml"
    config.write_text("max-num-seqs: '12'\n")
    assert _parse("agent", ["--config", str(config)])["max_num_seqs"] == 12


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("bogus: 1\n", "'bogus' is not a flag"),
        ("- a list\n", "expected a mapping"),
        ("instances: [\n", "--config"),
    ],
)
def test_a_bad_file_is_a_usage_error_naming_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str, message: str
) -> None:
    config = tmp_path / "bad.yaml"
    config.write_text(text)
    with pytest.raises(SystemExit) as exit_info:
        _parse("sim", ["--config", str(config)])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert message in err and str(config) in err
