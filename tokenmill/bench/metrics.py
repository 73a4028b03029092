"""Serving-benchmark metric math on timestamps, defined as vLLM's ``benchmarks/serve`` defines it.

No I/O: a ``RequestResult`` is what a client saw of one request (seconds from the request's
start), ``calculate_metrics`` turns a run of them and its wall time into ``BenchmarkMetrics``.

Definitions (vLLM's, so figures compare):
    TTFT   request start -> first chunk with content
    E2EL   request start -> last chunk with content
    TPOT   per request, (E2EL - TTFT) / (output tokens - 1), for requests with > 1 output token
    ITL    every gap between successive content chunks, pooled over all requests
    throughput   completed requests, output tokens, input + output tokens over the wall time
    goodput      completed requests meeting every SLO given (value <= SLO; a request with one
                 output token has TPOT 0 for this test) per second of wall time
Percentiles are numpy's (linear interpolation). Failed requests are counted apart and enter
no latency statistic and no token count.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

PERCENTILES = (50.0, 90.0, 99.0)
SLO_METRICS = ("ttft", "tpot", "e2el")


@dataclass(slots=True)
class RequestResult:
    """One request as the client saw it. Times in seconds.

    ``chunk_times`` are the arrival times of the content chunks, from the request's start
    (``start_time``, on the benchmark's clock); ``output_len`` is the output token count
    (from the server's usage, a tokenizer or the chunk count: ``output_len_source``).
    """

    success: bool
    prompt_len: int = 0
    output_len: int = 0
    start_time: float = 0.0
    chunk_times: list[float] = field(default_factory=list)
    generated_text: str = ""
    error: str = ""
    output_len_source: str = "chunks"  # "usage" | "tokenizer" | "chunks"
    prompt_len_source: str = "dataset"  # "usage" | "dataset"

    @property
    def ttft(self) -> float:
        return self.chunk_times[0]

    @property
    def e2el(self) -> float:
        return self.chunk_times[-1]

    @property
    def itl(self) -> list[float]:
        return [b - a for a, b in zip(self.chunk_times, self.chunk_times[1:])]

    @property
    def tpot(self) -> float | None:
        """(E2EL - TTFT) / (output tokens - 1); None for a single output token."""
        if self.output_len <= 1:
            return None
        return (self.e2el - self.ttft) / (self.output_len - 1)


@dataclass(frozen=True, slots=True)
class Distribution:
    """Mean, standard deviation, median and percentiles of one latency, in milliseconds."""

    mean: float
    std: float
    median: float
    percentiles: dict[str, float]  # "p90" -> ms

    @classmethod
    def of(
        cls, seconds: Sequence[float], percentiles: Sequence[float] = PERCENTILES
    ) -> Distribution:
        # NOTE: vLLM takes statistics of `values or 0`, so an empty list reads as all zeros.
        values = np.asarray(seconds if len(seconds) else [0.0], dtype=np.float64) * 1000.0
        return cls(
            mean=float(np.mean(values)),
            std=float(np.std(values)),
            median=float(np.median(values)),
            percentiles={_pname(p): float(np.percentile(values, p)) for p in percentiles},
        )


def _pname(p: float) -> str:
    return f"p{p:g}"


@dataclass(frozen=True, slots=True)
class BenchmarkMetrics:
    """A run's figures: counts, throughputs over ``duration_s``, latency distributions (ms)."""

    duration_s: float
    num_requests: int
    completed: int
    failed: int
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float  # completed requests / s
    request_goodput: float | None  # requests / s meeting every SLO (None: no SLO given)
    output_throughput: float  # output tokens / s
    total_token_throughput: float  # (input + output) tokens / s
    ttft_ms: Distribution
    tpot_ms: Distribution
    itl_ms: Distribution
    e2el_ms: Distribution
    per_user_output_throughput: float  # 1000 / mean TPOT (ms): the decode speed one user sees
    errors: dict[str, int]  # error text -> requests that failed with it


def parse_goodput(items: Sequence[str]) -> dict[str, float]:
    """``["ttft:500", "tpot:50"]`` -> ``{"ttft": 500.0, "tpot": 50.0}`` (milliseconds)."""
    slos: dict[str, float] = {}
    for item in items:
        name, sep, value = item.partition(":")
        if not sep or name not in SLO_METRICS:
            raise ValueError(
                f"--goodput takes NAME:MS with NAME one of {', '.join(SLO_METRICS)}; got {item!r}"
            )
        try:
            ms = float(value)
        except ValueError:
            raise ValueError(f"--goodput {item!r}: {value!r} is not a number") from None
        if not ms > 0:
            raise ValueError(f"--goodput {item!r}: the SLO must be > 0 ms")
        slos[name] = ms
    return slos


def is_good(result: RequestResult, slos: dict[str, float]) -> bool:
    """Whether a completed request meets every SLO (ms); a request's value may equal its SLO."""
    values = {"ttft": result.ttft, "tpot": result.tpot or 0.0, "e2el": result.e2el}
    return all(values[name] <= ms / 1000.0 for name, ms in slos.items())


def calculate_metrics(
    results: Sequence[RequestResult],
    duration_s: float,
    slos: dict[str, float] | None = None,
    percentiles: Sequence[float] = PERCENTILES,
) -> BenchmarkMetrics:
    """The run's metrics. ``slos``: goodput thresholds in ms by metric name (see parse_goodput)."""
    if duration_s <= 0:
        raise ValueError(f"benchmark duration must be > 0 s, got {duration_s}")
    done = [r for r in results if r.success]
    errors: dict[str, int] = {}
    for r in results:
        if not r.success:
            errors[r.error] = errors.get(r.error, 0) + 1
    total_input = sum(r.prompt_len for r in done)
    total_output = sum(r.output_len for r in done)
    tpots = [t for r in done if (t := r.tpot) is not None]
    itls = [gap for r in done for gap in r.itl]
    tpot = Distribution.of(tpots, percentiles)
    good = None if not slos else sum(is_good(r, slos) for r in done) / duration_s
    return BenchmarkMetrics(
        duration_s=duration_s,
        num_requests=len(results),
        completed=len(done),
        failed=len(results) - len(done),
        total_input_tokens=total_input,
        total_output_tokens=total_output,
        request_throughput=len(done) / duration_s,
        request_goodput=good,
        output_throughput=total_output / duration_s,
        total_token_throughput=(total_input + total_output) / duration_s,
        ttft_ms=Distribution.of([r.ttft for r in done], percentiles),
        tpot_ms=tpot,
        itl_ms=Distribution.of(itls, percentiles),
        e2el_ms=Distribution.of([r.e2el for r in done], percentiles),
        per_user_output_throughput=1000.0 / tpot.mean if tpots and tpot.mean > 0 else 0.0,
        errors=errors,
    )


def tokens_per_second_timeline(
    results: Sequence[RequestResult], bin_s: float = 1.0
) -> tuple[list[float], list[float]]:
    """Output tokens/s in bins of ``bin_s`` over the run: (bin start times, rates).

    A request's tokens are spread evenly over its content chunks (exact when each chunk is one
    token, as tokenmill and vLLM stream).
    """
    times: list[float] = []
    weights: list[float] = []
    for r in results:
        if not r.success or not r.chunk_times:
            continue
        per_chunk = r.output_len / len(r.chunk_times)
        times += [r.start_time + t for t in r.chunk_times]
        weights += [per_chunk] * len(r.chunk_times)
    if not times:
        return [], []
    num_bins = int(max(times) // bin_s) + 1
    counts = np.zeros(num_bins)
    np.add.at(counts, (np.asarray(times) // bin_s).astype(int), weights)
    return [i * bin_s for i in range(num_bins)], (counts / bin_s).tolist()
