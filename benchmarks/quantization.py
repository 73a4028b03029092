"""Each weight / KV-cache mode of gemma-3-270m side by side, one process per mode.

Per mode: weight bytes and process RSS after load, batch-1 decode tokens/s (128-token prompt,
128 tokens), output tokens/s for 32 concurrent requests (128-token prompts, 128 tokens each),
and how many 1,000-token requests fit at once in a fixed 1 GiB KV budget (the scheduler admits
by whole blocks, so this is blocks // blocks-per-request).

    python benchmarks/quantization.py [--modes gguf,none,...]
"""

from __future__ import annotations

import argparse
import json
import math
import resource
import subprocess
import sys
import time

MODES = {
    "dequantized fp32": {"quantization": "none"},
    "gguf packed (int8 act.)": {},
    "gguf packed (fp32 act.)": {"packed_activations": "float32"},
    "int8 (from fp32)": {"quantization": "int8"},
    "int4 g32 (from fp32)": {"quantization": "int4"},
    "gguf packed + KV float16": {"kv_cache_dtype": "float16"},
    "gguf packed + KV int8": {"kv_cache_dtype": "int8"},
    "gguf packed + KV fp8": {"kv_cache_dtype": "fp8"},
}
KV_BUDGET = "1GiB"
REQUEST_TOKENS = 1000


def _rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def run_mode(kwargs: dict) -> dict:
    from tokenmill.bench.workload import random_prompts, run_to_completion
    from tokenmill.config import EngineArgs
    from tokenmill.engine import LLMEngine

    engine = LLMEngine(
        EngineArgs(max_model_len=2048, kv_cache_memory=KV_BUDGET, max_num_seqs=32, **kwargs)
    )
    out = {
        "weights_mib": engine.info.weight_nbytes / 2**20,
        "rss_after_load_mib": _rss_mib(),
    }
    blocks_per_request = math.ceil(REQUEST_TOKENS / engine.config.cache_config.block_size)
    out["max_concurrent_1000"] = engine.num_total_blocks // blocks_per_request
    vocab = engine.config.model_config.vocab_size

    run_to_completion(engine, random_prompts(1, 16, vocab, seed=9), 4)  # warm-up
    (m,) = run_to_completion(engine, random_prompts(1, 128, vocab, seed=2), 129)
    out["decode_tok_s"] = 128 / (m.finished_time - m.first_token_time)
    start = time.perf_counter()
    run_to_completion(engine, random_prompts(32, 128, vocab, seed=3), 128)
    out["concurrent32_tok_s"] = 32 * 128 / (time.perf_counter() - start)
    out["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--modes", default=",".join(MODES), help="comma-separated mode names")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(run_mode(json.loads(args.child))))
        return
    from tokenmill.resolve import resolve_model

    file_mib = resolve_model("gemma-3-270m").path.stat().st_size / 2**20
    print(f"gemma-3-270m GGUF file: {file_mib:.1f} MiB; KV budget {KV_BUDGET}")
    print(
        "| mode | weights MiB | RSS after load MiB | batch-1 decode tok/s | 32 concurrent tok/s "
        "| max concurrent 1,000-token requests |\n|---|---|---|---|---|---|"
    )
    for name in args.modes.split(","):
        proc = subprocess.run(
            [sys.executable, __file__, "--child", json.dumps(MODES[name])],
            capture_output=True,
            text=True,
            check=False,
        )
        if proc.returncode != 0:
            print(f"| {name} | failed: {proc.stderr.strip().splitlines()[-1]} |")
            continue
        r = json.loads(proc.stdout.strip().splitlines()[-1])
        print(
            f"| {name} | {r['weights_mib']:.0f} | {r['rss_after_load_mib']:.0f} "
            f"| {r['decode_tok_s']:.1f} | {r['concurrent32_tok_s']:.1f} "
            f"| {r['max_concurrent_1000']} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
