"""Prometheus metrics of one agent, under vLLM's metric names.

Contract:
- Names, types and labels follow vLLM's V1 engine (``model_name`` and ``engine`` labels), so
  dashboards and routers that scrape vLLM (e.g. prefix- or load-aware routers) read a kvherd agent
  unchanged: gauges ``vllm:num_requests_running``, ``vllm:num_requests_waiting``,
  ``vllm:kv_cache_usage_perc``; counters ``vllm:prefix_cache_queries`` / ``vllm:prefix_cache_hits``
  (in tokens), ``vllm:num_preemptions``, ``vllm:prompt_tokens``, ``vllm:generation_tokens``,
  ``vllm:request_success`` (by ``finished_reason``); histograms ``vllm:time_to_first_token_seconds``,
  ``vllm:inter_token_latency_seconds``, ``vllm:e2e_request_latency_seconds``; and the info gauge
  ``vllm:cache_config_info``.
- KV tiers (kvherd's own names, by ``medium``: ``GPU``, ``CPU``, ``STORAGE``): gauges
  ``kvherd_kv_tier_blocks`` and ``kvherd_kv_tier_capacity_blocks``; counters
  ``kvherd_kv_tier_hit_tokens_total``, ``kvherd_kv_tier_evicted_blocks_total`` and, for the lower
  tiers, ``kvherd_kv_offload_bytes_total`` / ``kvherd_kv_offload_seconds_total`` (into the tier) and
  ``kvherd_kv_load_bytes_total`` / ``kvherd_kv_load_seconds_total`` (out of it), fed by `set_tiers`
  with the engine's cumulative `tier_usage`.
- Prefix pulls into this agent (`instance_agent.prefix_pull`): ``kvherd_prefix_pulls_total`` by
  ``outcome``, ``kvherd_prefix_pull_bytes_total``, ``kvherd_prefix_pull_seconds_total``, fed by
  `pulled`; blocks served to other agents: ``kvherd_prefix_pull_served_blocks_total``.
- KV loads refused for want of the fleet token: ``kvherd_kv_untrusted_total`` by ``kind``
  (`UNTRUSTED_KINDS`), fed by `untrusted`.
- Each `AgentMetrics` owns its own `CollectorRegistry` (several agents may live in one test process).
- Every method is thread-safe (prometheus-client's own locking); the engine thread calls them.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

# What failed the fleet token's check: a pull or handoff header without it (401), a block request
# to this agent's server without its MAC (refused), a pulled block whose MAC fails (dropped).
UNTRUSTED_KINDS = ("pull_header", "handoff_header", "block_request", "pulled_block")

# vLLM's buckets, so histograms from kvherd and vLLM aggregate in one dashboard.
_TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
_ITL_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
    40.0, 80.0,
)  # fmt: skip
_E2E_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
    480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip


class AgentMetrics:
    def __init__(self, model_name: str, cache_config: dict[str, str]) -> None:
        self.registry = CollectorRegistry()
        labels = ["model_name", "engine"]
        values = (model_name, "0")
        reg = self.registry

        self.num_requests_running = Gauge(
            "vllm:num_requests_running", "Number of requests in model execution batches.",
            labels, registry=reg,
        ).labels(*values)  # fmt: skip
        self.num_requests_waiting = Gauge(
            "vllm:num_requests_waiting", "Number of requests waiting to be processed.",
            labels, registry=reg,
        ).labels(*values)  # fmt: skip
        self.kv_cache_usage = Gauge(
            "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
            labels, registry=reg,
        ).labels(*values)  # fmt: skip
        self.prefix_cache_queries = Counter(
            "vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.",
            labels, registry=reg,
        ).labels(*values)  # fmt: skip
        self.prefix_cache_hits = Counter(
            "vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.",
            labels, registry=reg,
        ).labels(*values)  # fmt: skip
        self.num_preemptions = Counter(
            "vllm:num_preemptions", "Cumulative number of preemptions from the engine.",
            labels, registry=reg,
        ).labels(*values)  # fmt: skip
        self.prompt_tokens = Counter(
            "vllm:prompt_tokens", "Number of prefill tokens processed.", labels, registry=reg
        ).labels(*values)
        self.generation_tokens = Counter(
            "vllm:generation_tokens", "Number of generation tokens processed.", labels, registry=reg
        ).labels(*values)
        self._request_success = Counter(
            "vllm:request_success", "Count of successfully processed requests.",
            [*labels, "finished_reason"], registry=reg,
        )  # fmt: skip
        self._values = values
        self.time_to_first_token = Histogram(
            "vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
            labels, buckets=_TTFT_BUCKETS, registry=reg,
        ).labels(*values)  # fmt: skip
        self.inter_token_latency = Histogram(
            "vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
            labels, buckets=_ITL_BUCKETS, registry=reg,
        ).labels(*values)  # fmt: skip
        self.e2e_request_latency = Histogram(
            "vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
            labels, buckets=_E2E_BUCKETS, registry=reg,
        ).labels(*values)  # fmt: skip
        info = Gauge(
            "vllm:cache_config_info", "Information of the LLMEngine CacheConfig",
            sorted(cache_config), registry=reg,
        )  # fmt: skip
        (info.labels(**cache_config) if cache_config else info).set(1)
        tier_labels = [*labels, "medium"]
        self._tier_gauges = {
            key: Gauge(name, doc, tier_labels, registry=reg)
            for key, name, doc in (
                ("num_blocks", "kvherd_kv_tier_blocks", "KV blocks held per tier."),
                ("capacity_blocks", "kvherd_kv_tier_capacity_blocks", "KV blocks per tier."),
            )
        }
        self._tier_counters = {
            key: Counter(name, doc, tier_labels, registry=reg)
            for key, name, doc in (
                ("hit_tokens", "kvherd_kv_tier_hit_tokens", "Prompt tokens served per tier."),
                ("evicted_blocks", "kvherd_kv_tier_evicted_blocks", "Blocks evicted per tier."),
                ("offload_bytes", "kvherd_kv_offload_bytes", "KV bytes moved into a tier."),
                ("offload_seconds", "kvherd_kv_offload_seconds", "Seconds moving KV into a tier."),
                ("load_bytes", "kvherd_kv_load_bytes", "KV bytes loaded from a tier."),
                ("load_seconds", "kvherd_kv_load_seconds", "Seconds loading KV from a tier."),
            )
        }
        self._tier_seen: dict[tuple[str, str], float] = {}
        self._pulls = Counter(
            "kvherd_prefix_pulls", "Prefix pulls into this instance, by outcome.",
            [*labels, "outcome"], registry=reg,
        )  # fmt: skip
        self._pull_bytes = Counter(
            "kvherd_prefix_pull_bytes", "KV bytes pulled from other instances.", labels,
            registry=reg,
        ).labels(*values)  # fmt: skip
        self._pull_seconds = Counter(
            "kvherd_prefix_pull_seconds", "Seconds spent pulling prefixes.", labels, registry=reg
        ).labels(*values)
        self.pull_served_blocks = Counter(
            "kvherd_prefix_pull_served_blocks", "KV blocks sent to other instances' pulls.",
            labels, registry=reg,
        ).labels(*values)  # fmt: skip
        untrusted = Counter(
            "kvherd_kv_untrusted", "KV loads refused or dropped without the fleet token, by kind.",
            [*labels, "kind"], registry=reg,
        )  # fmt: skip
        self._untrusted = {kind: untrusted.labels(*values, kind) for kind in UNTRUSTED_KINDS}

    def set_load(self, running: int, waiting: int, kv_usage: float) -> None:
        self.num_requests_running.set(running)
        self.num_requests_waiting.set(waiting)
        self.kv_cache_usage.set(kv_usage)

    def set_tiers(self, usage: list[dict[str, float | int | str]]) -> None:
        """Take the engine's cumulative per-tier figures (counters get the increments)."""
        for tier in usage:
            medium = str(tier["medium"])
            for key, gauge in self._tier_gauges.items():
                gauge.labels(*self._values, medium).set(float(tier[key]))
            for key, counter in self._tier_counters.items():
                if key in tier:
                    value = float(tier[key])
                    seen = self._tier_seen.get((medium, key), 0.0)
                    if value > seen:
                        counter.labels(*self._values, medium).inc(value - seen)
                    self._tier_seen[medium, key] = value

    def pulled(self, outcome: str, num_bytes: int, seconds: float) -> None:
        self._pulls.labels(*self._values, outcome).inc()
        self._pull_bytes.inc(num_bytes)
        self._pull_seconds.inc(seconds)

    def untrusted(self, kind: str) -> None:
        self._untrusted[kind].inc()

    def request_finished(self, finish_reason: str) -> None:
        self._request_success.labels(*self._values, finish_reason).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
