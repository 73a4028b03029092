"""tokenmill vs transformers' ``generate`` on the same GGUF model, one process, same prompts.

(a) batch-1: TTFT of a 512-token prompt and decode tokens/s over 128 tokens;
(b) throughput: 64 prompts of 128 tokens, 128 output tokens each (transformers: one padded
    batch through ``generate``; tokenmill: continuous batching);
(b floor) the least time (b) can take with tokenmill's matmuls: every matmul of the workload
    (prefill steps of max_num_batched_tokens rows, decode steps of 64 rows, the output head for
    each generated token) timed alone, without attention, norms, sampling or scheduling.

    python benchmarks/vs_transformers.py [--hf-dtype float32] [--tm-dtype float32]

Run on a quiet machine (check /proc/loadavg): a busy second core stalls 2-thread kernels.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from tokenmill.bench.workload import random_prompts
from tokenmill.config import EngineArgs
from tokenmill.engine import LLMEngine
from tokenmill.layers.linear import FusedLinear, Linear
from tokenmill.sampling_params import SamplingParams


def tokenmill_runs(args: argparse.Namespace) -> dict:
    engine = LLMEngine(
        EngineArgs(
            model=args.model, dtype=args.tm_dtype, max_model_len=2048, kv_cache_memory="2GiB"
        )
    )
    vocab = engine.config.model_config.vocab_size
    out: dict = {"vocab_size": vocab}

    def run(prompts, max_tokens):
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        ids = [engine.add_request(p, params) for p in prompts]
        done = {}
        start = time.monotonic()
        while engine.has_unfinished_requests():
            for o in engine.step():
                if o.finished:
                    done[o.request_id] = o
        return [done[i] for i in ids], time.monotonic() - start

    run(random_prompts(1, 32, vocab, seed=9), 4)  # warm-up
    (res,), _ = run(random_prompts(1, args.input_len, vocab, seed=1), args.output_len)
    m = res.metrics
    out["a_ttft_s"] = m.ttft
    out["a_decode_tok_s"] = (m.num_generation_tokens - 1) / (m.finished_time - m.first_token_time)
    results, elapsed = run(random_prompts(args.num_prompts, 128, vocab, seed=3), 128)
    out["b_output_tok_s"] = sum(len(r.outputs[0].token_ids) for r in results) / elapsed
    out["b_elapsed_s"] = elapsed
    out["b_matmul_floor_s"] = matmul_floor(engine, args.num_prompts, 128, 128)
    return out


def matmul_floor(engine: LLMEngine, num_prompts: int, prompt_len: int, output_len: int) -> float:
    """Seconds the workload's matmuls take alone, each shape timed (best of 3) with the engine's
    own layers: prefill in steps of max_num_batched_tokens rows, then output_len - 1 decode
    steps of num_prompts rows; the head runs once per generated token."""
    model = engine.executor.worker.model
    head = model.output_head()  # a Linear, or the tied embedding (gemma)
    fused = [m for m in model.modules() if isinstance(m, FusedLinear)]
    parts = {id(p) for m in fused for p in m.parts.values()}  # computed by their fused layer
    layers = fused + [
        m for m in model.modules() if isinstance(m, Linear) and m is not head and id(m) not in parts
    ]

    def best_of_3(fn) -> float:
        times = []
        for _ in range(3):
            start = time.perf_counter()
            with torch.no_grad():
                fn()
            times.append(time.perf_counter() - start)
        return min(times)

    def layers_time(rows: int) -> float:
        xs = [torch.randn(rows, m.in_features) for m in layers]
        return best_of_3(lambda: [m(x) for m, x in zip(layers, xs)])

    hidden = torch.randn(num_prompts, engine.config.model_config.hidden_size)
    head = best_of_3(lambda: model.compute_logits(hidden))
    step = engine.config.scheduler_config.max_num_batched_tokens
    prefill = num_prompts * prompt_len / step * layers_time(step)
    decode = (output_len - 1) * layers_time(num_prompts)
    return prefill + decode + output_len * head


def transformers_runs(args: argparse.Namespace, vocab: int) -> dict:
    from transformers import AutoModelForCausalLM

    from tokenmill.resolve import resolve_model

    path = resolve_model(args.model).path
    dtype = getattr(torch, args.hf_dtype)
    model = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=dtype
    ).eval()
    out: dict = {}

    def gen(prompts, max_new):
        ids = torch.tensor(prompts)
        with torch.no_grad():
            start = time.monotonic()
            model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=max_new,
                min_new_tokens=max_new,
                do_sample=False,
                pad_token_id=0,
            )
            return time.monotonic() - start

    gen(random_prompts(1, 32, vocab, seed=9), 4)
    prompt = random_prompts(1, args.input_len, vocab, seed=1)
    ttft = gen(prompt, 1)
    total = gen(prompt, args.output_len)
    out["a_ttft_s"] = ttft
    out["a_decode_tok_s"] = (args.output_len - 1) / (total - ttft)
    elapsed = gen(random_prompts(args.num_prompts, 128, vocab, seed=3), 128)
    out["b_output_tok_s"] = args.num_prompts * 128 / elapsed
    out["b_elapsed_s"] = elapsed
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="gemma-3-270m")
    parser.add_argument("--tm-dtype", default="float32")
    parser.add_argument("--hf-dtype", default="float32")
    parser.add_argument("--input-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--skip-hf", action="store_true")
    args = parser.parse_args()
    tm = tokenmill_runs(args)
    print("tokenmill", json.dumps(tm), flush=True)
    if args.skip_hf:
        return
    hf = transformers_runs(args, vocab=tm["vocab_size"])
    print("transformers", json.dumps(hf), flush=True)
    print(
        f"ratios tokenmill/transformers: batch-1 decode {tm['a_decode_tok_s'] / hf['a_decode_tok_s']:.2f}x, "
        f"TTFT(512) {hf['a_ttft_s'] / tm['a_ttft_s']:.2f}x faster, "
        f"throughput(64x128/128) {tm['b_output_tok_s'] / hf['b_output_tok_s']:.2f}x; "
        f"4x needs (b) in {hf['b_elapsed_s'] / 4:.1f} s: tokenmill took {tm['b_elapsed_s']:.1f} s, "
        f"its matmuls alone {tm['b_matmul_floor_s']:.1f} s"
    )


if __name__ == "__main__":
    main()
