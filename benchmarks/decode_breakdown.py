"""Where a batch-1 decode step spends its time, part by part (gemma-3-270m, or --model).

Decodes 64 tokens after a 128-token prompt, twice:
- eagerly (--enforce-eager's path), with the engine's parts wrapped in timers (wall clock, so
  nested parts are included in their parents): Python dispatch shows as the gap between a
  part and the kernels inside it;
- as the engine runs by default, where decode steps of up to 128 requests replay a recorded graph
  of C kernels (worker/decode_graph.py): the graph is then replayed with per-kernel timing.

    python benchmarks/decode_breakdown.py [--quantization none|int8|int4] [--batch 1]
        [--packed-activations int8|float32]
"""

from __future__ import annotations

import argparse
import collections
import functools
import time
from collections.abc import Callable

import torch

from tokenmill import LLM, SamplingParams
from tokenmill.attention import layer as attention_layer
from tokenmill.kernels import cpu_library
from tokenmill.layers import linear, norm, rotary
from tokenmill.models import llama

_ACTIVE: set[str] = set()


def _timed(owner: object, name: str, key: str, acc: dict[str, float]) -> None:
    """Time ``owner.name`` into ``acc[key]``; a call inside another of the same key (a fused
    layer's part computed by its own Linear) counts once."""
    fn: Callable = getattr(owner, name)

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if key in _ACTIVE:
            return fn(*args, **kwargs)
        _ACTIVE.add(key)
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            acc[key] += time.perf_counter() - start
            _ACTIVE.discard(key)

    setattr(owner, name, wrapper)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument(
        "--model",
        default="gemma-3-270m",
        help="alias or .gguf (e.g. a file of benchmarks/llama_shapes.py)",
    )
    parser.add_argument("--quantization", default=None)
    parser.add_argument("--packed-activations", default="int8", help="int8 or float32")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--graphed-only", action="store_true", help="skip the eager run")
    args = parser.parse_args()
    eager_step = None if args.graphed_only else run_eager(args)
    graph_step = run_graphed(args)
    if eager_step is not None:
        print(f"decode step: eager {eager_step * 1e3:.2f} ms, graphed {graph_step * 1e3:.2f} ms")


def _engine(args: argparse.Namespace, enforce_eager: bool) -> LLM:
    return LLM(
        args.model,
        max_model_len=1024,
        kv_cache_memory="512MiB",
        quantization=args.quantization,
        packed_activations=args.packed_activations,
        enforce_eager=enforce_eager,
    )


def _decode(llm: LLM, args: argparse.Namespace, before_decode: Callable[[], None]) -> float:
    """Seconds per decode step of ``args.batch`` requests (prefill not counted)."""
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=args.steps + 1, ignore_eos=True)
    prompts = [list(range(1000 + 7 * i, 1128 + 7 * i)) for i in range(args.batch)]
    llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)
    for p in prompts:
        engine.add_request(p, params)
    while engine.scheduler.waiting or any(
        r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.running
    ):
        engine.step()  # prefill
    before_decode()
    start, steps = time.perf_counter(), 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
    return (time.perf_counter() - start) / steps


def run_eager(args: argparse.Namespace) -> float:
    llm = _engine(args, enforce_eager=True)
    engine, acc = llm.engine, collections.defaultdict(float)
    model = engine.executor.worker.model
    parts = [
        (engine.scheduler, "schedule", "scheduler"),
        (engine.executor.worker.runner, "prepare_step", "prepare inputs"),
        (type(model), "forward", "model forward (layers)"),
        (norm.RMSNorm, "forward", "  RMSNorms"),
        (linear.Linear, "forward", "  linear layers (matmuls)"),
        (linear.FusedLinear, "forward", "  linear layers (matmuls)"),
        (linear.FusedLinear, "forward_fused", "  linear layers (matmuls)"),
        (rotary.RotaryEmbedding, "forward", "  RoPE"),
        (attention_layer.Attention, "forward", "  paged attention"),
        (llama.LlamaMLP, "forward", "  MLP block (incl. its matmuls)"),
        (model, "compute_logits", "output head (logits)"),
        (engine.executor.worker.runner, "sampler", "sampler"),
        (engine.output_processor, "process", "detokenize + outputs"),
    ]
    for owner, name, key in parts:
        _timed(owner, name, key, acc)
    steps = args.steps
    total = _decode(llm, args, acc.clear)
    print(
        f"eager: batch {args.batch}, quantization {engine.config.quantization}, C kernels "
        f"{'on' if cpu_library.available() else 'off'}: {total * 1e3:.2f} ms/step, "
        f"{args.batch / total:.1f} tokens/s"
    )
    for _, _, key in parts:
        print(f"  {key:34s} {acc[key] / steps * 1e3:7.2f} ms/step")
    for owner, name, _ in parts:  # unwrap: the graphed run must not see the timers
        if name in vars(owner) and not isinstance(owner, type):
            delattr(owner, name)
        elif isinstance(owner, type):
            setattr(owner, name, getattr(owner, name).__wrapped__)
    return total


def run_graphed(args: argparse.Namespace) -> float:
    llm = _engine(args, enforce_eager=False)
    graphs = llm.engine.executor.worker.runner.decode_graphs
    total = _decode(llm, args, lambda: None)
    print(f"graphed: batch {args.batch}: {total * 1e3:.2f} ms/step, {args.batch / total:.1f} tok/s")
    if graphs is None or args.batch not in graphs.captured_sizes():
        print("  (no graph for this batch size: its steps ran eagerly)")
        return total
    graph = graphs.graph(args.batch)
    times = torch.zeros(len(graph), dtype=torch.float64)
    per_op = torch.zeros_like(times)
    reps = 20
    for _ in range(reps):  # the last step's inputs again: same K/V into the same slot
        graph.replay(times)
        per_op += times
    by_kind: dict[str, float] = collections.defaultdict(float)
    for name, t in zip(graph.op_names(), per_op.tolist()):
        if name == f"matmul N={llm.engine.config.model_config.vocab_size}":
            name = "output head (matmul)"
        elif name.startswith("matmul"):
            by_kind["layer matmuls"] += t / reps
        by_kind[name] += t / reps  # each matmul shape apart too
    replay = per_op.sum().item() / reps
    print(f"  {'graph replay, all kernels':34s} {replay * 1e3:7.2f} ms/step ({len(graph)} calls)")
    for name, t in sorted(by_kind.items(), key=lambda kv: -kv[1]):
        indent = "      " if name.startswith("matmul") else "    "  # within "layer matmuls"
        print(f"{indent}{name:32s} {t * 1e3:7.2f} ms/step")
    print(f"  {'scheduler, sampler, outputs':34s} {(total - replay) * 1e3:7.2f} ms/step")
    return total


if __name__ == "__main__":
    main()
