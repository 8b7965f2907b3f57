"""`kvherd profile --url URL`: the simulator's latency model, fitted from outside a running server.

Contract:
- Speaks only the OpenAI completions API (prompts as token-id lists, ``max_tokens``, ``ignore_eos``,
  streaming with usage) and reads ``/metrics`` for ``vllm:cache_config_info`` (block size, KV pool),
  so it profiles a vLLM server and a kvherd agent alike, as their clients see them.
- Prefill points: one request at a time, fresh random tokens after a warmed prefix (or none), 1
  output token; its end-to-end time is one prefill step plus the request path. What hit is the
  engine's own ``usage.prompt_tokens_details.cached_tokens``.
- Decode points: B requests of C-token prompts at once, M tokens each, streamed; each request's
  decode step is (last token - first token) / (tokens - 1), a point is the batch's median.
- Each shape keeps its fastest of ``--repeats`` runs; one least-squares fit
  (`kvherd.profile_format.fit_steps`) over both, with a ``request`` column for the request path:
  the engine's coefficients make the profile, the request column its host section
  (``request_overhead_s``), for `kvherd sim --latency-model calibrated:P --profile P`.
- The server must be otherwise idle while profiled; other traffic inflates every point.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import statistics
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from kvherd import sse_lines
from kvherd.profile_format import (
    FEATURES,
    HOST_SECTION,
    PROFILE_FORMAT,
    doubling_grid,
    fastest_per_shape,
    fit_steps,
)

REQUEST_COLUMN = "request"  # 1 for a point timed end to end (the request path is in it)
_CACHE_INFO = re.compile(r"^vllm:cache_config_info\{(?P<labels>[^}]*)\}", re.M)
_LABEL = re.compile(r'(\w+)="([^"]*)"')


class RemoteProfileError(RuntimeError):
    """The server cannot be profiled (unreachable, refusing, not OpenAI-compatible)."""


@dataclass(frozen=True)
class Completion:
    seconds_to_end: float
    seconds_to_first: float
    completion_tokens: int
    cached_tokens: int | None  # None: the server does not report it


class RemoteServer:
    """One OpenAI-compatible server: its model, its cache facts, timed completions."""

    def __init__(self, url: str, model: str | None, api_key: str | None, timeout_s: float) -> None:
        self.url = url.rstrip("/")
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        # One keep-alive client, as a serving client holds: building an httpx client (its TLS
        # context) and connecting per request cost ~20 ms, which the fit took as request path.
        self._client = httpx.Client(headers=headers, timeout=timeout_s, trust_env=False)
        try:
            listed = self._client.get(f"{self.url}/v1/models")
            listed.raise_for_status()
            metrics = self._client.get(f"{self.url}/metrics")
        except httpx.HTTPError as exc:
            self._client.close()
            raise RemoteProfileError(f"{self.url}: {exc}") from None
        cards = [m for m in listed.json().get("data", []) if isinstance(m, dict) and "id" in m]
        if model is None and not cards:
            raise RemoteProfileError(f"{self.url}/v1/models lists no model; pass --served-model")
        self.model = model or str(cards[0]["id"])
        card = next((c for c in cards if c["id"] == self.model), {})
        length = card.get("max_model_len")  # vLLM's model card names it
        self.max_model_len = length if isinstance(length, int) else None
        self.cache_info: dict[str, str] = {}
        found = _CACHE_INFO.search(metrics.text) if metrics.status_code == 200 else None
        if found:
            self.cache_info = dict(_LABEL.findall(found.group("labels")))

    def close(self) -> None:
        self._client.close()

    def complete(self, prompt: list[int], max_tokens: int) -> Completion:
        body = {
            "model": self.model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        first: float | None = None
        usage: dict[str, Any] = {}
        start = time.perf_counter()
        with self._client.stream("POST", f"{self.url}/v1/completions", json=body) as response:
            if response.status_code != 200:
                raise RemoteProfileError(
                    f"{self.url}/v1/completions answered {response.status_code}: "
                    f"{response.read().decode(errors='replace')[:300]}"
                )
            for line in sse_lines.lines(response.iter_bytes()):
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("choices") and first is None:
                    first = time.perf_counter()
                usage = chunk.get("usage") or usage
        end = time.perf_counter()
        details = usage.get("prompt_tokens_details") or {}
        cached = details.get("cached_tokens") if isinstance(details, dict) else None
        return Completion(
            end - start,
            (first or end) - start,
            int(usage.get("completion_tokens", max_tokens)),
            cached if isinstance(cached, int) else None,
        )


class _Workloads:
    def __init__(self, server: RemoteServer, seed: int, vocab: tuple[int, int]) -> None:
        self.server = server
        self.points: list[dict[str, Any]] = []
        # The server's cache outlives this run: a run's prompts must not repeat an earlier one's.
        self._rng = random.Random(f"{seed}-{time.time_ns()}")
        self._low, self._high = vocab
        self.reports_cached = True

    def tokens(self, n: int) -> list[int]:
        return [self._rng.randrange(self._low, self._high) for _ in range(n)]

    def prefill(self, prefix: list[int], new: int) -> None:
        """One prefill of `new` fresh tokens after `prefix` (sent once before, to be cached)."""
        if prefix:
            self.server.complete(prefix, 1)
        prompt = prefix + self.tokens(new)
        done = self.server.complete(prompt, 1)
        if done.cached_tokens is None:
            self.reports_cached = False
        cached = min(done.cached_tokens or 0, len(prompt) - 1)
        self.points.append(
            {
                "prefill": [[len(prompt) - cached, cached]],
                "decode": [],
                "measured_s": done.seconds_to_end,
                REQUEST_COLUMN: 1.0,
                "warmed_tokens": len(prefix),
            }
        )

    def decode(self, batch: int, context: int, max_tokens: int) -> None:
        """`batch` streams at once; the point is the median of their decode step times."""
        results: list[Completion] = []
        errors: list[BaseException] = []
        prompts = [self.tokens(context) for _ in range(batch)]

        def one(prompt: list[int]) -> None:
            try:
                results.append(self.server.complete(prompt, max_tokens))
            except BaseException as exc:  # re-raised on the caller's thread
                errors.append(exc)

        threads = [threading.Thread(target=one, args=(p,)) for p in prompts]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        if errors:
            raise errors[0]
        steps = [
            (r.seconds_to_end - r.seconds_to_first) / (r.completion_tokens - 1)
            for r in results
            if r.completion_tokens > 1
        ]
        if steps:
            mid_context = context + max_tokens // 2
            self.points.append(
                {
                    "prefill": [],
                    "decode": [mid_context] * batch,
                    "measured_s": statistics.median(steps),
                }
            )


def profile_server(args: argparse.Namespace) -> dict[str, Any]:
    """Measure the server at `args.url` and return the profile (format `PROFILE_FORMAT`)."""
    server = RemoteServer(args.url, args.served_model, args.api_key, args.request_timeout)
    try:
        return _measure(server, args)
    finally:
        server.close()


def _measure(server: RemoteServer, args: argparse.Namespace) -> dict[str, Any]:
    block_size = int(server.cache_info.get("block_size") or args.block_size)
    num_blocks_text = server.cache_info.get("num_gpu_blocks") or args.num_blocks
    work = _Workloads(server, args.seed, (3, args.vocab_limit))
    work.server.complete(work.tokens(64), 4)  # warm-up: first calls allocate and compile
    lengths = doubling_grid(args.max_context, 32)
    for _ in range(args.repeats):
        for length in lengths:
            work.prefill([], length)
        for context in lengths[1:]:
            prefix = work.tokens(context - context % block_size)
            for new in (32, 128):
                if prefix and len(prefix) + new <= args.max_context:
                    work.prefill(prefix, new)
                    prefix = work.tokens(len(prefix))  # fresh, so the next one pays its prefix
        for batch in doubling_grid(args.max_batch, 1):
            for context in (32, *lengths[2::2]):
                work.decode(batch, context, args.decode_tokens)
    names = [*FEATURES, REQUEST_COLUMN]
    points = fastest_per_shape(work.points)
    # Every prefill point is one request of one sequence: its per-sequence cost and the request
    # path are one column from outside, which the request path (the host section) takes.
    coef, stats, predicted = fit_steps(
        points, extra=(REQUEST_COLUMN,), unfitted=("prefill_sequences",)
    )
    for point, pred in zip(points, predicted, strict=True):
        point["predicted_s"] = pred
    fitted = dict(zip(names, coef, strict=True))
    engine = {
        "block_size": block_size,
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "max_model_len": args.max_model_len or server.max_model_len or args.max_context * 2,
    }
    if num_blocks_text:
        engine["num_blocks"] = int(num_blocks_text)
    return {
        "format": PROFILE_FORMAT,
        "model": server.model,
        "url": server.url,
        "clock": "client wall time",
        "features": list(FEATURES),
        "coefficients_s": [fitted[name] for name in FEATURES],
        "fit": stats,
        "engine": engine,
        HOST_SECTION: {"request_overhead_s": max(0.0, fitted[REQUEST_COLUMN])},
        "reports_cached_tokens": work.reports_cached,
        "points": points,
    }


def run_remote(args: argparse.Namespace) -> int:
    if args.max_context < 64 or args.max_batch < 1 or args.repeats < 1 or args.decode_tokens < 4:
        print(
            "kvherd profile: error: --max-context >= 64, --max-batch >= 1, --repeats >= 1 and "
            "--decode-tokens >= 4 are required",
            file=sys.stderr,
        )
        return 2
    started = time.perf_counter()
    try:
        profile = profile_server(args)
    except RemoteProfileError as exc:
        print(f"kvherd profile: error: {exc}", file=sys.stderr)
        return 1
    out: Path = args.out
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(profile, indent=1) + "\n")
    fit = profile["fit"]
    print(
        f"{fit['num_points']} points measured on {profile['url']} ({profile['model']}) in "
        f"{time.perf_counter() - started:.1f} s; fit: mean |error| "
        f"{fit['mean_abs_pct_error']:.1f}%, R^2 {fit['r2']:.4f}; request path "
        f"{profile[HOST_SECTION]['request_overhead_s'] * 1e3:.2f} ms"
    )
    if not profile["reports_cached_tokens"]:
        print(
            "  the server reports no cached_tokens: prefix hits were taken as 0 (vLLM: "
            "--enable-prompt-tokens-details)"
        )
    print(
        f"wrote {out}; use it with: kvherd sim TRACE --latency-model calibrated:{out} "
        f"--profile {out}"
    )
    return 0
