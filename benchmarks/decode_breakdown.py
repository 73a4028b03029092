"""Where a batch-1 decode step of gemma-3-270m spends its time, part by part.

Wraps the engine's parts with timers (wall clock, so nested parts are included in their parents)
and decodes 64 tokens after a 128-token prompt:

    python benchmarks/decode_breakdown.py [--quantization none|int8|int4] [--batch 1]
"""

from __future__ import annotations

import argparse
import collections
import time
from collections.abc import Callable

from tokenmill import LLM, SamplingParams, kernels
from tokenmill.attention import layer as attention_layer
from tokenmill.layers import linear, norm, rotary
from tokenmill.models import llama


def _timed(owner: object, name: str, key: str, acc: dict[str, float]) -> None:
    fn: Callable = getattr(owner, name)

    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            acc[key] += time.perf_counter() - start

    setattr(owner, name, wrapper)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quantization", default=None)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--steps", type=int, default=64)
    args = parser.parse_args()
    llm = LLM(
        "gemma-3-270m", max_model_len=1024, kv_cache_memory="512MiB", quantization=args.quantization
    )
    engine, acc = llm.engine, collections.defaultdict(float)
    model = engine.runner.model
    parts = [
        (engine.scheduler, "schedule", "scheduler"),
        (engine.runner, "_prepare", "prepare inputs"),
        (type(model), "forward", "model forward (layers)"),
        (norm.RMSNorm, "forward", "  RMSNorms"),
        (linear.Linear, "forward", "  linear layers (matmuls)"),
        (rotary.RotaryEmbedding, "forward", "  RoPE"),
        (attention_layer.Attention, "forward", "  paged attention"),
        (llama.LlamaMLP, "forward", "  MLP block (incl. its matmuls)"),
        (model, "compute_logits", "output head (logits)"),
        (engine.runner, "sampler", "sampler"),
        (engine.output_processor, "process", "detokenize + outputs"),
    ]
    for owner, name, key in parts:
        _timed(owner, name, key, acc)
    params = SamplingParams(temperature=0.0, max_tokens=args.steps + 1, ignore_eos=True)
    prompts = [list(range(1000 + 7 * i, 1128 + 7 * i)) for i in range(args.batch)]
    llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)
    for p in prompts:
        engine.add_request(p, params)
    while engine.scheduler.waiting or any(
        r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.running
    ):
        engine.step()  # prefill
    acc.clear()
    start, steps = time.perf_counter(), 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
    total = (time.perf_counter() - start) / steps
    print(
        f"batch {args.batch}, quantization {engine.config.quantization}, C kernels "
        f"{'on' if kernels.available() else 'off'}: {total * 1e3:.2f} ms/step, "
        f"{args.batch / total:.1f} tokens/s"
    )
    for _, _, key in parts:
        print(f"  {key:34s} {acc[key] / steps * 1e3:7.2f} ms/step")


if __name__ == "__main__":
    main()
