"""ServerMetrics without a server: what each output records, engine gauges, the stats log."""

from __future__ import annotations

import asyncio
import logging

import pytest

from tokenmill.engine.async_engine import EngineStats
from tokenmill.outputs import CompletionOutput, RequestMetrics, RequestOutput, SpecDecodeStats
from tokenmill.server.metrics import ServerMetrics, log_stats_periodically

LABELS = {"model_name": "m", "engine": "0"}


def _output(new_tokens: list[int], finish: str | None, metrics: RequestMetrics) -> RequestOutput:
    return RequestOutput(
        request_id="r",
        prompt=None,
        prompt_token_ids=[1, 2, 3, 4],
        outputs=[
            CompletionOutput(
                index=0, text="", token_ids=[], finish_reason=finish, token_ids_delta=new_tokens
            )
        ],
        finished=finish is not None,
        metrics=metrics,
    )


def _value(m: ServerMetrics, name: str, **labels: str) -> float | None:
    return m.registry.get_sample_value(name, {**LABELS, **labels})


def test_tracker_records_one_request() -> None:
    m = ServerMetrics("m", lambda: None)
    other = ServerMetrics("m", lambda: None)  # its own registry: nothing shared
    metrics = RequestMetrics(
        arrival_time=10.0,
        first_scheduled_time=10.25,
        first_token_time=10.5,
        finished_time=12.5,
        num_generation_tokens=3,
    )
    tracker = m.track()
    tracker.observe(_output([7], None, metrics))
    tracker.observe(_output([8, 9], None, metrics))
    tracker.observe(_output([], "length", metrics))
    tracker.finish("abort")  # after the finish: ignored

    assert _value(m, "tokenmill:prompt_tokens_total") == 4
    assert _value(m, "tokenmill:generation_tokens_total") == 3
    assert _value(m, "tokenmill:time_to_first_token_seconds_sum") == pytest.approx(0.5)
    assert _value(m, "tokenmill:inter_token_latency_seconds_count") == 1
    assert _value(m, "tokenmill:request_queue_time_seconds_sum") == pytest.approx(0.25)
    assert _value(m, "tokenmill:e2e_request_latency_seconds_sum") == pytest.approx(2.5)
    # (finish - first token) / (tokens - 1)
    assert _value(m, "tokenmill:request_time_per_output_token_seconds_sum") == pytest.approx(1.0)
    assert _value(m, "tokenmill:request_success_total", finished_reason="length") == 1
    assert _value(m, "tokenmill:request_success_total", finished_reason="abort") == 0
    assert _value(other, "tokenmill:prompt_tokens_total") == 0


def test_a_response_sent_whole_counts_the_engines_inter_token_latencies() -> None:
    """A non-streaming request's output comes once, at the end (final_only): its inter-token
    latencies are the engine's, from the output's metrics."""
    m = ServerMetrics("m", lambda: None)
    metrics = RequestMetrics(
        arrival_time=10.0, first_token_time=10.5, finished_time=11.0, num_generation_tokens=3,
        inter_token_latencies=(0.2, 0.3),
    )  # fmt: skip
    m.track().observe(_output([7, 8, 9], "length", metrics))
    assert _value(m, "tokenmill:generation_tokens_total") == 3
    assert _value(m, "tokenmill:inter_token_latency_seconds_count") == 2
    assert _value(m, "tokenmill:inter_token_latency_seconds_sum") == pytest.approx(0.5)


def test_aborted_request_counts_once_without_latencies() -> None:
    m = ServerMetrics("m", lambda: None)
    tracker = m.track()
    tracker.observe(_output([5], None, RequestMetrics(arrival_time=0.0, first_token_time=0.1)))
    tracker.finish("abort")
    tracker.finish("abort")
    assert _value(m, "tokenmill:request_success_total", finished_reason="abort") == 1
    assert _value(m, "tokenmill:e2e_request_latency_seconds_count") == 0


def test_engine_gauges_and_counters_come_from_stats() -> None:
    stats = EngineStats(
        num_running=3,
        num_waiting=2,
        kv_cache_usage=0.25,
        num_preemptions=4,
        prefix_cache_queries=100,
        prefix_cache_hits=64,
    )
    m = ServerMetrics("m", lambda: stats)
    assert _value(m, "tokenmill:num_requests_running") == 3
    assert _value(m, "tokenmill:num_requests_waiting") == 2
    assert _value(m, "tokenmill:kv_cache_usage_perc") == 0.25
    assert _value(m, "tokenmill:num_preemptions_total") == 4
    assert _value(m, "tokenmill:prefix_cache_queries_total") == 100
    assert _value(m, "tokenmill:prefix_cache_hits_total") == 64
    loading = ServerMetrics("m", lambda: None)
    assert _value(loading, "tokenmill:num_requests_running") == 0


def test_spec_decode_counters_come_from_stats() -> None:
    spec = SpecDecodeStats()
    spec.record(3, 2)  # 3 drafts, the first 2 kept
    spec.record(3, 0)
    m = ServerMetrics("m", lambda: EngineStats(spec_decode=spec))
    assert _value(m, "tokenmill:spec_decode_num_drafts_total") == 2
    assert _value(m, "tokenmill:spec_decode_num_draft_tokens_total") == 6
    assert _value(m, "tokenmill:spec_decode_num_accepted_tokens_total") == 2
    per_pos = "tokenmill:spec_decode_num_accepted_tokens_per_pos_total"
    assert [_value(m, per_pos, position=str(i)) for i in range(3)] == [1, 1, 0]
    assert spec.mean_accepted_len == 2.0


def test_periodic_stats_log_line(caplog: pytest.LogCaptureFixture) -> None:
    stats = EngineStats(num_running=1, kv_cache_usage=0.5)
    m = ServerMetrics("m", lambda: stats)

    async def run() -> None:
        task = asyncio.create_task(log_stats_periodically(m, lambda: stats, 0.05))
        m.num_generation_tokens += 10
        await asyncio.sleep(0.12)
        task.cancel()

    with caplog.at_level(logging.INFO, logger="tokenmill.server.metrics"):
        asyncio.run(run())
    lines = [r.getMessage() for r in caplog.records]
    assert lines, "no stats line"
    assert "generation" in lines[0] and "running 1" in lines[0] and "KV cache 50.0%" in lines[0]
