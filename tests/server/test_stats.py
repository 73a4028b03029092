"""The dashboard's sliding window (server/stats.py) on a fake clock: what falls out of it,
rates, percentiles, window differences of the engine's counters, and the cost figures; and
GET /v1/stats from a speculating server against its /metrics."""

from __future__ import annotations

import httpx
import pytest
from live_server import MODEL_NAME, running_server, scrape

from tokenmill.cost import TokenPrices, cost_per_million_tokens
from tokenmill.outputs import EngineStats, SpecDecodeStats
from tokenmill.server.stats import MAX_SAMPLES, LiveWindow


class Clock:
    def __init__(self) -> None:
        self.now = 5000.0

    def __call__(self) -> float:
        return self.now


def _snapshot(window: LiveWindow, stats: EngineStats | None = None, **kwargs):
    kwargs = dict(prices=TokenPrices(), price_per_hour=None, model="m", status="ready") | kwargs
    return window.snapshot(stats or EngineStats(), **kwargs)


def test_rates_and_percentiles_over_the_window() -> None:
    clock = Clock()
    window = LiveWindow(window_s=10.0, clock=clock)
    clock.now += 20  # up longer than the window: rates are per window_s
    for i in range(100):
        window.add_ttft(0.001 * (i + 1))  # 1 .. 100 ms
    window.add_prompt(300, num_cached=100)
    window.add_generation(50)
    clock.now += 5
    window.add_itl(0.02)
    window.add_generation(50)
    s = _snapshot(window)
    assert (s.ttft_s.count, s.ttft_s.p50, s.ttft_s.p90, s.ttft_s.p99, s.ttft_s.max) == (
        100, 0.05, 0.09, 0.099, 0.1,
    )  # fmt: skip
    assert s.itl_s.count == 1 and s.itl_s.p99 == 0.02
    assert s.prompt_tokens_per_s == 30.0 and s.generation_tokens_per_s == 10.0
    assert (s.window_prompt_tokens, s.window_cached_prompt_tokens) == (300, 100)
    clock.now += 6  # the first second's bucket is out of the window now
    s = _snapshot(window)
    assert s.ttft_s.count == 0 and s.ttft_s.p50 is None
    assert s.window_generation_tokens == 50 and s.itl_s.count == 1
    clock.now += 10
    assert _snapshot(window).window_generation_tokens == 0


def test_a_young_window_rates_over_its_age() -> None:
    clock = Clock()
    window = LiveWindow(window_s=60.0, clock=clock)
    clock.now += 4
    window.add_generation(100)
    assert _snapshot(window).generation_tokens_per_s == 25.0


def test_samples_are_capped_per_second() -> None:
    clock = Clock()
    window = LiveWindow(window_s=10.0, clock=clock)
    for _ in range(3 * MAX_SAMPLES):
        window.add_itl(0.01)
    s = _snapshot(window)
    assert s.itl_s.count == 3 * MAX_SAMPLES and s.itl_s.p50 == 0.01


def test_engine_counters_are_differenced_over_the_window() -> None:
    clock = Clock()
    window = LiveWindow(window_s=10.0, clock=clock)

    def stats(preemptions: int, queries: int, hits: int, drafts: int, accepted: int):
        spec = SpecDecodeStats(num_draft_tokens=drafts, num_accepted_tokens=accepted)
        return EngineStats(
            num_running=3, num_waiting=1, kv_cache_usage=0.25, num_preemptions=preemptions,
            prefix_cache_queries=queries, prefix_cache_hits=hits, spec_decode=spec,
        )  # fmt: skip

    for t, args in enumerate([(1, 100, 10, 0, 0), (2, 200, 60, 10, 4), (5, 300, 60, 30, 19)]):
        clock.now = 5000.0 + 8 * t
        window.sample_engine(stats(*args))
    s = _snapshot(window, stats(5, 300, 60, 30, 19))
    # The sample at 5000 is the newest at or before the window's start (5006).
    assert s.window_preemptions == 4 and s.num_preemptions == 5
    assert s.prefix_cache_hit_rate == pytest.approx(50 / 200)
    assert s.spec_acceptance_rate == pytest.approx(19 / 30)
    assert (s.num_requests_running, s.num_requests_waiting, s.kv_cache_usage) == (3, 1, 0.25)
    # A later sample moves the base on to 5008.
    clock.now = 5019.0
    window.sample_engine(stats(5, 400, 160, 30, 19))
    s = _snapshot(window, stats(5, 400, 160, 30, 19))
    assert s.window_preemptions == 3
    assert s.prefix_cache_hit_rate == pytest.approx(100 / 200)
    assert s.spec_acceptance_rate == pytest.approx(15 / 20)
    empty = _snapshot(LiveWindow(clock=clock))
    assert empty.spec_acceptance_rate is None and empty.prefix_cache_hit_rate is None


def test_cost_per_million_tokens() -> None:
    clock = Clock()
    window = LiveWindow(window_s=10.0, clock=clock)
    clock.now += 10
    window.add_prompt(1000, num_cached=400)
    window.add_generation(500)
    prices = TokenPrices(
        input_per_million=1.0, output_per_million=4.0, cached_input_per_million=0.5
    )
    s = _snapshot(window, prices=prices, price_per_hour=3.6)
    assert s.usd_per_million_output_tokens == cost_per_million_tokens(3.6, 50.0)
    assert s.usd_per_million_total_tokens == cost_per_million_tokens(3.6, 150.0)
    assert s.usd_per_million_tokens_billed == pytest.approx(
        prices.cost(1000, 500, 400) / 1500 * 1e6
    )
    # No prices configured: nothing is billed.
    assert _snapshot(window).usd_per_million_tokens_billed is None
    idle = _snapshot(LiveWindow(clock=clock), price_per_hour=3.6)
    assert idle.usd_per_million_output_tokens is None  # nothing made: unbounded, not zero
    assert idle.usd_per_million_tokens_billed is None


def test_live_stats_of_a_speculating_server(tiny_model_dir) -> None:
    # A prompt that repeats (n-gram drafts are kept) and is sent twice (prefix-cache hits).
    body = {"model": MODEL_NAME, "prompt": "abcabcabcabcabcabcabcabcabcabcabcabc",
            "max_tokens": 40, "temperature": 0, "ignore_eos": True}  # fmt: skip
    with running_server(
        tiny_model_dir("llama"),
        engine_overrides={"speculative_method": "ngram"},
        api_keys=("k",),
        price_per_hour=1.0,
    ) as server:
        headers = {"Authorization": "Bearer k"}
        assert httpx.get(f"{server.url}/v1/stats").status_code == 401
        for _ in range(2):
            r = httpx.post(f"{server.url}/v1/completions", json=body, headers=headers)
            assert r.status_code == 200
        server.wait_idle()
        stats = httpx.get(f"{server.url}/v1/stats", headers=headers).json()
        metrics = scrape(server.url, headers)
        # ?model= (the dashboard of a server of many models) names this server's, or is a 404.
        mine = httpx.get(f"{server.url}/v1/stats?model={MODEL_NAME}", headers=headers)
        other = httpx.get(f"{server.url}/v1/stats?model=nope", headers=headers)
    assert mine.status_code == 200 and mine.json()["model"] == MODEL_NAME
    assert other.status_code == 404 and MODEL_NAME in other.json()["error"]["message"]
    drafts = metrics["tokenmill:spec_decode_num_draft_tokens_total"]
    accepted = metrics["tokenmill:spec_decode_num_accepted_tokens_total"]
    assert drafts > 0
    # The window holds everything since the start (the engine was sampled at zero).
    assert stats["spec_acceptance_rate"] == pytest.approx(accepted / drafts)
    hits = metrics["tokenmill:prefix_cache_hits_total"]
    assert hits > 0
    assert stats["prefix_cache_hit_rate"] == pytest.approx(
        hits / metrics["tokenmill:prefix_cache_queries_total"]
    )
    assert stats["window_generation_tokens"] == 80
    assert stats["window_prompt_tokens"] == metrics["tokenmill:prompt_tokens_total"]
    assert stats["ttft_s"]["count"] == 2 and stats["ttft_s"]["p50"] > 0
    assert stats["itl_s"]["count"] > 0
    assert stats["usd_per_million_output_tokens"] == pytest.approx(
        cost_per_million_tokens(1.0, stats["generation_tokens_per_s"])
    )
    assert (stats["num_requests_running"], stats["status"]) == (0, "ready")
