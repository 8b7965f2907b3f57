"""Replay a trace against a real OpenAI-compatible endpoint and measure it like `vllm bench serve`.

Contract:
- Each trace request is sent at its (scaled) arrival time as a streamed ``POST /v1/completions``
  whose prompt is the token-id list `simulator.prompts.synthesize_prompt` makes from its block ids
  (the very synthesis the simulator uses, so shared ids share real prefixes on the server too), with
  ``max_tokens`` = its output length, ``ignore_eos`` true, greedy sampling and usage reporting.
- Timing follows `vllm bench serve`: TTFT is the arrival of the first chunk carrying choices; every
  later such chunk adds one inter-token latency (the gap since the previous one); E2E ends at the
  last chunk; the output length is the server's ``usage.completion_tokens`` (else the chunk count),
  and TPOT = (E2E - TTFT) / (output - 1). Prefix hits come from
  ``usage.prompt_tokens_details.cached_tokens``. Queueing time is not observable and stays NaN.
  A request's instance is the ``X-Kvherd-Instance`` response header when the endpoint names the
  one that served it (`kvherd serve --expose-instance`), else the endpoint URL.
- The client may send late (a busy machine): how late each request went out against its trace
  arrival is kept (`ReplayResult.send_lag_s`), since a simulation of the trace assumes none.
- A request that fails (connection error, non-200 status, malformed stream) is counted as failed
  with its reason; the replay goes on.
- Results go into the same `MetricsCollector` and report files as `kvherd sim`.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

from kvherd import sse_lines
from simulator.metrics import MetricsCollector
from simulator.prompts import synthesize_prompt
from simulator.traces import Trace, TraceRequest


@dataclass(slots=True)
class ReplayConfig:
    url: str
    model: str | None = None
    vocab_size: int = 256
    timeout_s: float = 600.0
    api_key: str | None = None
    max_concurrency: int | None = None


@dataclass(slots=True)
class ReplayResult:
    metrics: MetricsCollector
    model: str
    errors: Counter[str] = field(default_factory=Counter)
    wall_s: float = 0.0
    send_lag_s: list[float] = field(default_factory=list)


class ReplayError(RuntimeError):
    """The endpoint cannot be used at all (unreachable, no models)."""


def _headers(config: ReplayConfig) -> dict[str, str]:
    return {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}


async def _model_name(client: httpx.AsyncClient, config: ReplayConfig) -> str:
    if config.model:
        return config.model
    try:
        response = await client.get(f"{config.url}/v1/models", headers=_headers(config))
        response.raise_for_status()
        models = response.json()["data"]
        return str(models[0]["id"])
    except (httpx.HTTPError, KeyError, IndexError, TypeError, ValueError) as exc:
        raise ReplayError(
            f"cannot list models at {config.url}/v1/models ({exc}); pass --model"
        ) from None


async def _one(
    client: httpx.AsyncClient,
    config: ReplayConfig,
    model: str,
    trace: Trace,
    tr: TraceRequest,
    t0: float,
    result: ReplayResult,
) -> None:
    metrics = result.metrics
    rid = tr.request_id
    prompt = synthesize_prompt(
        tr.hash_ids, tr.input_length, trace.block_size, config.vocab_size
    ).tolist()
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": tr.output_length,
        "ignore_eos": True,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    sent = time.perf_counter() - t0
    metrics.on_arrival(rid, sent, tr.input_length)
    result.send_lag_s.append(max(sent - tr.arrival_s, 0.0))
    usage: dict[str, Any] = {}
    chunks = 0
    instance = config.url
    try:
        async with client.stream(
            "POST",
            f"{config.url}/v1/completions",
            json=body,
            headers={**_headers(config), "X-Request-Id": rid},
        ) as response:
            if response.status_code != 200:
                await response.aread()
                result.errors[f"HTTP {response.status_code}"] += 1
                metrics.on_failed(rid)
                return
            instance = response.headers.get("x-kvherd-instance", instance)
            async for line in sse_lines.alines(response.aiter_bytes()):
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                frame = json.loads(data)
                if frame.get("choices"):
                    metrics.on_token(rid, time.perf_counter() - t0)
                    chunks += 1
                if frame.get("usage"):
                    usage = frame["usage"]
    except (httpx.HTTPError, json.JSONDecodeError, AttributeError) as exc:
        result.errors[type(exc).__name__] += 1
        metrics.on_failed(rid)
        return
    if chunks == 0:
        result.errors["empty stream"] += 1
        metrics.on_failed(rid)
        return
    details = usage.get("prompt_tokens_details") or {}
    metrics.on_finished_ids(
        rid,
        tr.index,
        int(details.get("cached_tokens") or 0),
        0,
        0,
        instance,
        num_output_tokens=int(usage.get("completion_tokens") or chunks),
    )


async def replay(
    trace: Trace, config: ReplayConfig, on_progress: Callable[[int], None] | None = None
) -> ReplayResult:
    limits = httpx.Limits(max_connections=config.max_concurrency, max_keepalive_connections=64)
    timeout = httpx.Timeout(config.timeout_s, connect=30.0)
    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
        model = await _model_name(client, config)
        result = ReplayResult(MetricsCollector(), model)

        async def at_arrival(tr: TraceRequest, t0: float) -> None:
            delay = tr.arrival_s - (time.perf_counter() - t0)
            if delay > 0:
                await asyncio.sleep(delay)
            await _one(client, config, model, trace, tr, t0, result)
            if on_progress is not None:
                on_progress(1)

        t0 = time.perf_counter()
        await asyncio.gather(*(at_arrival(tr, t0) for tr in trace.requests))
        result.wall_s = time.perf_counter() - t0
    return result
