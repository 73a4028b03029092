"""Prometheus metrics with vLLM's names and buckets (``tokenmill:`` prefix), and a stats log line.

Each app owns its CollectorRegistry, so two servers in one process never share counters.
Request-level metrics are recorded by the request's handler as its outputs arrive (one
``RequestTracker`` per engine request, all on the event loop); engine-level gauges and counters
(running, waiting, KV usage, preemptions, prefix cache) are read from ``AsyncEngine.stats`` when
/metrics is scraped.

Definitions, as in vLLM v1:
    time_to_first_token_seconds         arrival -> first output token
    inter_token_latency_seconds         between successive outputs of a request
    request_time_per_output_token_seconds  (finish - first token) / (output tokens - 1)
    e2e_request_latency_seconds         arrival -> finish
    request_queue_time_seconds          arrival -> first scheduled
    prefix_cache_queries/hits_total     in tokens
    kv_cache_usage_perc                 a fraction in [0, 1]
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from tokenmill.outputs import EngineStats, RequestOutput
from tokenmill.server.stats import LiveWindow

logger = logging.getLogger(__name__)

TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
    10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
TOKEN_LATENCY_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0,
)  # fmt: skip
REQUEST_LATENCY_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
    240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip

LABELS = ("model_name", "engine")
FINISH_REASONS = ("stop", "length", "abort")


class ServerMetrics:
    """The metrics of one server. ``stats`` returns the engine's latest snapshot (None while
    the model loads)."""

    def __init__(
        self,
        model_name: str,
        stats: Callable[[], EngineStats | None],
        window_s: float = 60.0,
    ) -> None:
        self.registry = CollectorRegistry()
        # The dashboard's sliding window (server/stats.py), fed by the same trackers.
        self.window = LiveWindow(window_s)
        labels = (model_name, "0")
        r = self.registry

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, LABELS, buckets=buckets, registry=r).labels(*labels)

        self.ttft = histogram(
            "tokenmill:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            TTFT_BUCKETS,
        )
        self.inter_token_latency = histogram(
            "tokenmill:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
            TOKEN_LATENCY_BUCKETS,
        )
        self.time_per_output_token = histogram(
            "tokenmill:request_time_per_output_token_seconds",
            "Histogram of time_per_output_token_seconds per request.",
            TOKEN_LATENCY_BUCKETS,
        )
        self.e2e_latency = histogram(
            "tokenmill:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.queue_time = histogram(
            "tokenmill:request_queue_time_seconds",
            "Histogram of time spent in WAITING phase for request.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.prompt_tokens = Counter(
            "tokenmill:prompt_tokens", "Number of prefill tokens processed.", LABELS, registry=r
        ).labels(*labels)
        self.generation_tokens = Counter(
            "tokenmill:generation_tokens",
            "Number of generation tokens processed.",
            LABELS,
            registry=r,
        ).labels(*labels)
        success = Counter(
            "tokenmill:request_success",
            "Count of successfully processed requests.",
            (*LABELS, "finished_reason"),
            registry=r,
        )
        self.request_success = {
            reason: success.labels(*labels, reason) for reason in FINISH_REASONS
        }
        r.register(_EngineStatsCollector(labels, stats))
        # Plain totals for the periodic log line.
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0

    def track(self) -> RequestTracker:
        """A tracker for one engine request; feed it every output of that request."""
        return RequestTracker(self)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class RequestTracker:
    """Records one request's token counts and latencies as its outputs arrive."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self._m = metrics
        self._last_token_time: float | None = None
        self._done = False

    def observe(self, out: RequestOutput) -> None:
        now = time.monotonic()
        num_new = sum(len(c.token_ids_delta) for c in out.outputs)
        m = self._m
        if num_new:
            if self._last_token_time is None:
                ttft = out.metrics.ttft
                if ttft is not None:
                    m.ttft.observe(ttft)
                    m.window.add_ttft(ttft)
                m.prompt_tokens.inc(len(out.prompt_token_ids))
                m.num_prompt_tokens += len(out.prompt_token_ids)
                m.window.add_prompt(len(out.prompt_token_ids), out.metrics.num_cached_tokens)
            else:
                m.inter_token_latency.observe(now - self._last_token_time)
                m.window.add_itl(now - self._last_token_time)
            self._last_token_time = now
            # A final-only output comes once: the engine timed the steps between its tokens.
            for itl in out.metrics.inter_token_latencies or ():
                m.inter_token_latency.observe(itl)
                m.window.add_itl(itl)
            m.generation_tokens.inc(num_new)
            m.window.add_generation(num_new)
            m.num_generation_tokens += num_new
        elif out.embedding is not None:  # an embedding request: its prompt ran, no tokens
            m.prompt_tokens.inc(len(out.prompt_token_ids))
            m.num_prompt_tokens += len(out.prompt_token_ids)
            m.window.add_prompt(len(out.prompt_token_ids), out.metrics.num_cached_tokens)
        if out.finished:
            reasons = {c.finish_reason for c in out.outputs}
            self.finish("abort" if "abort" in reasons else None, out)

    def finish(self, reason: str | None, out: RequestOutput | None = None) -> None:
        """Count the request once: ``reason`` "abort", or the finish reason of ``out``."""
        if self._done:
            return
        self._done = True
        m = self._m
        if reason is None and out is not None:
            reason = "length" if any(c.finish_reason == "length" for c in out.outputs) else "stop"
        m.request_success[reason or "abort"].inc()
        if reason == "abort" or out is None:
            return
        metrics = out.metrics
        if metrics.e2e_latency is not None:
            m.e2e_latency.observe(metrics.e2e_latency)
        if metrics.queue_time is not None:
            m.queue_time.observe(metrics.queue_time)
        if metrics.time_per_output_token is not None:
            m.time_per_output_token.observe(metrics.time_per_output_token)


class _EngineStatsCollector(Collector):
    """Gauges and cumulative counters read from the engine's stats snapshot at scrape time."""

    def __init__(self, labels: tuple[str, str], stats: Callable[[], EngineStats | None]) -> None:
        self._labels = list(labels)
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        s = self._stats() or EngineStats()
        gauges = (
            ("num_requests_running", "Number of requests in model execution batches.", s.num_running),
            ("num_requests_waiting", "Number of requests waiting to be processed.", s.num_waiting),
            ("kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", s.kv_cache_usage),
        )  # fmt: skip
        for name, doc, value in gauges:
            family = GaugeMetricFamily(f"tokenmill:{name}", doc, labels=LABELS)
            family.add_metric(self._labels, value)
            yield family
        counters = (
            ("num_preemptions", "Cumulative number of preemption from the engine.", s.num_preemptions),
            ("prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.", s.prefix_cache_queries),
            ("prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.", s.prefix_cache_hits),
        )  # fmt: skip
        spec = s.spec_decode
        counters += (
            ("spec_decode_num_drafts", "Number of spec decoding drafts (requests x steps verified).", spec.num_drafts),
            ("spec_decode_num_draft_tokens", "Number of draft tokens.", spec.num_draft_tokens),
            ("spec_decode_num_accepted_tokens", "Number of accepted tokens.", spec.num_accepted_tokens),
        )  # fmt: skip
        for name, doc, value in counters:
            family = CounterMetricFamily(f"tokenmill:{name}", doc, labels=LABELS)
            family.add_metric(self._labels, value)
            yield family
        if s.expert_tokens is not None:  # EngineArgs.moe_router_stats
            experts = CounterMetricFamily(
                "tokenmill:moe_expert_tokens",
                "Tokens each expert of a mixture-of-experts layer has run.",
                labels=(*LABELS, "layer", "expert"),
            )
            for layer, counts in s.expert_tokens.items():
                for expert, count in enumerate(counts):
                    experts.add_metric([*self._labels, str(layer), str(expert)], count)
            yield experts
        per_pos = CounterMetricFamily(
            "tokenmill:spec_decode_num_accepted_tokens_per_pos",
            "Accepted tokens per draft position.",
            labels=[*LABELS, "position"],
        )
        for pos, value in enumerate(spec.accepted_per_pos):
            per_pos.add_metric([*self._labels, str(pos)], value)
        yield per_pos


async def log_stats_periodically(
    metrics: ServerMetrics, stats: Callable[[], EngineStats | None], interval: float
) -> None:
    """Every ``interval`` s: prompt and generation tokens/s, running/waiting, KV usage.

    Quiet while idle: a line is written only when tokens moved or requests are in the engine.
    """
    last_time = time.monotonic()
    last_prompt, last_gen = metrics.num_prompt_tokens, metrics.num_generation_tokens
    while True:
        await asyncio.sleep(interval)
        now = time.monotonic()
        elapsed = max(now - last_time, 1e-9)
        prompt = metrics.num_prompt_tokens - last_prompt
        gen = metrics.num_generation_tokens - last_gen
        s = stats() or EngineStats()
        if prompt or gen or s.num_running or s.num_waiting:
            logger.info(
                "prompt %.1f tokens/s, generation %.1f tokens/s, running %d, waiting %d, "
                "KV cache %.1f%%, prefix cache hits %.1f%%",
                prompt / elapsed,
                gen / elapsed,
                s.num_running,
                s.num_waiting,
                100 * s.kv_cache_usage,
                100 * s.prefix_cache_hits / max(s.prefix_cache_queries, 1),
            )
        last_time, last_prompt, last_gen = (
            now,
            metrics.num_prompt_tokens,
            metrics.num_generation_tokens,
        )
