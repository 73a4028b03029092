"""A benchmark's results as a readable table and as JSON (``--result-json``).

JSON schema, version 1 (docs/bench-serve.md explains each field)::

    {
      "schema_version": 1,
      "kind": "serve" | "throughput" | "latency",
      "tokenmill_version": str,
      "runs": [RUN, ...]            # one per benchmark point (several with --sweep-concurrency)
    }
    RUN = {
      "started_at": str,            # ISO 8601, UTC
      "backend": str,               # "openai-completions", "openai-chat", "tokenmill-engine"
      "base_url": str | null,       # null in process
      "model": str,
      "dataset": {"name", "path", "num_prompts", "input_len", "output_len", "range_ratio",
                  "prefix_len", "seed", "length_unit"},   # length_unit "tokens" | "words"
      "load": {"request_rate": float | null,   # null: all at once (inf)
               "burstiness": float, "max_concurrency": int | null},
      "duration_s": float,
      "num_requests": int, "completed": int, "failed": int,
      "errors": [{"error": str, "count": int}],
      "total_input_tokens": int, "total_output_tokens": int,
      "input_len_source": "usage" | "dataset" | "engine" | "mixed",
      "output_len_source": "usage" | "tokenizer" | "chunks" | "engine" | "mixed",
      "request_throughput": float,          # completed requests / s
      "request_goodput": float | null,      # requests / s meeting every SLO; null: no SLO
      "goodput_slos_ms": {"ttft"?: float, "tpot"?: float, "e2el"?: float},
      "output_throughput": float,           # output tokens / s
      "total_token_throughput": float,      # (input + output) tokens / s
      "per_user_output_throughput": float,  # 1000 / mean TPOT ms
      "ttft_ms" | "tpot_ms" | "itl_ms" | "e2el_ms":
          {"mean", "std", "median", "p50", "p90", "p99"},
      "cost": null | {"hardware_cost_per_hour": float,
                      "usd_per_million_output_tokens": float | null,
                      "usd_per_million_total_tokens": float | null},
      "requests": [{"success": bool, "prompt_len": int, "output_len": int, "start_s": float,
                    "chunk_times_s": [float, ...], "error": str}]
    }
"""

from __future__ import annotations

import datetime
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tokenmill.bench.datasets import DatasetSpec
from tokenmill.bench.metrics import BenchmarkMetrics, Distribution, RequestResult
from tokenmill.cost import cost_per_million_tokens

SCHEMA_VERSION = 1


@dataclass(slots=True)
class RunReport:
    """One benchmark point with everything its table and JSON need."""

    backend: str
    model: str
    dataset: DatasetSpec
    length_unit: str
    results: list[RequestResult]
    metrics: BenchmarkMetrics
    base_url: str | None = None
    request_rate: float = math.inf
    burstiness: float = 1.0
    max_concurrency: int | None = None
    slos: dict[str, float] = field(default_factory=dict)
    hardware_cost_per_hour: float | None = None
    started_at: str = field(
        default_factory=lambda: datetime.datetime.now(datetime.timezone.utc).isoformat()
    )

    def cost(self) -> dict[str, Any] | None:
        price = self.hardware_cost_per_hour
        if price is None:
            return None
        m = self.metrics
        return {
            "hardware_cost_per_hour": price,
            "usd_per_million_output_tokens": cost_per_million_tokens(price, m.output_throughput),
            "usd_per_million_total_tokens": cost_per_million_tokens(
                price, m.total_token_throughput
            ),
        }


def _source(results: list[RequestResult], attr: str) -> str:
    sources = {getattr(r, attr) for r in results if r.success}
    return sources.pop() if len(sources) == 1 else ("mixed" if sources else "none")


def _distribution(d: Distribution) -> dict[str, float]:
    return {"mean": d.mean, "std": d.std, "median": d.median, **d.percentiles}


def run_to_json(run: RunReport) -> dict[str, Any]:
    """One RUN object of the schema above."""
    m, ds = run.metrics, run.dataset
    return {
        "started_at": run.started_at,
        "backend": run.backend,
        "base_url": run.base_url,
        "model": run.model,
        "dataset": {
            "name": ds.name,
            "path": ds.path,
            "num_prompts": ds.num_prompts,
            "input_len": ds.input_len,
            "output_len": ds.output_len,
            "range_ratio": ds.range_ratio,
            "prefix_len": ds.prefix_len if ds.name == "shared-prefix" else 0,
            "seed": ds.seed,
            "length_unit": run.length_unit,
        },
        "load": {
            "request_rate": None if math.isinf(run.request_rate) else run.request_rate,
            "burstiness": run.burstiness,
            "max_concurrency": run.max_concurrency,
        },
        "duration_s": m.duration_s,
        "num_requests": m.num_requests,
        "completed": m.completed,
        "failed": m.failed,
        "errors": [{"error": e, "count": n} for e, n in sorted(m.errors.items())],
        "total_input_tokens": m.total_input_tokens,
        "total_output_tokens": m.total_output_tokens,
        "input_len_source": _source(run.results, "prompt_len_source"),
        "output_len_source": _source(run.results, "output_len_source"),
        "request_throughput": m.request_throughput,
        "request_goodput": m.request_goodput,
        "goodput_slos_ms": dict(run.slos),
        "output_throughput": m.output_throughput,
        "total_token_throughput": m.total_token_throughput,
        "per_user_output_throughput": m.per_user_output_throughput,
        "ttft_ms": _distribution(m.ttft_ms),
        "tpot_ms": _distribution(m.tpot_ms),
        "itl_ms": _distribution(m.itl_ms),
        "e2el_ms": _distribution(m.e2el_ms),
        "cost": run.cost(),
        "requests": [
            {
                "success": r.success,
                "prompt_len": r.prompt_len,
                "output_len": r.output_len if r.success else 0,
                "start_s": r.start_time,
                "chunk_times_s": r.chunk_times,
                "error": r.error,
            }
            for r in run.results
        ],
    }


def write_result_json(path: str, kind: str, runs: list[RunReport]) -> None:
    """Write the schema's document; ValueError when the file cannot be written."""
    from tokenmill import __version__

    doc = {
        "schema_version": SCHEMA_VERSION,
        "kind": kind,
        "tokenmill_version": __version__,
        "runs": [run_to_json(r) for r in runs],
    }
    try:
        Path(path).write_text(json.dumps(doc, indent=2) + "\n")
    except OSError as e:
        raise ValueError(f"--result-json: cannot write {path!r}: {e.strerror}") from None


def _line(label: str, value: Any) -> str:
    if isinstance(value, float):
        value = f"{value:.2f}"
    return f"{label:<40} {value}"


def format_table(run: RunReport, title: str = "Serving Benchmark Result") -> str:
    """vLLM's result block, plus goodput, cost and errors where they apply."""
    m = run.metrics
    out = [f"{' ' + title + ' ':=^50}"]
    out.append(_line("Successful requests:", m.completed))
    out.append(_line("Failed requests:", m.failed))
    if run.max_concurrency is not None:
        out.append(_line("Maximum request concurrency:", run.max_concurrency))
    rate = "inf" if math.isinf(run.request_rate) else f"{run.request_rate:g}"
    out.append(_line("Request rate (req/s):", rate))
    out.append(_line("Benchmark duration (s):", m.duration_s))
    out.append(_line("Total input tokens:", m.total_input_tokens))
    out.append(_line("Total generated tokens:", m.total_output_tokens))
    out.append(_line("Request throughput (req/s):", m.request_throughput))
    if m.request_goodput is not None:
        out.append(_line("Request goodput (req/s):", m.request_goodput))
    out.append(_line("Output token throughput (tok/s):", m.output_throughput))
    out.append(_line("Total token throughput (tok/s):", m.total_token_throughput))
    out.append(_line("Per-user output speed (tok/s):", m.per_user_output_throughput))
    cost = run.cost()
    if cost is not None:
        for key, label in (
            ("usd_per_million_output_tokens", "Cost per 1M output tokens (USD):"),
            ("usd_per_million_total_tokens", "Cost per 1M total tokens (USD):"),
        ):
            value = cost[key]
            out.append(_line(label, "n/a" if value is None else f"{value:.4f}"))
    for name, title_, d in (
        ("TTFT", "Time to First Token", m.ttft_ms),
        ("TPOT", "Time per Output Token (excl. 1st token)", m.tpot_ms),
        ("ITL", "Inter-token Latency", m.itl_ms),
        ("E2EL", "End-to-end Latency", m.e2el_ms),
    ):
        out.append(f"{title_:-^50}")
        out.append(_line(f"Mean {name} (ms):", d.mean))
        out.append(_line(f"Median {name} (ms):", d.median))
        for p, value in d.percentiles.items():
            if p != "p50":
                out.append(_line(f"{p.upper()} {name} (ms):", value))
    if m.errors:
        out.append(f"{'Errors':-^50}")
        out += [f"{n:>6} x {e}" for e, n in sorted(m.errors.items(), key=lambda kv: -kv[1])]
    out.append("=" * 50)
    return "\n".join(out)


def format_sweep(runs: list[RunReport]) -> str:
    """One line per concurrency: throughput, per-user speed, latencies and cost."""
    head = (
        f"{'concurrency':>11} {'out tok/s':>10} {'user tok/s':>10} {'TTFT p50 ms':>12} "
        f"{'TPOT p50 ms':>12} {'failed':>6} {'$/1M out':>9}"
    )
    lines = [head]
    for run in runs:
        m, cost = run.metrics, run.cost()
        usd = cost and cost["usd_per_million_output_tokens"]
        lines.append(
            f"{run.max_concurrency or 0:>11} {m.output_throughput:>10.2f} "
            f"{m.per_user_output_throughput:>10.2f} {m.ttft_ms.median:>12.1f} "
            f"{m.tpot_ms.median:>12.1f} {m.failed:>6} "
            f"{'' if usd is None else f'{usd:.4f}':>9}"
        )
    return "\n".join(lines)
