"""Trace loaders, prompt synthesis and synthetic traces: real files, transforms, error messages."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from kvherd.block_hash import block_hash_chain
from simulator.prompts import synthesize_prompt
from simulator.synthetic import SyntheticSpec, generate, parse_spec
from simulator.traces import TraceError, head, load_trace, sample, scale_rate, time_window

TRACES = Path(__file__).resolve().parents[2] / "traces"  # the repository's samples (its README)
MOONCAKE = TRACES / "mooncake" / "synthetic_trace_600.jsonl"
AZURE = TRACES / "azure-llm-2023" / "AzureLLMInferenceTrace_conv_1500.csv"
AZURE_CODE = TRACES / "azure-llm-2023" / "AzureLLMInferenceTrace_code_1500.csv"


def test_mooncake_trace_facts() -> None:
    trace = load_trace(MOONCAKE)
    assert len(trace) == 600
    assert trace.has_prefix_info and trace.block_size == 512
    assert trace.duration_s == pytest.approx(165.837)
    mean_input = sum(r.input_length for r in trace.requests) / len(trace)
    assert mean_input == pytest.approx(12358, abs=1)
    # The traces README's fact: an ideal cache hits 11% of these 600 requests' blocks.
    assert trace.ideal_block_hit_ratio() == pytest.approx(0.11, abs=0.005)
    for r in trace.requests[:50]:
        assert len(r.hash_ids) == math.ceil(r.input_length / 512)


def test_azure_trace_facts() -> None:
    trace = load_trace(AZURE)
    assert len(trace) == 1500
    assert not trace.has_prefix_info
    assert trace.requests[0].arrival_s == 0.0
    # 18:15:46.6805900 -> 18:15:50.9951690
    assert trace.requests[1].arrival_s == pytest.approx(4.314579, abs=1e-5)
    assert trace.duration_s == pytest.approx(309.528, abs=1e-3)  # the README's 310 s
    assert sum(r.input_length for r in trace.requests) / len(trace) == pytest.approx(1067, abs=1)
    # No prefix information: every request's blocks are its own.
    assert trace.ideal_block_hit_ratio() == 0.0
    code = load_trace(AZURE_CODE)
    assert len(code) == 1500 and code.duration_s == pytest.approx(604.198, abs=1e-3)


def _write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def _jsonl(*rows: dict[str, object]) -> str:
    return "".join(json.dumps(r) + "\n" for r in rows)


@pytest.mark.parametrize(
    ("name", "text", "line", "needle"),
    [
        (
            "a.jsonl",
            _jsonl({"timestamp": 0, "input_length": 5}),
            1,
            "missing field 'output_length'",
        ),
        (
            "b.jsonl",
            _jsonl(
                {"timestamp": 0, "input_length": 5, "output_length": 2},
                {"timestamp": 0, "input_length": -3, "output_length": 2},
            ),
            2,
            "input_length must be at least 1",
        ),
        (
            "c.jsonl",
            _jsonl(
                {"timestamp": 10, "input_length": 5, "output_length": 2},
                {"timestamp": 20, "input_length": 5, "output_length": 2},
                {"timestamp": 5, "input_length": 5, "output_length": 2},
            ),
            3,
            "not sorted",
        ),
        (
            "d.jsonl",
            '{"timestamp": 0, "input_length": 5, "output_length": 2}\n{oops\n',
            2,
            "malformed JSON",
        ),
        ("e.jsonl", "[1, 2]\n", 1, "JSON object"),
        (
            "f.jsonl",
            _jsonl(
                {"timestamp": 0, "input_length": 600, "output_length": 2, "hash_ids": [1, 2, 3]}
            ),
            1,
            "3 hash_ids",
        ),
        (
            "g.jsonl",
            _jsonl({"timestamp": 0, "input_length": 6, "output_length": "x"}),
            1,
            "output_length must be an integer",
        ),
        ("h.csv", "arrival_s,input_length\n0,5\n", 1, "lacks column(s) output_length"),
        ("i.csv", "arrival_s,input_length,output_length\n0,5,2\n1,5\n", 3, "expected 3 columns"),
        (
            "j.csv",
            "TIMESTAMP,ContextTokens,GeneratedTokens\nnot-a-date,5,2\n",
            2,
            "not a date-time",
        ),
        (
            "k.csv",
            "arrival_s,input_length,output_length\n0,5,0\n",
            2,
            "output_length must be at least 1",
        ),
        ("l.csv", "arrival_s,input_length,output_length\n-1,5,2\n", 2, "non-negative"),
    ],
)
def test_bad_traces_name_the_line(
    tmp_path: Path, name: str, text: str, line: int, needle: str
) -> None:
    path = _write(tmp_path, name, text)
    with pytest.raises(TraceError) as info:
        load_trace(path)
    assert info.value.line == line
    assert f"{path}:{line}: " in str(info.value)
    assert needle in str(info.value)


def test_missing_and_unknown_files(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match="no such file"):
        load_trace(tmp_path / "nope.jsonl")
    with pytest.raises(TraceError, match="unknown trace format"):
        load_trace(_write(tmp_path, "x.txt", "hello"))
    with pytest.raises(TraceError, match="no requests"):
        load_trace(_write(tmp_path, "empty.jsonl", "\n"))


def test_generic_formats_share_group_prefixes(tmp_path: Path) -> None:
    jsonl = _write(
        tmp_path,
        "g.jsonl",
        _jsonl(
            {
                "arrival_s": 1.5,
                "input_length": 1500,
                "output_length": 3,
                "prefix_group": 7,
                "prefix_length": 1100,
            },
            {
                "arrival_s": 2.0,
                "input_length": 1200,
                "output_length": 4,
                "prefix_group": 7,
                "prefix_length": 1100,
            },
            {"arrival_s": 2.5, "input_length": 1200, "output_length": 4},
        ),
    )
    csv_path = _write(
        tmp_path,
        "g.csv",
        "arrival_s,input_length,output_length,prefix_group,prefix_length\n"
        "1.5,1500,3,7,1100\n2.0,1200,4,7,1100\n2.5,1200,4,,\n",
    )
    for path in (jsonl, csv_path):
        trace = load_trace(path)
        a, b, c = trace.requests
        assert a.arrival_s == 0.0 and b.arrival_s == pytest.approx(0.5)
        assert a.hash_ids[:2] == b.hash_ids[:2]  # 1100 tokens -> two whole 512-token blocks
        assert a.hash_ids[2] != b.hash_ids[2]
        assert not set(c.hash_ids) & (set(a.hash_ids) | set(b.hash_ids))
        assert trace.ideal_block_hit_ratio() == pytest.approx(2 / 9)


def test_prompt_synthesis_shares_exact_prefixes() -> None:
    a = synthesize_prompt((11, 12, 13), 1400).tolist()
    b = synthesize_prompt((11, 12, 99), 1300).tolist()
    c = synthesize_prompt((12, 11), 900).tolist()
    assert len(a) == 1400 and len(b) == 1300
    assert a[:1024] == b[:1024] and a[1024:1030] != b[1024:1030]
    assert a[:512] != c[:512]  # another first block
    assert (
        synthesize_prompt((11,), 512).tolist() == a[:512]
    )  # deterministic, position-independent per id
    assert min(a) >= 3 and max(a) < 256  # the default alphabet fits every kvherd vocabulary
    big = synthesize_prompt((11,), 512, vocab_size=32000, low=1000).tolist()
    assert min(big) >= 1000 and max(big) < 32000
    # Engine blocks of 16 inside shared 512-token blocks hash identically.
    ha, hb = block_hash_chain(a, 16), block_hash_chain(b, 16)
    assert ha[:64] == hb[:64] and ha[64] != hb[64]
    with pytest.raises(ValueError):
        synthesize_prompt((1,), 513)
    with pytest.raises(ValueError):
        synthesize_prompt((1,), 16, low=256)


def test_transforms() -> None:
    trace = generate(SyntheticSpec(requests=400, rate=20.0, seed=3))
    faster = scale_rate(trace, 2.0)
    assert faster.requests[-1].arrival_s == pytest.approx(trace.requests[-1].arrival_s / 2)
    window = time_window(trace, 5.0, 10.0)
    assert all(0 <= r.arrival_s < 5.0 for r in window.requests)
    assert len(window) == sum(1 for r in trace.requests if 5.0 <= r.arrival_s < 10.0)
    half = sample(trace, 0.5, seed=1)
    assert half.requests == sample(trace, 0.5, seed=1).requests
    assert 150 < len(half) < 250
    assert len(head(trace, 10)) == 10
    with pytest.raises(ValueError):
        scale_rate(trace, 0.0)


def test_synthetic_generator() -> None:
    spec = parse_spec(
        "synthetic:requests=3000,rate=50,cv=2,num_groups=20,prefix_tokens=2048,seed=5"
    )
    trace = generate(spec)
    assert trace.requests == generate(spec).requests  # a pure function of the spec
    assert len(trace) == 3000
    assert len(trace) / trace.duration_s == pytest.approx(50, rel=0.15)
    gaps = [
        b.arrival_s - a.arrival_s for a, b in zip(trace.requests, trace.requests[1:], strict=False)
    ]
    mean = sum(gaps) / len(gaps)
    cv = (sum((g - mean) ** 2 for g in gaps) / len(gaps)) ** 0.5 / mean
    assert cv == pytest.approx(2.0, rel=0.2)
    assert trace.ideal_block_hit_ratio() > 0.2  # groups share their prefix blocks
    with pytest.raises(ValueError, match="bad item"):
        parse_spec("synthetic:nope=3")
