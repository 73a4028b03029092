"""``tokenmill bench latency | throughput``: timings through LLMEngine, printed as one table."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable

from tokenmill.bench.workload import random_prompts
from tokenmill.config import EngineArgs


def add_bench_parser(
    sub: argparse._SubParsersAction, add_engine_args: Callable[[argparse.ArgumentParser], None]
) -> None:
    bench = sub.add_parser("bench", help="measure latency or throughput")
    kinds = bench.add_subparsers(dest="bench_kind", required=True)
    lat = kinds.add_parser("latency", help="one request at a time: TTFT and decode tokens/s")
    add_engine_args(lat)
    lat.add_argument("--input-len", type=int, default=512)
    lat.add_argument("--output-len", type=int, default=128)
    lat.add_argument("--num-iters", type=int, default=3)
    lat.add_argument("--json", action="store_true", help="print one JSON object")
    thr = kinds.add_parser("throughput", help="many requests at once: output tokens/s")
    add_engine_args(thr)
    thr.add_argument("--num-prompts", type=int, default=64)
    thr.add_argument("--input-len", type=int, default=128)
    thr.add_argument("--output-len", type=int, default=128)
    thr.add_argument("--json", action="store_true", help="print one JSON object")


def run_bench(ns: argparse.Namespace, args: EngineArgs) -> int:
    from tokenmill.engine import LLMEngine

    for name in ("input_len", "output_len"):
        if getattr(ns, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
    engine = LLMEngine(args)
    result = latency(engine, ns) if ns.bench_kind == "latency" else throughput(engine, ns)
    if ns.json:
        print(json.dumps(result))
    else:
        for key, value in result.items():
            print(f"{key:>28}: {value:.4g}" if isinstance(value, float) else f"{key:>28}: {value}")
    return 0


def _params(output_len: int):
    from tokenmill.sampling_params import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)


def _run_to_end(engine) -> dict:
    finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    return finished


def latency(engine, ns: argparse.Namespace) -> dict:
    vocab = engine.config.model_config.vocab_size
    prompts = random_prompts(ns.num_iters + 1, ns.input_len, vocab, seed=1)
    engine.add_request(prompts[0], _params(min(8, ns.output_len)))  # warm-up
    _run_to_end(engine)
    ttfts, rates, e2es = [], [], []
    for prompt in prompts[1:]:
        rid = engine.add_request(prompt, _params(ns.output_len))
        m = _run_to_end(engine)[rid].metrics
        ttfts.append(m.ttft)
        e2es.append(m.e2e_latency)
        if m.num_generation_tokens > 1:
            rates.append((m.num_generation_tokens - 1) / (m.finished_time - m.first_token_time))
    return {
        "input_len": ns.input_len,
        "output_len": ns.output_len,
        "ttft_s_median": statistics.median(ttfts),
        "prefill_tokens_per_s": ns.input_len / statistics.median(ttfts),
        "decode_tokens_per_s_median": statistics.median(rates) if rates else 0.0,
        "e2e_s_median": statistics.median(e2es),
    }


def throughput(engine, ns: argparse.Namespace) -> dict:
    vocab = engine.config.model_config.vocab_size
    engine.add_request(random_prompts(1, 16, vocab, seed=2)[0], _params(4))  # warm-up
    _run_to_end(engine)
    prompts = random_prompts(ns.num_prompts, ns.input_len, vocab, seed=3)
    start = time.monotonic()
    for prompt in prompts:
        engine.add_request(prompt, _params(ns.output_len))
    finished = _run_to_end(engine)
    elapsed = time.monotonic() - start
    num_out = sum(len(o.outputs[0].token_ids) for o in finished.values())
    ttfts = [o.metrics.ttft for o in finished.values()]
    print(f"{len(finished)} requests in {elapsed:.1f}s", file=sys.stderr)
    return {
        "num_prompts": ns.num_prompts,
        "input_len": ns.input_len,
        "output_len": ns.output_len,
        "elapsed_s": elapsed,
        "output_tokens_per_s": num_out / elapsed,
        "total_tokens_per_s": (num_out + ns.num_prompts * ns.input_len) / elapsed,
        "requests_per_s": len(finished) / elapsed,
        "ttft_s_median": statistics.median(ttfts),
        "num_preemptions": engine.stats().num_preemptions,
        "spec_decode_mean_accepted_len": engine.stats().spec_decode.mean_accepted_len,
    }
