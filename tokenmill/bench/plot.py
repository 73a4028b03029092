"""``--plot PATH.png``: matplotlib (Agg) figures of a benchmark.

One run: the CDFs of TTFT, ITL and E2EL, and output tokens/s over the run's time. A sweep:
throughput against per-user tokens/s (each point a concurrency: the curve an operator picks a
point on) and cost per million tokens against concurrency.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from tokenmill.bench.metrics import tokens_per_second_timeline

if TYPE_CHECKING:
    from tokenmill.bench.report import RunReport

NEEDS_MATPLOTLIB = "--plot needs matplotlib: pip install 'tokenmill[bench]'"


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise ValueError(NEEDS_MATPLOTLIB) from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def check_matplotlib() -> None:
    """ValueError before a benchmark runs whose plot could not be drawn."""
    _pyplot()


def _cdf(ax, seconds: list[float], label: str) -> None:
    values = np.sort(np.asarray(seconds, dtype=np.float64) * 1000.0)
    if len(values):
        ax.step(values, np.arange(1, len(values) + 1) / len(values), where="post", label=label)


def plot_run(run: RunReport, path: str) -> None:
    """TTFT / ITL / E2EL CDFs and output tokens/s over time, in one PNG."""
    plt = _pyplot()
    done = [r for r in run.results if r.success]
    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    for ax, name, values in (
        (axes[0][0], "TTFT", [r.ttft for r in done]),
        (axes[0][1], "ITL", [gap for r in done for gap in r.itl]),
        (axes[1][0], "E2EL", [r.e2el for r in done]),
    ):
        _cdf(ax, values, name)
        ax.set_xlabel(f"{name} (ms)")
        ax.set_ylabel("fraction of " + ("gaps" if name == "ITL" else "requests"))
        ax.set_title(f"{name} CDF")
        ax.grid(alpha=0.3)
    times, rates = tokens_per_second_timeline(run.results)
    ax = axes[1][1]
    ax.step(times, rates, where="post")
    ax.set_xlabel("time since start (s)")
    ax.set_ylabel("output tokens/s")
    ax.set_title("output tokens/s over time (1 s bins)")
    ax.grid(alpha=0.3)
    fig.suptitle(f"{run.model} via {run.backend}: {run.metrics.completed} requests")
    _save(fig, path)


def plot_sweep(runs: list[RunReport], path: str) -> None:
    """Throughput vs per-user tokens/s, and cost per million tokens vs concurrency."""
    plt = _pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 5))
    user = [r.metrics.per_user_output_throughput for r in runs]
    total = [r.metrics.output_throughput for r in runs]
    left.plot(user, total, marker="o")
    for run, x, y in zip(runs, user, total):
        left.annotate(f"c={run.max_concurrency}", (x, y), textcoords="offset points", xytext=(4, 4))
    left.set_xlabel("per-user output tokens/s (1000 / mean TPOT ms)")
    left.set_ylabel("output tokens/s (all users)")
    left.set_title("throughput vs per-user speed")
    left.grid(alpha=0.3)
    concurrency = [r.max_concurrency for r in runs]
    costs = [r.cost() for r in runs]
    if all(c is not None for c in costs):
        for key, label in (
            ("usd_per_million_output_tokens", "per 1M output tokens"),
            ("usd_per_million_total_tokens", "per 1M total tokens"),
        ):
            right.plot(concurrency, [c[key] for c in costs], marker="o", label=label)
        right.set_ylabel("USD")
        right.legend()
        right.set_title("cost per million tokens vs concurrency")
    else:
        right.plot(concurrency, total, marker="o")
        right.set_ylabel("output tokens/s")
        right.set_title("throughput vs concurrency (no --hardware-cost-per-hour)")
    right.set_xscale("log", base=2)
    right.set_xticks(concurrency, [str(c) for c in concurrency])
    right.set_xlabel("max concurrency")
    right.grid(alpha=0.3)
    fig.suptitle(f"{runs[0].model} via {runs[0].backend}: concurrency sweep")
    _save(fig, path)


def _save(fig, path: str) -> None:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    try:
        fig.savefig(path, dpi=100)
    except OSError as e:
        raise ValueError(f"--plot: cannot write {path!r}: {e.strerror}") from None
    finally:
        plt.close(fig)
