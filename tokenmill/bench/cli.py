"""``tokenmill bench latency | throughput | serve``.

latency and throughput time requests through an in-process LLMEngine; serve is an HTTP client
of any OpenAI-compatible server (bench/serve.py) and loads no engine. All three print a table
and write the same ``--result-json`` schema (bench/report.py).
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import statistics
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from tokenmill.bench.datasets import (
    DATASETS,
    Dataset,
    DatasetSpec,
    SampleRequest,
    dataset_spec_from,
    sample_requests,
)
from tokenmill.bench.metrics import RequestResult, calculate_metrics, parse_goodput
from tokenmill.bench.report import RunReport, format_sweep, format_table, write_result_json
from tokenmill.config import EngineArgs
from tokenmill.cost import cost_per_million_tokens

if TYPE_CHECKING:
    from tokenmill.tokenizer import Tokenizer

_DATASET_HELP = (
    f"prompts: {' | '.join(DATASETS[:2])} | sharegpt FILE | jsonl FILE (default: random; "
    "see docs/bench-serve.md for what the lengths mean)"
)


def _add_common(p: argparse.ArgumentParser, input_len: int, output_len: int | None) -> None:
    p.add_argument("--dataset", nargs="+", metavar=("NAME", "FILE"), help=_DATASET_HELP)
    p.add_argument("--input-len", type=int, default=input_len, help="prompt length")
    out_help = "output tokens per request (default: the dataset's, else 128)"
    p.add_argument("--output-len", type=int, default=output_len, help=out_help)
    p.add_argument(
        "--range-ratio",
        type=float,
        default=0.0,
        help="random lengths uniform in [len*(1-R), len*(1+R)] (default: 0)",
    )
    p.add_argument(
        "--prefix-len", type=int, default=256, help="shared-prefix: tokens of the common prefix"
    )
    p.add_argument(
        "--hardware-cost-per-hour",
        type=float,
        default=None,
        metavar="USD",
        help="price of the hardware per hour: prints cost per million tokens",
    )
    p.add_argument("--result-json", metavar="PATH", help="write the results (schema_version 1)")


def add_bench_parser(
    sub: argparse._SubParsersAction, add_engine_args: Callable[[argparse.ArgumentParser], None]
) -> None:
    bench = sub.add_parser("bench", help="measure latency or throughput, in process or a server")
    kinds = bench.add_subparsers(dest="bench_kind", required=True)
    lat = kinds.add_parser("latency", help="one request at a time: TTFT and decode tokens/s")
    add_engine_args(lat)
    _add_common(lat, 512, 128)
    lat.add_argument("--num-iters", type=int, default=3)
    lat.add_argument("--json", action="store_true", help="print one JSON object")
    thr = kinds.add_parser("throughput", help="many requests at once: output tokens/s")
    add_engine_args(thr)
    _add_common(thr, 128, 128)
    thr.add_argument("--num-prompts", type=int, default=64)
    thr.add_argument("--json", action="store_true", help="print one JSON object")
    add_serve_parser(kinds)


def add_serve_parser(kinds: argparse._SubParsersAction) -> None:
    srv = kinds.add_parser(
        "serve", help="benchmark any OpenAI-compatible server over HTTP (vLLM's metrics)"
    )
    srv.add_argument("--base-url", required=True, help="e.g. http://localhost:8000")
    srv.add_argument("--model", default=None, help="default: the first id of GET /v1/models")
    srv.add_argument("--endpoint", choices=("completions", "chat"), default="completions")
    _add_common(srv, 1024, None)
    srv.add_argument("--num-prompts", type=int, default=100)
    srv.add_argument(
        "--request-rate",
        type=float,
        default=math.inf,
        help="requests per second, or inf to send all at once (default: inf)",
    )
    srv.add_argument(
        "--burstiness",
        type=float,
        default=1.0,
        help="gamma shape of the arrival gaps: 1 Poisson, <1 burstier, >1 steadier",
    )
    srv.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight")
    srv.add_argument(
        "--goodput",
        nargs="+",
        default=None,
        metavar="NAME:MS",
        help="SLOs for goodput, e.g. ttft:500 tpot:50 e2el:10000",
    )
    srv.add_argument("--api-key", default=None, help="sent as Authorization: Bearer KEY")
    srv.add_argument(
        "--tokenizer",
        default=None,
        metavar="MODEL",
        help="tokenmill model (alias, .gguf, HF dir) whose tokenizer makes prompts of exact "
        "token lengths and counts output tokens when the server gives no usage",
    )
    srv.add_argument("--plot", metavar="PATH.png", help="latency CDFs and tokens/s over time")
    srv.add_argument(
        "--sweep-concurrency",
        metavar="C1,C2,...",
        default=None,
        help="one benchmark per max concurrency, e.g. 1,4,16,64",
    )
    srv.add_argument("--seed", type=int, default=0, help="seed of the prompts and arrival times")
    srv.add_argument("--disable-tqdm", action="store_true", help="no progress bar")


def run_bench(
    ns: argparse.Namespace, engine_args: Callable[[argparse.Namespace], EngineArgs]
) -> int:
    """Run one ``tokenmill bench`` kind; ``engine_args`` builds the in-process engine's
    arguments from the flags (serve needs none)."""
    if ns.bench_kind == "serve":
        return run_serve(ns)
    from tokenmill.engine import LLMEngine

    num_prompts = ns.num_iters + 1 if ns.bench_kind == "latency" else ns.num_prompts
    spec = _spec(ns, num_prompts, seed=1 if ns.bench_kind == "latency" else 3)
    engine = LLMEngine(engine_args(ns))
    run = _latency if ns.bench_kind == "latency" else _throughput
    result, report = run(engine, spec, ns.input_len, ns.output_len)
    report.model = ns.model
    report.hardware_cost_per_hour = ns.hardware_cost_per_hour
    if ns.hardware_cost_per_hour is not None:
        price = ns.hardware_cost_per_hour
        result["usd_per_million_output_tokens"] = cost_per_million_tokens(
            price, report.metrics.output_throughput
        )
        result["usd_per_million_total_tokens"] = cost_per_million_tokens(
            price, report.metrics.total_token_throughput
        )
    if ns.json:
        print(json.dumps(result))
    else:
        for key, value in result.items():
            print(f"{key:>30}: {value:.4g}" if isinstance(value, float) else f"{key:>30}: {value}")
    if ns.result_json:
        write_result_json(ns.result_json, ns.bench_kind, [report])
    return 0


def _spec(ns: argparse.Namespace, num_prompts: int, seed: int) -> DatasetSpec:
    return dataset_spec_from(
        ns.dataset,
        num_prompts=num_prompts,
        input_len=ns.input_len,
        output_len=ns.output_len,
        range_ratio=ns.range_ratio,
        prefix_len=ns.prefix_len,
        seed=seed,
    )


def _params(output_len: int):
    from tokenmill.sampling_params import SamplingParams

    # Delta outputs: each step's new tokens are all a timed run reads (their count, and when).
    return SamplingParams(
        temperature=0.0, max_tokens=output_len, ignore_eos=True, output_kind="delta"
    )


def run_timed(engine, dataset: Dataset, clock_zero: float) -> list[RequestResult]:
    """Queue every request now and step to the end, timing each step that gave a request
    tokens (one chunk a step), as a streaming client would see it."""
    results: dict[str, RequestResult] = {}
    num_tokens: dict[str, int] = collections.Counter()
    for req in dataset.requests:
        start = time.perf_counter() - clock_zero
        rid = engine.add_request(req.prompt, _params(req.output_len))
        results[rid] = RequestResult(
            success=False,
            prompt_len=req.prompt_len,
            start_time=start,
            output_len_source="engine",
            prompt_len_source="engine",
        )
    while engine.has_unfinished_requests():
        outs = engine.step()
        now = time.perf_counter() - clock_zero
        for out in outs:
            r = results[out.request_id]
            if out.outputs[0].token_ids_delta:
                r.chunk_times.append(now - r.start_time)
                num_tokens[out.request_id] += len(out.outputs[0].token_ids_delta)
            if out.finished:
                r.success = bool(r.chunk_times)
                r.error = (
                    "" if r.success else f"finished without output: {out.outputs[0].finish_reason}"
                )
                r.output_len = num_tokens[out.request_id]
                r.prompt_len = len(out.prompt_token_ids)
    return list(results.values())


def _report(engine, spec: DatasetSpec, dataset: Dataset, results, duration: float, c: int):
    return RunReport(
        backend="tokenmill-engine",
        model=str(getattr(engine.config.model_config.source, "path", "")),
        dataset=spec,
        length_unit=dataset.length_unit,
        results=results,
        metrics=calculate_metrics(results, duration),
        max_concurrency=c,
    )


def latency(engine, *, input_len: int = 512, output_len: int = 128, num_iters: int = 3) -> dict:
    """Random prompts one at a time (after a warm-up): median TTFT, decode tokens/s, E2E."""
    spec = DatasetSpec(
        num_prompts=num_iters + 1, input_len=input_len, output_len=output_len, seed=1
    )
    return _latency(engine, spec, input_len, output_len)[0]


def throughput(
    engine, *, num_prompts: int = 64, input_len: int = 128, output_len: int = 128
) -> dict:
    """Random prompts all queued at once (after a warm-up): tokens/s and median TTFT."""
    spec = DatasetSpec(num_prompts=num_prompts, input_len=input_len, output_len=output_len, seed=3)
    return _throughput(engine, spec, input_len, output_len)[0]


def _latency(engine, spec: DatasetSpec, input_len: int, output_len: int) -> tuple[dict, RunReport]:
    dataset = sample_requests(spec, engine.tokenizer, token_ids=True)
    if len(dataset.requests) < 2:
        raise ValueError("--num-iters must be >= 1")
    warmup, *timed = dataset.requests
    short = SampleRequest(warmup.prompt, warmup.prompt_len, min(8, warmup.output_len))
    run_timed(engine, Dataset([short], dataset.length_unit), time.perf_counter())
    results: list[RequestResult] = []
    clock_zero = time.perf_counter()
    for req in timed:  # one at a time
        results += run_timed(engine, Dataset([req], dataset.length_unit), clock_zero)
    duration = time.perf_counter() - clock_zero
    report = _report(engine, spec, dataset, results, duration, 1)
    ttfts = [r.ttft for r in results]
    rates = [(r.output_len - 1) / (r.e2el - r.ttft) for r in results if r.output_len > 1]
    prompt_len = statistics.median(r.prompt_len for r in results)
    return {
        "input_len": input_len,
        "output_len": output_len,
        "ttft_s_median": statistics.median(ttfts),
        "prefill_tokens_per_s": prompt_len / statistics.median(ttfts),
        "decode_tokens_per_s_median": statistics.median(rates) if rates else 0.0,
        "e2e_s_median": statistics.median(r.e2el for r in results),
    }, report


def _throughput(
    engine, spec: DatasetSpec, input_len: int, output_len: int
) -> tuple[dict, RunReport]:
    dataset = sample_requests(spec, engine.tokenizer, token_ids=True)
    # Warm up at the measured batch size (other random prompts, so no prefix-cache hits): the
    # first steps of a new size build its buffers and record its decode-step graph.
    warmup = DatasetSpec(
        input_len=input_len, output_len=4, num_prompts=spec.num_prompts, seed=spec.seed + 1
    )
    run_timed(engine, sample_requests(warmup, engine.tokenizer, True), time.perf_counter())
    clock_zero = time.perf_counter()
    results = run_timed(engine, dataset, clock_zero)
    elapsed = time.perf_counter() - clock_zero
    report = _report(engine, spec, dataset, results, elapsed, len(dataset.requests))
    m = report.metrics
    print(f"{m.completed} requests in {elapsed:.1f}s", file=sys.stderr)
    stats = engine.stats()
    return {
        "num_prompts": spec.num_prompts,
        "input_len": input_len,
        "output_len": output_len,
        "elapsed_s": elapsed,
        "output_tokens_per_s": m.output_throughput,
        "total_tokens_per_s": m.total_token_throughput,
        "requests_per_s": m.request_throughput,
        "ttft_s_median": m.ttft_ms.median / 1000.0,
        "num_preemptions": stats.num_preemptions,
        "spec_decode_mean_accepted_len": stats.spec_decode.mean_accepted_len,
    }, report


def load_bench_tokenizer(model: str) -> Tokenizer:
    """A tokenmill model's tokenizer, read from its files (no weights, no torch)."""
    from tokenmill.modelfile import summarize
    from tokenmill.resolve import resolve_model
    from tokenmill.tokenizer import load_tokenizer

    path = resolve_model(model).path
    return load_tokenizer(path, summarize(path).architecture)


def run_serve(ns: argparse.Namespace) -> int:
    """``tokenmill bench serve``: the benchmark (or sweep), its table, JSON and plot."""
    from tokenmill.bench.serve import (
        ServeConfig,
        parse_concurrencies,
        run_serve_benchmark,
        run_sweep,
    )

    slos = parse_goodput(ns.goodput or [])
    sweep = parse_concurrencies(ns.sweep_concurrency) if ns.sweep_concurrency else None
    if ns.plot:
        from tokenmill.bench.plot import check_matplotlib

        check_matplotlib()
    if ns.hardware_cost_per_hour is not None and ns.hardware_cost_per_hour < 0:
        raise ValueError("--hardware-cost-per-hour must be >= 0")
    tokenizer = load_bench_tokenizer(ns.tokenizer) if ns.tokenizer else None
    spec = _spec(ns, ns.num_prompts, ns.seed)
    dataset = sample_requests(spec, tokenizer)
    cfg = ServeConfig(
        base_url=ns.base_url,
        model=ns.model,
        endpoint=ns.endpoint,
        request_rate=ns.request_rate,
        burstiness=ns.burstiness,
        max_concurrency=ns.max_concurrency,
        api_key=ns.api_key,
        seed=ns.seed,
        progress=not ns.disable_tqdm,
    )
    outcomes = (
        run_sweep(cfg, dataset, sweep, tokenizer)
        if sweep
        else [run_serve_benchmark(cfg, dataset, tokenizer)]
    )
    reports = [
        RunReport(
            backend=f"openai-{o.config.endpoint}",
            model=o.model,
            dataset=spec,
            length_unit=dataset.length_unit,
            results=o.results,
            metrics=calculate_metrics(o.results, o.duration_s, slos),
            base_url=o.config.base_url,
            request_rate=o.config.request_rate,
            burstiness=o.config.burstiness,
            max_concurrency=o.config.max_concurrency,
            slos=slos,
            hardware_cost_per_hour=ns.hardware_cost_per_hour,
        )
        for o in outcomes
    ]
    for report in reports:
        print(format_table(report))
    if sweep:
        print(format_sweep(reports))
    if ns.result_json:
        write_result_json(ns.result_json, "serve", reports)
    if ns.plot:
        from tokenmill.bench.plot import plot_run, plot_sweep

        if sweep:
            plot_sweep(reports, ns.plot)
        else:
            plot_run(reports[0], ns.plot)
    return 0
