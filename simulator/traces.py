"""Trace loaders: Mooncake JSONL, the Azure LLM inference CSV, and generic JSONL/CSV.

Contract:
- Every loader returns a `Trace`: requests sorted by arrival (seconds from the first arrival), each with
  its input and output length and a tuple of *prefix block ids* (`hash_ids`) in units of
  `Trace.block_size` tokens (512 for Mooncake). Equal ids at equal positions mean an equal block of
  tokens, so `simulator.prompts.synthesize_prompt` turns ids into token ids that really share prefixes.
  Traces without prefix information get ids unique to the request; generic traces with a
  `prefix_group` share `prefix_length` tokens within the group.
- Bad input raises `TraceError` naming the file and the 1-based line (missing fields, wrong types,
  negative or zero lengths, unsorted timestamps, malformed JSON/CSV). Nothing else is raised for bad data.
- Transforms (`scale_rate`, `time_window`, `sample`, `head`) return new traces and never mutate.
"""

from __future__ import annotations

import bisect
import csv
import itertools
import json
import math
import random
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, replace
from datetime import datetime
from pathlib import Path
from typing import Any

MOONCAKE_BLOCK_SIZE = 512
# Id namespaces for synthesised block ids, far above any id a Mooncake trace uses, so synthesised
# ids never collide with real ones or with each other (request index / group in bits 20..60).
_UNIQUE_NS = 1 << 62
_GROUP_NS = 1 << 61
_MAX_BLOCKS_PER_REQUEST = 1 << 20


class TraceError(ValueError):
    """A trace that cannot be used; the message names the file and line."""

    def __init__(self, path: str | Path, line: int | None, message: str) -> None:
        where = f"{path}:{line}" if line is not None else str(path)
        super().__init__(f"{where}: {message}")
        self.path = str(path)
        self.line = line
        self.message = message


@dataclass(slots=True, frozen=True)
class TraceRequest:
    """One request of a trace; `index` is its position in the original file (stable under transforms)."""

    index: int
    arrival_s: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]
    tenant: str | None = None  # whose request (the proxy's API-key tenant), for fair share
    priority: int = 0  # its class in the admission queue (lower first)
    model: str | None = None  # the base model or LoRA adapter it names (None: any)
    parent: str | None = None  # an adapter's base model, when the trace says

    @property
    def request_id(self) -> str:
        return f"trace-{self.index}"


@dataclass(slots=True, frozen=True)
class Trace:
    name: str
    requests: list[TraceRequest]
    block_size: int = MOONCAKE_BLOCK_SIZE  # tokens per hash id
    has_prefix_info: bool = False

    def __len__(self) -> int:
        return len(self.requests)

    @property
    def has_models(self) -> bool:
        return any(r.model is not None for r in self.requests)

    @property
    def duration_s(self) -> float:
        return self.requests[-1].arrival_s - self.requests[0].arrival_s if self.requests else 0.0

    def ideal_block_hit_ratio(self) -> float:
        """Share of prefix blocks whose whole leading chain appeared in an earlier request.

        This is the hit ratio an infinitely large, perfectly routed prefix cache would reach.
        """
        seen: set[tuple[int, ...]] = set()
        total = hits = 0
        for req in self.requests:
            ids = req.hash_ids
            for j in range(len(ids)):
                key = ids[: j + 1]
                total += 1
                if key in seen:
                    hits += 1
                seen.add(key)
        return hits / total if total else 0.0


def unique_block_ids(index: int, num_blocks: int) -> tuple[int, ...]:
    base = _UNIQUE_NS | (index << 20)
    return tuple(base + j for j in range(num_blocks))


def group_block_ids(group: int, num_blocks: int) -> tuple[int, ...]:
    base = _GROUP_NS | (group << 20)
    return tuple(base + j for j in range(num_blocks))


def _blocks_for(tokens: int, block_size: int) -> int:
    return math.ceil(tokens / block_size)


# -- field validation ------------------------------------------------------------------------------


def _get(obj: Mapping[str, Any], names: tuple[str, ...], path: Path, line: int) -> Any:
    for name in names:
        if name in obj:
            return obj[name]
    raise TraceError(path, line, f"missing field {names[0]!r}")


def _int_field(value: Any, name: str, path: Path, line: int, minimum: int) -> int:
    if isinstance(value, bool):
        raise TraceError(path, line, f"{name} must be an integer, got {value!r}")
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, str):
        try:
            value = int(value.strip())
        except ValueError:
            raise TraceError(path, line, f"{name} must be an integer, got {value!r}") from None
    if not isinstance(value, int):
        raise TraceError(path, line, f"{name} must be an integer, got {value!r}")
    if value < minimum:
        raise TraceError(path, line, f"{name} must be at least {minimum}, got {value}")
    return value


def _float_field(value: Any, name: str, path: Path, line: int) -> float:
    if isinstance(value, bool):
        raise TraceError(path, line, f"{name} must be a number, got {value!r}")
    try:
        out = float(value)
    except (TypeError, ValueError):
        raise TraceError(path, line, f"{name} must be a number, got {value!r}") from None
    if not math.isfinite(out) or out < 0:
        raise TraceError(path, line, f"{name} must be a finite non-negative number, got {value!r}")
    return out


class _Builder:
    """Collects validated rows, checks arrival order, and rebases times to the first arrival."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.rows: list[TraceRequest] = []
        self.last_arrival = -math.inf
        self.has_prefix_info = False

    def add(
        self,
        line: int,
        arrival_s: float,
        input_length: int,
        output_length: int,
        hash_ids: tuple[int, ...] | None,
        block_size: int,
        model: tuple[str | None, str | None] = (None, None),
    ) -> None:
        if arrival_s < self.last_arrival:
            raise TraceError(
                self.path,
                line,
                f"timestamps are not sorted: {arrival_s:g} s comes after {self.last_arrival:g} s",
            )
        self.last_arrival = arrival_s
        index = len(self.rows)
        need = _blocks_for(input_length, block_size)
        if need > _MAX_BLOCKS_PER_REQUEST:
            raise TraceError(self.path, line, f"input_length {input_length} is too large")
        if hash_ids is None:
            ids = unique_block_ids(index, need)
        else:
            self.has_prefix_info = True
            if len(hash_ids) > need:
                raise TraceError(
                    self.path,
                    line,
                    f"{len(hash_ids)} hash_ids for input_length {input_length} "
                    f"(at most ceil({input_length}/{block_size}) = {need})",
                )
            # Blocks the trace does not name are private to the request.
            ids = hash_ids + unique_block_ids(index, need)[len(hash_ids) :]
        self.rows.append(
            TraceRequest(
                index, arrival_s, input_length, output_length, ids, model=model[0], parent=model[1]
            )
        )

    def build(self, name: str, block_size: int) -> Trace:
        if not self.rows:
            raise TraceError(self.path, None, "the trace holds no requests")
        t0 = self.rows[0].arrival_s
        rows = [replace(r, arrival_s=r.arrival_s - t0) for r in self.rows] if t0 else self.rows
        return Trace(name, rows, block_size, self.has_prefix_info)


def _model(obj: Mapping[str, Any], path: Path, line: int) -> tuple[str | None, str | None]:
    """(model, parent) of a row: non-empty strings, or None where absent or empty."""
    out: list[str | None] = []
    for name in ("model", "parent"):
        value = obj.get(name)
        if value is not None and not isinstance(value, str):
            raise TraceError(path, line, f"{name} must be a string, got {value!r}")
        out.append(None if value is None else (value.strip() or None))
    if out[1] is not None and out[0] is None:
        raise TraceError(path, line, f"parent {out[1]!r} given without a model")
    return out[0], out[1]


def _hash_ids(value: Any, path: Path, line: int) -> tuple[int, ...]:
    if not isinstance(value, list):
        raise TraceError(
            path, line, f"hash_ids must be a list of integers, got {type(value).__name__}"
        )
    for v in value:
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise TraceError(path, line, f"hash_ids must hold non-negative integers, got {v!r}")
    return tuple(value)


# -- JSONL ---------------------------------------------------------------------------------------


def _iter_jsonl(path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    with path.open("r", encoding="utf-8") as f:
        for line_no, raw in enumerate(f, start=1):
            text = raw.strip()
            if not text:
                continue
            try:
                obj = json.loads(text)
            except json.JSONDecodeError as exc:
                raise TraceError(path, line_no, f"malformed JSON ({exc.msg})") from None
            if not isinstance(obj, dict):
                raise TraceError(path, line_no, "each line must be a JSON object")
            yield line_no, obj


def load_jsonl(path: Path, block_size: int = MOONCAKE_BLOCK_SIZE) -> Trace:
    """Mooncake JSONL (`timestamp` ms, `input_length`, `output_length`, `hash_ids`) or generic JSONL.

    Generic lines carry `arrival_s` (seconds) instead of `timestamp`, and may group requests that share
    a prefix with `prefix_group` (int) and `prefix_length` (tokens). Any line may name a `model`
    (and an adapter's `parent`).
    """
    builder = _Builder(path)
    for line, obj in _iter_jsonl(path):
        if "arrival_s" in obj:
            arrival = _float_field(obj["arrival_s"], "arrival_s", path, line)
        else:
            arrival = _float_field(_get(obj, ("timestamp",), path, line), "timestamp", path, line)
            arrival /= 1000.0
        inp = _int_field(_get(obj, ("input_length",), path, line), "input_length", path, line, 1)
        out = _int_field(_get(obj, ("output_length",), path, line), "output_length", path, line, 1)
        ids: tuple[int, ...] | None = None
        if "hash_ids" in obj:
            ids = _hash_ids(obj["hash_ids"], path, line)
        elif obj.get("prefix_group") is not None:
            ids = _group_prefix(obj, inp, block_size, path, line)
        builder.add(line, arrival, inp, out, ids, block_size, _model(obj, path, line))
    return builder.build(path.name, block_size)


def _group_prefix(
    obj: Mapping[str, Any], input_length: int, block_size: int, path: Path, line: int
) -> tuple[int, ...]:
    group = _int_field(obj["prefix_group"], "prefix_group", path, line, 0)
    length = _int_field(obj.get("prefix_length", 0), "prefix_length", path, line, 0)
    if length > input_length:
        raise TraceError(path, line, f"prefix_length {length} exceeds input_length {input_length}")
    # Only whole blocks are shared; the partial tail of the prefix stays private.
    return group_block_ids(group, length // block_size)


# -- CSV -----------------------------------------------------------------------------------------


def _azure_time(text: str, path: Path, line: int) -> float:
    # Azure writes 7 fractional digits, which datetime.fromisoformat may reject; split them off.
    base, _, frac = text.strip().partition(".")
    try:
        seconds = datetime.fromisoformat(base).timestamp()
        return seconds + (float("0." + frac) if frac else 0.0)
    except ValueError:
        raise TraceError(path, line, f"TIMESTAMP {text!r} is not a date-time") from None


def load_csv(path: Path, block_size: int = MOONCAKE_BLOCK_SIZE) -> Trace:
    """Azure LLM inference CSV (`TIMESTAMP,ContextTokens,GeneratedTokens`) or generic CSV
    (`arrival_s,input_length,output_length[,prefix_group,prefix_length]`); either may add
    `model` and `parent` columns."""
    builder = _Builder(path)
    with path.open("r", encoding="utf-8", newline="") as f:
        reader = csv.reader(f)
        try:
            header = [h.strip() for h in next(reader)]
        except StopIteration:
            raise TraceError(path, 1, "empty file") from None
        except csv.Error as exc:
            raise TraceError(path, 1, f"malformed CSV ({exc})") from None
        azure = {"TIMESTAMP", "ContextTokens", "GeneratedTokens"} <= set(header)
        required = (
            ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
            if azure
            else ("arrival_s", "input_length", "output_length")
        )
        missing = [c for c in required if c not in header]
        if missing:
            raise TraceError(
                path,
                1,
                f"header lacks column(s) {', '.join(missing)}; expected Azure "
                "(TIMESTAMP,ContextTokens,GeneratedTokens) or generic "
                "(arrival_s,input_length,output_length[,prefix_group,prefix_length])",
            )
        col = {name: header.index(name) for name in header}
        try:
            for row in reader:
                line = reader.line_num
                if not row or all(not c.strip() for c in row):
                    continue
                if len(row) != len(header):
                    raise TraceError(path, line, f"expected {len(header)} columns, got {len(row)}")
                if azure:
                    arrival = _azure_time(row[col["TIMESTAMP"]], path, line)
                    inp_raw, out_raw = row[col["ContextTokens"]], row[col["GeneratedTokens"]]
                else:
                    arrival = _float_field(row[col["arrival_s"]], "arrival_s", path, line)
                    inp_raw, out_raw = row[col["input_length"]], row[col["output_length"]]
                name_in = "ContextTokens" if azure else "input_length"
                name_out = "GeneratedTokens" if azure else "output_length"
                inp = _int_field(inp_raw, name_in, path, line, 1)
                out = _int_field(out_raw, name_out, path, line, 1)
                ids = None
                if not azure and "prefix_group" in col and row[col["prefix_group"]].strip():
                    fields = {"prefix_group": row[col["prefix_group"]]}
                    if "prefix_length" in col:
                        fields["prefix_length"] = row[col["prefix_length"]] or "0"
                    ids = _group_prefix(fields, inp, block_size, path, line)
                names: dict[str, str] = {
                    name: row[col[name]] for name in ("model", "parent") if name in col
                }
                builder.add(line, arrival, inp, out, ids, block_size, _model(names, path, line))
        except csv.Error as exc:
            raise TraceError(path, reader.line_num, f"malformed CSV ({exc})") from None
    return builder.build(path.name, block_size)


def load_trace(path: str | Path, block_size: int = MOONCAKE_BLOCK_SIZE) -> Trace:
    """Load a trace by extension (.jsonl/.json -> JSONL, .csv -> CSV)."""
    if block_size < 1:
        raise ValueError(f"the trace's block size must be positive, got {block_size}")
    p = Path(path)
    if not p.is_file():
        raise TraceError(p, None, "no such file")
    suffix = p.suffix.lower()
    try:
        if suffix in (".jsonl", ".json", ".ndjson"):
            return load_jsonl(p, block_size)
        if suffix == ".csv":
            return load_csv(p, block_size)
    except UnicodeDecodeError:
        raise TraceError(p, None, "not UTF-8 text") from None
    raise TraceError(p, None, f"unknown trace format {suffix!r}; expected .jsonl or .csv")


# -- transforms ----------------------------------------------------------------------------------


def scale_rate(trace: Trace, factor: float) -> Trace:
    """Multiply the arrival rate by `factor` (arrival times divided by it)."""
    if not factor > 0:
        raise ValueError(f"rate scale must be positive, got {factor}")
    rows = [replace(r, arrival_s=r.arrival_s / factor) for r in trace.requests]
    return replace(trace, requests=rows)


def time_window(trace: Trace, start_s: float, end_s: float | None) -> Trace:
    """Requests arriving in [start_s, end_s), times rebased to the window start."""
    rows = [
        replace(r, arrival_s=r.arrival_s - start_s)
        for r in trace.requests
        if r.arrival_s >= start_s and (end_s is None or r.arrival_s < end_s)
    ]
    return replace(trace, requests=rows)


def diurnal(trace: Trace, period_s: float, trough: float) -> Trace:
    """The same requests in the same order over the same span, arrival times warped so that the
    rate follows a day: `trough` of the peak at the start of each `period_s`, the peak halfway
    (rate(t) proportional to trough + (1 - trough) * (1 - cos(2 pi t / period_s)) / 2)."""
    if not period_s > 0 or not 0 < trough <= 1:
        raise ValueError(f"diurnal needs period > 0 and 0 < trough <= 1, got {period_s}, {trough}")
    if len(trace.requests) < 2:
        return trace
    first = min(r.arrival_s for r in trace.requests)
    span = max(r.arrival_s for r in trace.requests) - first
    if span <= 0:
        return trace
    grid = [span * k / 4096 for k in range(4097)]
    shape = [trough + (1 - trough) * (1 - math.cos(2 * math.pi * t / period_s)) / 2 for t in grid]
    cumulative = [0.0]
    for a, b in itertools.pairwise(shape):
        cumulative.append(cumulative[-1] + (a + b) / 2)
    scale = span / cumulative[-1]
    cumulative = [c * scale for c in cumulative]  # the warped clock's time, on the trace's span

    def warp(t: float) -> float:  # invert the cumulative rate by linear interpolation
        k = bisect.bisect_left(cumulative, t)
        if k == 0:
            return grid[0]
        low, high = cumulative[k - 1], cumulative[min(k, len(grid) - 1)]
        share = 0.0 if high == low else (t - low) / (high - low)
        return grid[k - 1] + share * (grid[min(k, len(grid) - 1)] - grid[k - 1])

    rows = [replace(r, arrival_s=first + warp(r.arrival_s - first)) for r in trace.requests]
    return replace(trace, requests=rows)


def parse_diurnal(text: str) -> tuple[float, float]:
    """``--diurnal PERIOD:TROUGH`` -> (period_s, trough); ValueError otherwise."""
    period, sep, trough = text.partition(":")
    if not sep:
        raise ValueError(f"--diurnal must be PERIOD:TROUGH, got {text!r}")
    return float(period), float(trough)


def sample(trace: Trace, fraction: float, seed: int) -> Trace:
    """Keep each request with probability `fraction` (deterministic for a seed)."""
    if not 0 < fraction <= 1:
        raise ValueError(f"sample fraction must be in (0, 1], got {fraction}")
    rng = random.Random(seed)
    rows = [r for r in trace.requests if rng.random() < fraction]
    return replace(trace, requests=rows)


def head(trace: Trace, count: int) -> Trace:
    return replace(trace, requests=trace.requests[: max(count, 0)])
