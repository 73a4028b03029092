"""Prefix caching on gemma-3-270m: a ~2,000-token shared system prompt, then 32 different short
questions sent one after another. Reports cold TTFT, median warm TTFT and total time with caching
on and off, plus a workload with no shared prefix (caching must cost nothing there).

    python benchmarks/prefix_caching.py
"""

from __future__ import annotations

import statistics
import time

from tokenmill.bench.workload import random_prompts
from tokenmill.config import EngineArgs
from tokenmill.engine import LLMEngine
from tokenmill.sampling_params import SamplingParams

NUM_QUESTIONS = 32
SYSTEM_LEN = 2000
QUESTION_LEN = 24
OUTPUT_LEN = 8


def run_sequential(engine: LLMEngine, prompts: list[list[int]]) -> tuple[list[float], float]:
    params = SamplingParams(temperature=0.0, max_tokens=OUTPUT_LEN, ignore_eos=True)
    ttfts = []
    start = time.monotonic()
    for prompt in prompts:
        rid = engine.add_request(prompt, params)
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished and out.request_id == rid:
                    ttfts.append(out.metrics.ttft)
    return ttfts, time.monotonic() - start


def main() -> None:
    results = {}
    for caching in (True, False):
        engine = LLMEngine(
            EngineArgs(max_model_len=4096, kv_cache_memory="1GiB", enable_prefix_caching=caching)
        )
        vocab = engine.config.model_config.vocab_size
        system = random_prompts(1, SYSTEM_LEN, vocab, seed=1)[0]
        questions = random_prompts(NUM_QUESTIONS, QUESTION_LEN, vocab, seed=2)
        run_sequential(engine, random_prompts(1, 64, vocab, seed=3))  # warm-up, unshared
        engine.reset_prefix_cache()
        ttfts, total = run_sequential(engine, [system + q for q in questions])
        unshared, unshared_total = run_sequential(
            engine, random_prompts(8, SYSTEM_LEN // 4, vocab, seed=4)
        )
        results[caching] = (ttfts, total, unshared_total)
        label = "on " if caching else "off"
        print(
            f"caching {label}: cold TTFT {ttfts[0] * 1000:.0f} ms, warm median TTFT "
            f"{statistics.median(ttfts[1:]) * 1000:.0f} ms, total {total:.2f} s; "
            f"no shared prefix (8 x {SYSTEM_LEN // 4} tokens): {unshared_total:.2f} s",
            flush=True,
        )
    on, off = results[True], results[False]
    print(
        f"warm/cold TTFT with caching: {statistics.median(on[0][1:]) / on[0][0]:.3f}; "
        f"total time off/on: {off[1] / on[1]:.2f}x; "
        f"unshared workload on/off: {on[2] / off[2]:.3f}"
    )


if __name__ == "__main__":
    main()
