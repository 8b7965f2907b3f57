"""`kvherd replay`: send a trace to an OpenAI-compatible endpoint; write `kvherd sim`'s report format.

Prints the markdown table (one column, labelled `--label`, default "replay") and writes
`summary.json`, `summary.csv`, `requests_<label>.csv` and `ttft_cdf.png` to --out, so a real and a
simulated run compare column by column. Bad traces or an unusable endpoint exit with status 2 and
one line on stderr.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("trace", help="trace file (.jsonl/.csv) or synthetic:... (see kvherd sim)")
    parser.add_argument(
        "--url", required=True, help="endpoint base URL, e.g. http://127.0.0.1:8000"
    )
    parser.add_argument(
        "--id-block-size",
        type=int,
        default=512,
        help="tokens per hash id in the trace (default 512, Mooncake's)",
    )
    parser.add_argument("--model", default=None, help="model name (default: first of /v1/models)")
    parser.add_argument("--rate-scale", type=float, default=1.0, help="multiply the arrival rate")
    parser.add_argument("--max-requests", type=int, default=None, help="first K requests only")
    parser.add_argument(
        "--vocab-size",
        type=int,
        default=256,
        help="synthetic token ids lie in [3, VOCAB) (default 256: valid for every kvherd model)",
    )
    parser.add_argument("--slo-ttft", type=float, default=None, metavar="MS", help="TTFT SLO (ms)")
    parser.add_argument("--slo-tpot", type=float, default=None, metavar="MS", help="TPOT SLO (ms)")
    parser.add_argument("--timeout", type=float, default=600.0, help="per-request timeout (s)")
    parser.add_argument("--max-concurrency", type=int, default=None, help="cap open connections")
    parser.add_argument("--api-key", default=None, help="bearer token (default: $OPENAI_API_KEY)")
    parser.add_argument("--label", default="replay", help="column label in the report")
    parser.add_argument("--out", required=True, type=Path, help="output directory")
    parser.add_argument("--no-plots", action="store_true", help="skip the PNG plot")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")


def _fail(message: str) -> int:
    print(f"kvherd replay: error: {message}", file=sys.stderr)
    return 2


def run(args: argparse.Namespace) -> int:
    import asyncio
    import os

    from tqdm import tqdm

    from simulator import report
    from simulator.replay import ReplayConfig, ReplayError, replay
    from simulator.synthetic import generate, parse_spec
    from simulator.traces import TraceError, head, load_trace, scale_rate

    if args.vocab_size <= 3:
        return _fail("--vocab-size must be larger than 3")
    try:
        trace = (
            generate(parse_spec(args.trace))
            if args.trace.startswith("synthetic:")
            else load_trace(args.trace, args.id_block_size)
        )
        if args.max_requests is not None:
            trace = head(trace, args.max_requests)
        trace = scale_rate(trace, args.rate_scale)
    except (TraceError, ValueError) as exc:
        return _fail(str(exc))
    if not trace.requests:
        return _fail("no requests left after --max-requests")
    config = ReplayConfig(
        url=args.url.rstrip("/"),
        model=args.model,
        vocab_size=args.vocab_size,
        timeout_s=args.timeout,
        api_key=args.api_key or os.environ.get("OPENAI_API_KEY"),
        max_concurrency=args.max_concurrency,
    )
    bar = tqdm(total=len(trace), unit="req", file=sys.stderr, disable=True if args.quiet else None)
    try:
        result = asyncio.run(replay(trace, config, on_progress=bar.update))
    except ReplayError as exc:
        return _fail(str(exc))
    finally:
        bar.close()
    summary = result.metrics.summary(args.slo_ttft, args.slo_tpot)
    summary["errors"] = dict(result.errors)
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    results = {args.label: summary}
    meta = {
        "trace": str(args.trace),
        "requests": len(trace),
        "rate_scale": args.rate_scale,
        "url": config.url,
        "model": result.model,
        "wall_s": result.wall_s,
        # How late the client sent requests against the trace (a simulation assumes on time).
        "send_lag_ms_max": max(result.send_lag_s, default=0.0) * 1000.0,
        "slo_ttft_ms": args.slo_ttft,
        "slo_tpot_ms": args.slo_tpot,
    }
    cols = result.metrics.columns()
    report.write_json(out, meta, results)
    report.write_summary_csv(out, results)
    report.write_requests_csv(out, args.label, cols)
    if not args.no_plots:
        report.plot_ttft_cdf(out, {args.label: (cols["first_token"] - cols["arrival"]) * 1000.0})
    print(f"{len(trace)} requests to {config.url} ({result.model}) in {result.wall_s:.1f} s")
    print(report.markdown_table(results))
    for reason, count in sorted(result.errors.items()):
        print(f"failed: {count} x {reason}", file=sys.stderr)
    return 0
