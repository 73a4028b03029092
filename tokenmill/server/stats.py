"""The live figures of GET /v1/stats (what /dashboard charts): a sliding window over the last
``stats_window`` seconds of request latencies and token counts, and the engine's counters.

``LiveWindow`` keeps one bucket a second: the TTFT and inter-token latency samples that ended
in it (at most ``MAX_SAMPLES`` each, later ones replacing random earlier ones, so a bucket's
samples stay a uniform draw) and its prompt, cached prompt and generation tokens. The request
trackers of server/metrics.py feed it as outputs arrive, on the event loop. Engine counters
(preemptions, prefix-cache queries and hits, draft and accepted tokens) are cumulative; a
sample of them a second (``sample_engine``) gives their change over the window.
"""

from __future__ import annotations

import math
import random
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from tokenmill.cost import TokenPrices, cost_per_million_tokens
from tokenmill.outputs import EngineStats
from tokenmill.server.protocol import LiveStats, Percentiles

MAX_SAMPLES = 500  # per kind per one-second bucket: a 60 s window sorts at most 30k


@dataclass(slots=True)
class _Bucket:
    second: int
    ttfts: list[float] = field(default_factory=list)
    itls: list[float] = field(default_factory=list)
    num_ttft: int = 0  # samples offered (more than kept when capped)
    num_itl: int = 0
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    generation_tokens: int = 0


@dataclass(frozen=True, slots=True)
class _EngineSample:
    time: float
    num_preemptions: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_draft_tokens: int
    num_accepted_tokens: int

    @classmethod
    def of(cls, now: float, s: EngineStats) -> _EngineSample:
        spec = s.spec_decode
        return cls(now, s.num_preemptions, s.prefix_cache_queries, s.prefix_cache_hits,
                   spec.num_draft_tokens, spec.num_accepted_tokens)  # fmt: skip


class LiveWindow:
    """The last ``window_s`` seconds of latencies and tokens, in one-second buckets."""

    def __init__(self, window_s: float = 60.0, clock: Callable[[], float] = time.monotonic):
        self.window_s = window_s
        self._clock = clock
        self._buckets: deque[_Bucket] = deque()
        self._engine: deque[_EngineSample] = deque()
        self._rng = random.Random(0)
        self.started = clock()

    def _bucket(self) -> _Bucket:
        second = int(self._clock())
        if not self._buckets or self._buckets[-1].second != second:
            self._buckets.append(_Bucket(second))
            self._expire(second)
        return self._buckets[-1]

    def _expire(self, now: float) -> None:
        while self._buckets and self._buckets[0].second <= now - self.window_s:
            self._buckets.popleft()

    def _keep(self, samples: list[float], num_offered: int, value: float) -> None:
        if len(samples) < MAX_SAMPLES:
            samples.append(value)
            return
        idx = self._rng.randrange(num_offered)  # reservoir sampling
        if idx < MAX_SAMPLES:
            samples[idx] = value

    def add_ttft(self, seconds: float) -> None:
        b = self._bucket()
        b.num_ttft += 1
        self._keep(b.ttfts, b.num_ttft, seconds)

    def add_itl(self, seconds: float) -> None:
        b = self._bucket()
        b.num_itl += 1
        self._keep(b.itls, b.num_itl, seconds)

    def add_prompt(self, num_tokens: int, num_cached: int) -> None:
        b = self._bucket()
        b.prompt_tokens += num_tokens
        b.cached_prompt_tokens += num_cached

    def add_generation(self, num_tokens: int) -> None:
        self._bucket().generation_tokens += num_tokens

    def sample_engine(self, stats: EngineStats) -> None:
        """Record the engine's counters now (called about once a second)."""
        now = self._clock()
        self._engine.append(_EngineSample.of(now, stats))
        # Keep one sample at or before the window's start, to difference against.
        while len(self._engine) > 1 and self._engine[1].time <= now - self.window_s:
            self._engine.popleft()

    def snapshot(
        self,
        stats: EngineStats,
        prices: TokenPrices,
        price_per_hour: float | None,
        model: str,
        status: str,
    ) -> LiveStats:
        now = self._clock()
        self._expire(int(now))
        buckets = list(self._buckets)
        # The window spans from its first second to now, never more than window_s, and at
        # least a second (a rate over the first instants of a run is noise).
        span = min(self.window_s, max(now - self.started, 1.0))
        prompt = sum(b.prompt_tokens for b in buckets)
        cached = sum(b.cached_prompt_tokens for b in buckets)
        generation = sum(b.generation_tokens for b in buckets)
        prompt_tps = prompt / span
        generation_tps = generation / span
        current = _EngineSample.of(now, stats)
        base = self._engine[0] if self._engine else _EngineSample.of(now, EngineStats())
        queries = current.prefix_cache_queries - base.prefix_cache_queries
        hits = current.prefix_cache_hits - base.prefix_cache_hits
        drafts = current.num_draft_tokens - base.num_draft_tokens
        accepted = current.num_accepted_tokens - base.num_accepted_tokens
        total_tokens = prompt + generation
        return LiveStats(
            time=time.time(),
            model=model,
            status=status,
            window_s=self.window_s,
            uptime_s=round(now - self.started, 3),
            num_requests_running=stats.num_running,
            num_requests_waiting=stats.num_waiting,
            kv_cache_usage=stats.kv_cache_usage,
            prefix_cache_hit_rate=hits / queries if queries > 0 else None,
            ttft_s=_percentiles([v for b in buckets for v in b.ttfts],
                                sum(b.num_ttft for b in buckets)),
            itl_s=_percentiles([v for b in buckets for v in b.itls],
                               sum(b.num_itl for b in buckets)),
            prompt_tokens_per_s=prompt_tps,
            generation_tokens_per_s=generation_tps,
            window_prompt_tokens=prompt,
            window_cached_prompt_tokens=cached,
            window_generation_tokens=generation,
            num_preemptions=stats.num_preemptions,
            window_preemptions=current.num_preemptions - base.num_preemptions,
            spec_acceptance_rate=accepted / drafts if drafts > 0 else None,
            price_per_hour=price_per_hour,
            usd_per_million_output_tokens=(
                cost_per_million_tokens(price_per_hour, generation_tps)
                if price_per_hour is not None else None
            ),
            usd_per_million_total_tokens=(
                cost_per_million_tokens(price_per_hour, prompt_tps + generation_tps)
                if price_per_hour is not None else None
            ),
            usd_per_million_tokens_billed=(
                prices.cost(prompt, generation, cached) / total_tokens * 1e6
                if total_tokens > 0 and prices != TokenPrices() else None
            ),
        )  # fmt: skip


def _percentiles(values: list[float], count: int) -> Percentiles:
    """p50 / p90 / p99 (nearest rank) of ``values``; ``count`` samples were offered."""
    if not values:
        return Percentiles(count=0)
    ordered = sorted(values)

    def rank(q: float) -> float:
        return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]

    return Percentiles(count=count, p50=rank(0.5), p90=rank(0.9), p99=rank(0.99), max=ordered[-1])
