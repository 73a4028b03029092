"""tokenmill vs llama.cpp (llama-cpp-python, built from source) on the same GGUF, 2 threads each.

(a) batch-1 decode tokens/s after a 128-token prompt (greedy, 128 tokens);
(b) prefill tokens/s for a 1,024-token prompt;
(c) total output tokens/s for 32 concurrent requests (128-token prompts, 128 tokens each;
    llama.cpp: 32 sequences decoded together in one batch per step, as its `batched` example);
(d) peak resident memory of the process that ran (a)-(c).
Each engine runs in its own process (so (d) is its own); both see the same random prompts.
Also (a) against the memory-bandwidth limit: bytes each engine reads per decoded token (its
weights as held in memory, plus the KV cache of the mean context) over the read bandwidth
measured just before and just after that engine's run (a 1 GiB float32 sum, 2 threads, in
this parent process; the mean of the two, which the table shows: a shared VM's bandwidth
drifts from minute to minute).
Needs `pip install llama-cpp-python` (builds llama.cpp with the machine's gcc, ~8 minutes).

    python benchmarks/vs_llamacpp.py [--model FILE.gguf] [--quantization none|int8|int4]
        [--kv-cache-dtype int8]   (--model: default the embedded gemma-3-270m)
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time

import numpy as np

DECODE_PROMPT, DECODE_TOKENS, PREFILL_PROMPT = 128, 128, 1024
MEAN_CONTEXT = DECODE_PROMPT + DECODE_TOKENS // 2  # tokens of KV cache a decode step reads
CONCURRENT, CONCURRENT_PROMPT, CONCURRENT_TOKENS = 32, 128, 128
THREADS = 2


def _prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    from tokenmill.bench.workload import random_prompts

    return random_prompts(n, length, vocab, seed=seed)


def _peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run_tokenmill(model: str, quantization: str | None, kv_cache_dtype: str) -> dict:
    import torch

    from tokenmill.bench.workload import run_to_completion
    from tokenmill.config import EngineArgs
    from tokenmill.engine import LLMEngine
    from tokenmill.worker.model_runner import kv_bytes_per_block

    engine = LLMEngine(
        EngineArgs(
            model=model,
            max_model_len=2048,
            kv_cache_memory="320MiB",
            quantization=quantization,
            kv_cache_dtype=kv_cache_dtype,
            max_num_seqs=CONCURRENT,
        )
    )
    vocab = engine.config.model_config.vocab_size

    run_to_completion(engine, _prompts(1, 16, vocab, seed=9), 4)  # warm-up
    out = {}
    (m,) = run_to_completion(engine, _prompts(1, PREFILL_PROMPT, vocab, seed=1), 1)
    out["prefill_tok_s"] = PREFILL_PROMPT / m.ttft
    (m,) = run_to_completion(engine, _prompts(1, DECODE_PROMPT, vocab, seed=2), DECODE_TOKENS + 1)
    out["decode_tok_s"] = DECODE_TOKENS / (m.finished_time - m.first_token_time)
    start = time.perf_counter()
    run_to_completion(
        engine, _prompts(CONCURRENT, CONCURRENT_PROMPT, vocab, seed=3), CONCURRENT_TOKENS
    )
    out["concurrent_tok_s"] = CONCURRENT * CONCURRENT_TOKENS / (time.perf_counter() - start)
    out["peak_rss_mib"] = _peak_rss_mib()
    out["weights_mib"] = engine.info.weight_nbytes / 2**20
    cfg = engine.config
    kv_per_token = (
        kv_bytes_per_block(
            cfg.model_config, cfg.cache_config.block_size, torch.float32, kv_cache_dtype
        )
        / cfg.cache_config.block_size
    )
    out["bytes_per_token"] = engine.info.weight_nbytes + MEAN_CONTEXT * kv_per_token
    return out


class _LlamaCpp:
    """llama.cpp through its C API: one context of ``n_seq`` sequences, greedy decoding."""

    def __init__(self, path: str, n_seq: int, n_ctx: int, n_batch: int) -> None:
        import llama_cpp as lc

        self.lc = lc
        lc.llama_backend_init()
        self.model = lc.llama_model_load_from_file(path.encode(), lc.llama_model_default_params())
        params = lc.llama_context_default_params()
        params.n_ctx, params.n_batch, params.n_ubatch = n_ctx, n_batch, n_batch
        params.n_seq_max, params.n_threads, params.n_threads_batch = n_seq, THREADS, THREADS
        self.ctx = lc.llama_init_from_model(self.model, params)
        self.vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(self.model))
        self.n_batch = n_batch
        self.batch = lc.llama_batch_init(n_batch, 0, n_seq)

    def clear(self) -> None:
        self.lc.llama_memory_clear(self.lc.llama_get_memory(self.ctx), True)

    def decode(self, items: list[tuple[int, int, int, bool]]) -> list[int]:
        """items: (token, position, sequence, wants logits); returns argmax of each wanted row."""
        picks = []
        for start in range(0, len(items), self.n_batch):
            chunk = items[start : start + self.n_batch]
            b = self.batch
            for i, (tok, pos, seq, wants) in enumerate(chunk):
                b.token[i], b.pos[i], b.n_seq_id[i] = tok, pos, 1
                b.seq_id[i][0], b.logits[i] = seq, wants
            b.n_tokens = len(chunk)
            if self.lc.llama_decode(self.ctx, b) != 0:
                raise RuntimeError("llama_decode failed")
            for i, (*_, wants) in enumerate(chunk):
                if wants:
                    row = self.lc.llama_get_logits_ith(self.ctx, i)
                    picks.append(int(np.ctypeslib.as_array(row, shape=(self.vocab,)).argmax()))
        return picks

    def generate(self, prompts: list[list[int]], n: int) -> None:
        """All sequences together: prompts in batches, then one token per sequence a step."""
        items = [
            (tok, pos, s, pos == len(p) - 1)
            for s, p in enumerate(prompts)
            for pos, tok in enumerate(p)
        ]
        tokens = self.decode(items)
        for step in range(n - 1):
            items = [(tokens[s], len(p) + step, s, True) for s, p in enumerate(prompts)]
            tokens = self.decode(items)


def run_llamacpp(path: str, vocab: int) -> dict:
    out = {}
    single = _LlamaCpp(path, n_seq=1, n_ctx=2048, n_batch=PREFILL_PROMPT)
    single.generate(_prompts(1, 16, vocab, seed=9), 4)  # warm-up
    single.clear()
    start = time.perf_counter()
    single.decode(
        [
            (t, i, 0, i == PREFILL_PROMPT - 1)
            for i, t in enumerate(_prompts(1, PREFILL_PROMPT, vocab, seed=1)[0])
        ]
    )
    out["prefill_tok_s"] = PREFILL_PROMPT / (time.perf_counter() - start)
    single.clear()
    prompt = _prompts(1, DECODE_PROMPT, vocab, seed=2)[0]
    (tok,) = single.decode([(t, i, 0, i == len(prompt) - 1) for i, t in enumerate(prompt)])
    start = time.perf_counter()
    for step in range(DECODE_TOKENS):
        (tok,) = single.decode([(tok, len(prompt) + step, 0, True)])
    out["decode_tok_s"] = DECODE_TOKENS / (time.perf_counter() - start)
    per_seq = CONCURRENT_PROMPT + CONCURRENT_TOKENS + 32
    many = _LlamaCpp(path, n_seq=CONCURRENT, n_ctx=CONCURRENT * per_seq, n_batch=512)
    start = time.perf_counter()
    many.generate(_prompts(CONCURRENT, CONCURRENT_PROMPT, vocab, seed=3), CONCURRENT_TOKENS)
    out["concurrent_tok_s"] = CONCURRENT * CONCURRENT_TOKENS / (time.perf_counter() - start)
    out["peak_rss_mib"] = _peak_rss_mib()
    return out


def read_bandwidth_gbs() -> float:
    """Sustained read bandwidth: the best of 5 sums over 1 GiB of float32, 2 threads."""
    import torch

    torch.set_num_threads(THREADS)
    x = torch.ones(1 << 28)
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - start)
    return x.numel() * 4 / best / 1e9


def _gguf_bytes_per_token(path: str, config) -> float:
    """llama.cpp reads the file's tensors as they are, and a float16 KV cache."""
    from tokenmill.models.gguf_file import GGUFFile

    weights = sum(t.num_bytes for t in GGUFFile(path).tensors)
    kv = 2 * config.num_key_value_heads * config.head_dim * 2 * config.num_hidden_layers
    return weights + MEAN_CONTEXT * kv


def _child(argv: list[str]) -> dict:
    proc = subprocess.run(
        [sys.executable, __file__, *argv], capture_output=True, text=True, check=False
    )
    if proc.returncode != 0:
        raise SystemExit(f"{argv[1]} run failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="gemma-3-270m", help="a GGUF file (or the alias)")
    parser.add_argument("--quantization", default=None)
    parser.add_argument("--kv-cache-dtype", default="auto")
    parser.add_argument("--engine", choices=("tokenmill", "llamacpp"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.engine == "tokenmill":
        print(json.dumps(run_tokenmill(args.model, args.quantization, args.kv_cache_dtype)))
        return
    if args.engine == "llamacpp":
        from tokenmill.config import config_from_gguf
        from tokenmill.models.gguf_file import GGUFFile
        from tokenmill.resolve import resolve_model

        source = resolve_model(args.model)
        gguf = GGUFFile(source.path)
        config = config_from_gguf(source.path, gguf.metadata, gguf.tensor_names())
        out = run_llamacpp(str(source.path), config.vocab_size)
        out["bytes_per_token"] = _gguf_bytes_per_token(str(source.path), config)
        print(json.dumps(out))
        return
    flags = ["--model", args.model, "--kv-cache-dtype", args.kv_cache_dtype]
    if args.quantization:
        flags += ["--quantization", args.quantization]
    runs = {}
    for name, argv in (
        ("tokenmill", ["--engine", "tokenmill", *flags]),
        ("llama.cpp", ["--engine", "llamacpp", "--model", args.model]),
    ):
        before = read_bandwidth_gbs()
        runs[name] = _child(argv)
        after = read_bandwidth_gbs()
        runs[name]["read_bw_gbs"] = (before + after) / 2
        print(
            name,
            json.dumps(runs[name]),
            f"(read bandwidth {before:.1f} / {after:.1f} GB/s)",
            flush=True,
        )
    tm, lc = runs["tokenmill"], runs["llama.cpp"]
    print("| | tokenmill | llama.cpp | ratio |\n|---|---|---|---|")
    for key, label in [
        ("decode_tok_s", "(a) batch-1 decode tok/s (128-token prompt)"),
        ("prefill_tok_s", "(b) prefill tok/s (1,024-token prompt)"),
        ("concurrent_tok_s", f"(c) output tok/s, {CONCURRENT} concurrent"),
        ("peak_rss_mib", "(d) peak RSS MiB"),
    ]:
        print(f"| {label} | {tm[key]:.1f} | {lc[key]:.1f} | {tm[key] / lc[key]:.2f}x |")
    print("\n(a) against the read bandwidth measured around each engine's run:")
    print("| | MB read per token | read GB/s | limit tok/s | (a) share of limit |")
    print("|---|---|---|---|---|")
    for name, r in runs.items():
        limit = r["read_bw_gbs"] * 1e9 / r["bytes_per_token"]
        mb, bw = r["bytes_per_token"] / 1e6, r["read_bw_gbs"]
        print(f"| {name} | {mb:.1f} | {bw:.1f} | {limit:.1f} | {r['decode_tok_s'] / limit:.0%} |")


if __name__ == "__main__":
    main()
