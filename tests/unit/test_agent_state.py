"""State snapshot, Llumnix freeness and the Prometheus metric set (no server)."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from instance_agent.engine.core.batch_scheduler import BatchScheduler, SchedulerConfig
from instance_agent.engine.core.block_manager import BlockManager
from instance_agent.engine.core.request import Request, SamplingParams
from instance_agent.metrics import AgentMetrics
from instance_agent.state import StepLatencyWindow, freeness, snapshot


def test_freeness_formula() -> None:
    assert freeness(100, 0, 0) == 100  # idle: all free blocks
    assert freeness(100, 20, 4) == 20
    assert freeness(10, 30, 2) == -10  # the queue head does not fit


def test_snapshot_reports_requests_blocks_and_freeness() -> None:
    bm = BlockManager(num_blocks=10, block_size=4, watermark=0.0)
    scheduler = BatchScheduler(
        SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=64, max_model_len=64), bm
    )
    for i, n in enumerate((9, 5, 13)):  # third waits: max_num_seqs=2
        scheduler.add_request(Request(f"r{i}", list(range(n)), SamplingParams(max_tokens=2), 4))
    scheduler.schedule()
    window = StepLatencyWindow(size=3)
    for seconds in (0.1, 0.2, 0.3, 0.4):
        window.record(seconds)
    state = snapshot(
        scheduler,
        bm,
        instance_id="i0",
        model="tiny",
        draining=False,
        step_latency=window,
        last_kv_event_seq=7,
        include_block_hashes=True,
    )
    assert [r["request_id"] for r in state["running"]] == ["r0", "r1"]
    assert [r["request_id"] for r in state["waiting"]] == ["r2"]
    assert [r["blocks"] for r in state["running"]] == [3, 2]  # ceil(9/4), ceil(5/4)
    assert state["running"][0]["num_tokens"] == 9
    assert state["running"][0]["num_computed_tokens"] == 0  # scheduled, not yet computed
    assert state["free_blocks"] == 10 - 5
    # Head of line needs ceil(13/4) = 4 blocks; 3 requests in total.
    assert state["freeness"] == (5 - 4) / 3
    assert state["total_blocks"] == 10 and state["block_size"] == 4
    assert state["cached_blocks"] == len(state["cached_block_hashes"]) == bm.num_cached_blocks
    assert state["last_kv_event_seq"] == 7
    latency = state["step_latency"]
    assert latency["count"] == 3 and latency["total_steps"] == 4
    assert abs(latency["mean"] - 0.3) < 1e-9 and latency["p50"] == 0.3


def test_metrics_use_vllm_names() -> None:
    metrics = AgentMetrics("tiny", {"block_size": "16", "num_gpu_blocks": "64"})
    metrics.set_load(3, 2, 0.25)
    metrics.prefix_cache_queries.inc(10)
    metrics.prefix_cache_hits.inc(4)
    metrics.time_to_first_token.observe(0.05)
    metrics.request_finished("length")
    families = {f.name: f for f in text_string_to_metric_families(metrics.render().decode())}
    for name in (
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:prefix_cache_queries",
        "vllm:prefix_cache_hits",
        "vllm:time_to_first_token_seconds",
        "vllm:inter_token_latency_seconds",
        "vllm:e2e_request_latency_seconds",
        "vllm:cache_config_info",
        "vllm:request_success",
    ):
        assert name in families, name

    def value(family: str, sample: str) -> float:
        return next(s.value for s in families[family].samples if s.name == sample)

    assert value("vllm:num_requests_running", "vllm:num_requests_running") == 3
    assert value("vllm:prefix_cache_hits", "vllm:prefix_cache_hits_total") == 4
    assert value("vllm:time_to_first_token_seconds", "vllm:time_to_first_token_seconds_count") == 1
    info = families["vllm:cache_config_info"].samples[0]
    assert info.labels == {"block_size": "16", "num_gpu_blocks": "64"} and info.value == 1
    running = families["vllm:num_requests_running"].samples[0]
    assert running.labels == {"model_name": "tiny", "engine": "0"}
