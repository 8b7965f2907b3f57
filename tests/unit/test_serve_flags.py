"""``kvherd serve``/``kvherd up`` flags: bad deadline ranges and admission waits are usage errors
(exit 2), not tracebacks."""

from __future__ import annotations

import argparse

import pytest

from scheduler.serve_cli import add_arguments


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="kvherd serve")
    add_arguments(parser)
    return parser.parse_args(list(argv))


@pytest.mark.parametrize("flag", ["--first-byte-deadline", "--inter-chunk-deadline"])
@pytest.mark.parametrize(
    "values", [("0", "5"), ("-1", "5"), ("5", "2"), ("1", "inf"), ("nan", "3")]
)
def test_a_bad_deadline_range_is_a_usage_error(
    flag: str, values: tuple[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        parse(flag, *values)
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "usage:" in err and flag in err and "0 < FLOOR <= CAP" in err


def test_good_deadline_ranges_and_the_defaults_parse() -> None:
    args = parse("--first-byte-deadline", "3", "3", "--inter-chunk-deadline", "0.5", "10")
    assert args.first_byte_deadline == [3.0, 3.0]
    assert args.inter_chunk_deadline == [0.5, 10.0]
    defaults = parse()
    assert defaults.first_byte_deadline == [10.0, 120.0]
    assert defaults.inter_chunk_deadline == [2.0, 30.0]


@pytest.mark.parametrize("flag", ["--max-queue-wait", "--standing-queue-wait"])
@pytest.mark.parametrize("value", ["0", "-1", "inf", "nan", "soon"])
def test_a_bad_admission_wait_is_a_usage_error(
    flag: str, value: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        parse(flag, value)
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "usage:" in err and flag in err and "seconds" in err


def test_admission_waits_parse() -> None:
    defaults = parse()
    assert (defaults.max_queue_wait, defaults.standing_queue_wait) == (1.0, 0.25)
    args = parse("--max-queue-wait", "2", "--standing-queue-wait", "0.5")
    assert (args.max_queue_wait, args.standing_queue_wait) == (2.0, 0.5)
