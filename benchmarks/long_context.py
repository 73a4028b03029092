"""Long prompts and long contexts: tokenmill vs llama.cpp's llama-bench on the same GGUF.

For each context length L (default 4,096 and 8,192), 2 threads each, float16 KV on both sides:

    TTFT of an L-token prompt      tokenmill: ``bench latency`` (random prompts, median of
                                   --repeats, after a warm-up); llama.cpp: L / llama-bench's
                                   pp<L> tokens/s (flash attention on, its default batch and
                                   ubatch)
    decode tokens/s at L context   tokenmill: the same requests' decode rate over --decode
                                   tokens after the prompt; llama.cpp: llama-bench's
                                   tg<decode> @ d<L>

Ratios are tokenmill over llama.cpp (> 1: tokenmill faster). Each engine runs alone, one after
the other. Also shown: the KV bytes a request of L tokens holds at most in tokenmill's cache
(its KV layout's blocks: gemma-3-270m's 15 sliding-window layers keep their window and the
step's tokens, its 3 global layers every token; kv_layout.py).

    python benchmarks/long_context.py [--lengths 4096,8192] [--decode 64] [--repeats 3]
        [--max-num-batched-tokens 2048]

Needs llama-bench (bash shared/peers/build-llamacpp.sh, or $LLAMA_CPP_BIN the folder).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from memory_startup import LLAMA_BIN, cpu_line

THREADS = 2


def run_tokenmill(lengths: list[int], decode: int, repeats: int, chunk: int) -> dict[int, dict]:
    import torch

    from tokenmill.bench.cli import latency
    from tokenmill.config import EngineArgs
    from tokenmill.engine import LLMEngine
    from tokenmill.worker.model_runner import kv_bytes_per_block

    engine = LLMEngine(
        EngineArgs(
            model="gemma-3-270m",
            max_model_len=max(lengths) + decode + 16,
            kv_cache_dtype="float16",
            num_threads=THREADS,
            max_num_batched_tokens=chunk,
            enable_prefix_caching=False,  # every timed prompt is prefilled in full
        )
    )
    cfg = engine.config
    bs = cfg.cache_config.block_size
    layout = cfg.cache_config.layout(cfg.model_config.num_hidden_layers)
    per_block = kv_bytes_per_block(cfg.model_config, bs, torch.float32, "float16", layout)
    rows = {}
    for length in lengths:
        r = latency(engine, input_len=length, output_len=decode, num_iters=repeats)
        rows[length] = {
            "ttft_s": r["ttft_s_median"],
            "decode_tok_s": r["decode_tokens_per_s_median"],
            "kv_mib": per_block * layout.blocks_held(length + decode, bs, chunk) / 2**20,
        }
    return rows


def run_llamacpp(gguf: Path, lengths: list[int], decode: int, repeats: int) -> dict[int, dict]:
    binary = Path(os.environ.get("LLAMA_CPP_BIN", LLAMA_BIN)) / "llama-bench"
    if not binary.exists():
        raise SystemExit(f"no llama-bench at {binary}: bash shared/peers/build-llamacpp.sh")
    common = [str(binary), "-m", str(gguf), "-t", str(THREADS), "-fa", "1", "-ctk", "f16",
              "-ctv", "f16", "-r", str(repeats), "-o", "json"]  # fmt: skip
    lens = ",".join(map(str, lengths))
    runs = [[*common, "-p", lens, "-n", "0"], [*common, "-p", "0", "-n", str(decode), "-d", lens]]
    rows: dict[int, dict] = {length: {} for length in lengths}
    for cmd in runs:
        out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
        for test in json.loads(out):
            if test["n_prompt"]:
                rows[test["n_prompt"]]["ttft_s"] = test["n_prompt"] / test["avg_ts"]
            else:
                rows[test["n_depth"]]["decode_tok_s"] = test["avg_ts"]
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--lengths", default="4096,8192")
    p.add_argument("--decode", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--json", action="store_true", help="print the rows as JSON")
    ns = p.parse_args()
    lengths = [int(x) for x in ns.lengths.split(",")]

    from tokenmill.resolve import resolve_model

    gguf = resolve_model("gemma-3-270m").path
    tm = run_tokenmill(lengths, ns.decode, ns.repeats, ns.max_num_batched_tokens)
    lc = run_llamacpp(gguf, lengths, ns.decode, ns.repeats)
    if ns.json:
        print(json.dumps({"cpu": cpu_line(), "tokenmill": tm, "llama.cpp": lc}, indent=1))
        return
    print(f"{gguf.name}, {THREADS} threads, float16 KV, llama.cpp flash attention on")
    print(f"CPU: {cpu_line()}")
    print(f"tokenmill prefill chunks of {ns.max_num_batched_tokens} tokens; medians of "
          f"{ns.repeats}\n")  # fmt: skip
    print(f"{'context':>8} {'TTFT tm s':>10} {'TTFT llama s':>13} {'speedup':>8} "
          f"{'decode tm':>10} {'decode llama':>13} {'ratio':>6} {'tm KV MiB':>10}")  # fmt: skip
    for length in lengths:
        t, c = tm[length], lc[length]
        print(
            f"{length:>8} {t['ttft_s']:>10.2f} {c['ttft_s']:>13.2f} "
            f"{c['ttft_s'] / t['ttft_s']:>7.2f}x {t['decode_tok_s']:>10.1f} "
            f"{c['decode_tok_s']:>13.1f} {t['decode_tok_s'] / c['decode_tok_s']:>5.2f}x "
            f"{t['kv_mib']:>10.0f}"
        )


if __name__ == "__main__":
    sys.exit(main())
