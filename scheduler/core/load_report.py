"""Instance load from an agent's state snapshot (JSON) or from Prometheus metrics text.

Contract:
- Both parsers return a `LoadReport`; a field the source does not provide is None (unknown), never
  a guessed number, so the scheduler can fall back to its own accounting for it.
- `parse_agent_state(obj)` reads kvherd's ``GET /kvherd/v1/state`` snapshot: counts
  (``num_running``, ``num_waiting``), blocks (``num_total_blocks``, ``num_free_blocks``,
  ``num_cached_blocks``), ``kv_usage``, ``num_preemptions``, ``block_size``,
  ``last_kv_event_seq`` (-1: none yet), ``role`` (``prefill``, ``decode`` or ``mixed``),
  ``max_num_seqs`` (batch slots) and the
  request lists ``running`` / ``waiting`` (objects
  with ``request_id``, ``num_tokens``, optional ``blocks`` held, ``num_computed_tokens`` and
  ``max_tokens`` with ``num_output_tokens``, the decode budget left), as
  `instance_agent.state.snapshot` writes them; the agent's heartbeat summary (counts only) reads
  the same way. Aliases (``total_blocks``/``num_total_blocks``, ``free_blocks``/
  ``num_free_blocks``, ``cached_blocks``/``num_cached_blocks``, ``num_blocks``/``blocks``) are
  accepted; lists override counts.
- The queue figures ``waiting_prefill_tokens`` and ``head_waiting_blocks`` are read as the agent
  computed them (`instance_agent.engine.core.load`, the simulator's one definition too); only a
  snapshot without them gets them derived from its request lists.
- `parse_prometheus(text, block_size)` reads vLLM (v1 and older) and SGLang metric names:
  ``vllm:num_requests_running``, ``vllm:num_requests_waiting`` (of which
  ``vllm:num_requests_waiting_by_reason{reason="deferred"}``, those waiting for a KV pull or a
  LoRA slot rather than for room, become ``num_deferred``), ``vllm:kv_cache_usage_perc``
  (old: ``vllm:gpu_cache_usage_perc``), ``vllm:num_preemptions_total``,
  ``vllm:cache_config_info{num_gpu_blocks=...,block_size=...}`` (the engine's block size becomes
  the report's ``block_size``); ``sglang:num_running_reqs``,
  ``sglang:num_queue_reqs``, ``sglang:token_usage``, ``sglang:max_total_num_tokens``. Samples of
  one metric with several label sets (models, engines) are summed (usage: averaged). vLLM's LoRA
  gauge ``vllm:lora_requests_info{max_lora, running_lora_adapters, waiting_lora_adapters}`` keeps
  one sample per label set ever seen, valued with the time it was set: the newest is the current
  one (adapters comma-separated; none until the first LoRA request, without ``--enable-lora``).
- Malformed input raises `LoadReportError` (a ValueError) with a message naming the field.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from policies.views import RunningRequestView
from scheduler.core.prom_text import samples


class LoadReportError(ValueError):
    """A state snapshot or metrics page that cannot be read."""


@dataclass(frozen=True, slots=True)
class LoadReport:
    num_running: int | None = None
    num_waiting: int | None = None
    kv_usage: float | None = None  # 0..1
    num_total_blocks: int | None = None
    num_free_blocks: int | None = None
    num_cached_blocks: int | None = None
    num_preemptions: int | None = None
    # Prompt tokens not yet computed: queued requests plus the rest of running chunked prefills.
    waiting_prefill_tokens: int | None = None
    head_waiting_blocks: int | None = None  # blocks the head-of-line waiting request needs
    running: tuple[RunningRequestView, ...] | None = None
    block_size: int | None = None
    last_kv_event_seq: int | None = None
    role: str | None = None  # "prefill", "decode" or "mixed" (P/D disaggregation)
    max_num_seqs: int | None = None  # the engine's batch slots
    active_adapters: tuple[str, ...] | None = None  # LoRA adapters running or waiting
    lora_slots: int | None = None  # LoRA adapters the engine holds at once (vLLM's max_loras)
    tiers: tuple[TierUse, ...] | None = None  # KV blocks held and capacity per tier, GPU first
    # Of `num_waiting`, those deferred (a KV pull in flight, a LoRA slot): waiting, not queued.
    num_deferred: int | None = None


@dataclass(frozen=True, slots=True)
class TierUse:
    medium: str  # vLLM's name: "GPU", "CPU", "STORAGE"
    num_blocks: int
    capacity_blocks: int


ROLES = ("prefill", "decode", "mixed")


def _int(obj: Mapping[str, Any], *names: str) -> int | None:
    for name in names:
        if name in obj and obj[name] is not None:
            value = obj[name]
            if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
                raise LoadReportError(f"{name!r} must be a non-negative number, got {value!r:.40}")
            if not math.isfinite(value):
                raise LoadReportError(f"{name!r} must be finite")
            return int(value)
    return None


def _requests(obj: Mapping[str, Any], name: str) -> list[Mapping[str, Any]] | None:
    value = obj.get(name)
    if value is None:
        return None
    if not isinstance(value, list) or not all(isinstance(item, Mapping) for item in value):
        raise LoadReportError(f"{name!r} must be a list of objects")
    return value


def _blocks(tokens: int, block_size: int | None) -> int:
    size = block_size or 16
    return -(-tokens // size)


def _last_seq(value: Any) -> int | None:
    if value is None or value == -1:  # the agent's "no batch published yet"
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise LoadReportError(f"'last_kv_event_seq' must be an integer >= -1, got {value!r:.40}")
    return value


def _tiers(listed: Any) -> tuple[TierUse, ...] | None:
    if listed is None:
        return None
    if not isinstance(listed, list) or not all(isinstance(t, Mapping) for t in listed):
        raise LoadReportError("'tiers' must be a list of objects")
    tiers = []
    for tier in listed:
        medium, held, capacity = (
            tier.get("medium"),
            _int(tier, "num_blocks"),
            _int(tier, "capacity_blocks"),
        )
        if not isinstance(medium, str) or held is None or capacity is None:
            raise LoadReportError("each tier needs 'medium', 'num_blocks' and 'capacity_blocks'")
        tiers.append(TierUse(medium, held, capacity))
    return tuple(tiers)


def parse_agent_state(obj: Any) -> LoadReport:
    """A `LoadReport` from a kvherd agent's state snapshot."""
    if not isinstance(obj, Mapping):
        raise LoadReportError("state snapshot must be a JSON object")
    block_size = _int(obj, "block_size")
    running_list = _requests(obj, "running")
    waiting_list = _requests(obj, "waiting")
    running: tuple[RunningRequestView, ...] | None = None
    running_prefill = 0
    if running_list is not None:
        views = []
        for index, item in enumerate(running_list):
            request_id = item.get("request_id")
            tokens = _int(item, "num_tokens")
            if not isinstance(request_id, str) or tokens is None:
                raise LoadReportError(f"running[{index}] needs 'request_id' and 'num_tokens'")
            blocks = _int(item, "num_blocks", "blocks")
            budget, output = _int(item, "max_tokens"), _int(item, "num_output_tokens")
            remaining = None if budget is None or output is None else max(0, budget - output)
            views.append(
                RunningRequestView(
                    request_id, tokens, blocks or _blocks(tokens, block_size), remaining
                )
            )
            # A long prompt in chunked prefill runs for several steps: its rest is queued work.
            computed = _int(item, "num_computed_tokens")
            if computed is not None and computed < tokens - 1:
                running_prefill += tokens - computed
        running = tuple(views)
    waiting_tokens = head_blocks = None
    if waiting_list is not None:
        waiting_tokens, head_blocks = running_prefill, 0
        for index, item in enumerate(waiting_list):
            tokens = _int(item, "num_tokens")
            if tokens is None:
                raise LoadReportError(f"waiting[{index}] needs 'num_tokens'")
            computed = _int(item, "num_computed_tokens") or 0
            waiting_tokens += max(0, tokens - computed)
            if index == 0:  # what the head still needs beyond the blocks it holds
                held = _int(item, "num_blocks", "blocks") or 0
                head_blocks = max(0, _blocks(tokens, block_size) - held)
    # The engine's own figures (the one definition) win over the lists' approximation.
    reported_tokens = _int(obj, "waiting_prefill_tokens")
    if reported_tokens is not None:
        waiting_tokens = reported_tokens
    reported_head = _int(obj, "head_waiting_blocks")
    if reported_head is not None:
        head_blocks = reported_head
    usage = obj.get("kv_usage", obj.get("usage"))
    if usage is not None and (not isinstance(usage, int | float) or not 0 <= usage <= 1):
        raise LoadReportError(f"'kv_usage' must be in [0, 1], got {usage!r:.40}")
    total = _int(obj, "num_total_blocks", "total_blocks", "num_blocks")
    free = _int(obj, "num_free_blocks", "free_blocks")
    if usage is None and total and free is not None:
        usage = 1.0 - free / total
    role = obj.get("role")
    if role is not None and role not in ROLES:
        raise LoadReportError(f"'role' must be one of {', '.join(ROLES)}, got {role!r:.40}")
    adapters = obj.get("active_adapters")
    if adapters is not None and (
        not isinstance(adapters, list) or not all(isinstance(a, str) for a in adapters)
    ):
        raise LoadReportError("'active_adapters' must be a list of adapter names")
    return LoadReport(
        tiers=_tiers(obj.get("tiers")),
        active_adapters=None if adapters is None else tuple(adapters),
        lora_slots=_int(obj, "lora_slots"),
        num_running=len(running) if running is not None else _int(obj, "num_running"),
        num_waiting=len(waiting_list) if waiting_list is not None else _int(obj, "num_waiting"),
        kv_usage=None if usage is None else float(usage),
        num_total_blocks=total,
        num_free_blocks=free,
        num_cached_blocks=_int(obj, "num_cached_blocks", "cached_blocks"),
        num_preemptions=_int(obj, "num_preemptions"),
        waiting_prefill_tokens=waiting_tokens,
        head_waiting_blocks=head_blocks,
        running=running,
        block_size=block_size,
        last_kv_event_seq=_last_seq(obj.get("last_kv_event_seq")),
        role=role,
        max_num_seqs=_int(obj, "max_num_seqs"),
    )


# sample name -> LoadReport field; the first name found for a field wins (new before old).
_PROM_FIELDS: tuple[tuple[str, str], ...] = (
    ("vllm:num_requests_running", "num_running"),
    ("sglang:num_running_reqs", "num_running"),
    ("vllm:num_requests_waiting", "num_waiting"),
    ("sglang:num_queue_reqs", "num_waiting"),
    ("vllm:kv_cache_usage_perc", "kv_usage"),
    ("vllm:gpu_cache_usage_perc", "kv_usage"),
    ("sglang:token_usage", "kv_usage"),
    ("vllm:num_preemptions_total", "num_preemptions"),
    ("vllm:num_preemptions", "num_preemptions"),
)
# Every sample `parse_prometheus` reads; the page's other lines are skipped unread.
_PROM_NAMES = frozenset(
    [name for name, _ in _PROM_FIELDS]
    + [
        "vllm:lora_requests_info",
        "vllm:cache_config_info",
        "vllm:num_requests_waiting_by_reason",
        "sglang:max_total_num_tokens",
    ]
)


def parse_prometheus(text: str, block_size: int = 16) -> LoadReport:
    """A `LoadReport` from a vLLM or SGLang `/metrics` page."""
    sums: dict[str, float] = {}
    counts: dict[str, int] = {}
    total_blocks: int | None = None
    fields: dict[str, Any] = {}
    lora_at = -math.inf
    deferred = 0.0
    try:
        for name, labels, value in samples(text, _PROM_NAMES):
            if name == "vllm:lora_requests_info":
                if value > lora_at:
                    lora_at = value
                    _lora_fields(labels, fields)
            elif name == "vllm:cache_config_info":
                gpu_blocks = labels.get("num_gpu_blocks", "")
                if gpu_blocks.isdigit():
                    total_blocks = int(gpu_blocks)
                engine_block_size = labels.get("block_size", "")
                if engine_block_size.isdigit() and int(engine_block_size) > 0:
                    fields["block_size"] = int(engine_block_size)
            elif name == "vllm:num_requests_waiting_by_reason":
                if labels.get("reason") == "deferred" and math.isfinite(value):
                    deferred += value
                    fields["num_deferred"] = max(0, int(deferred))
            elif name == "sglang:max_total_num_tokens":
                total_blocks = int(value) // block_size
            elif math.isfinite(value):
                sums[name] = sums.get(name, 0.0) + value
                counts[name] = counts.get(name, 0) + 1
    except ValueError as exc:
        raise LoadReportError(f"not Prometheus text format: {exc}") from exc
    for sample_name, field_name in _PROM_FIELDS:
        if field_name in fields or sample_name not in sums:
            continue
        value = sums[sample_name]
        if field_name == "kv_usage":
            fields[field_name] = min(1.0, max(0.0, value / counts[sample_name]))
        else:
            fields[field_name] = max(0, int(value))
    if total_blocks is not None:
        fields["num_total_blocks"] = total_blocks
        if "kv_usage" in fields:
            fields["num_free_blocks"] = int(total_blocks * (1.0 - fields["kv_usage"]))
    return LoadReport(**fields)


def _lora_fields(labels: Mapping[str, str], fields: dict[str, Any]) -> None:
    """The LoRA fields of one ``vllm:lora_requests_info`` sample."""
    names: dict[str, None] = {}
    for key in ("running_lora_adapters", "waiting_lora_adapters"):
        names.update(dict.fromkeys(n for n in labels.get(key, "").split(",") if n))
    fields["active_adapters"] = tuple(names)
    slots = labels.get("max_lora", "")
    if slots.isdigit():
        fields["lora_slots"] = int(slots)
