"""The load report's Prometheus scanner reads what prometheus_client's parser reads, on a page a
real vLLM 0.32 served (tests/support/vllm_metrics_0.32.txt, a tiny Llama after 10 requests), and
refuses the malformed lines it is asked to read."""

from __future__ import annotations

from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from scheduler.core.load_report import LoadReportError, parse_prometheus
from scheduler.core.prom_text import samples

PAGE = (Path(__file__).parents[1] / "support" / "vllm_metrics_0.32.txt").read_text()


def test_every_sample_of_a_real_vllm_page_reads_as_prometheus_client_reads_it() -> None:
    reference = [
        (s.name, s.labels, s.value)
        for family in text_string_to_metric_families(PAGE)
        for s in family.samples
    ]
    names = {name for name, _, _ in reference}
    assert len(reference) > 400
    ours = list(samples(PAGE, names))
    assert len(ours) == len(reference)
    for (name, labels, value), (r_name, r_labels, r_value) in zip(ours, reference, strict=True):
        assert (name, labels) == (r_name, r_labels)
        assert value == r_value or (value != value and r_value != r_value)  # NaN


def test_the_load_report_of_the_real_page() -> None:
    report = parse_prometheus(PAGE)
    assert (report.num_running, report.num_waiting, report.num_preemptions) == (0, 0, 0)
    assert (report.num_total_blocks, report.block_size, report.num_deferred) == (8192, 128, 0)


def test_escapes_nan_and_timestamps() -> None:
    text = (
        'm{a="x\\"y",b="p\\\\q",c="l\\nm"} 1.5 1700000000\n'
        "m NaN\n"
        'm{d="1",} +Inf\n'
        "other_bucket{le=\"1\"} 3\n"
    )
    got = list(samples(text, {"m"}))
    assert got[0] == ("m", {"a": 'x"y', "b": "p\\q", "c": "l\nm"}, 1.5)
    assert got[1][2] != got[1][2]
    assert got[2] == ("m", {"d": "1"}, float("inf"))
    assert len(got) == 3


@pytest.mark.parametrize(
    "line",
    [
        "vllm:num_requests_running{ 3",
        'vllm:num_requests_running{a="1" b="2"} 3',
        'vllm:num_requests_running{a=1} 3',
        "vllm:num_requests_running",
        "vllm:num_requests_running three",
    ],
)
def test_malformed_wanted_lines_are_refused(line: str) -> None:
    with pytest.raises(LoadReportError):
        parse_prometheus(line + "\n")
