"""The engine's host work per decode step with many requests: what bounds a batch-256 step on a
GPU, where the device's share is ~1.6 ms (issue 24).

Three parts, each timed per step over --steps steps (the median from the 100th on):
- the scheduler: ``schedule()`` then ``update_from_output()`` with one token per request, over
  gemma-3-270m's KV layout (kv_layout.py: a full-attention group and five window groups);
- the output side: ``OutputProcessor.process()`` then ``collect()`` with the embedded
  gemma-3-270m's tokenizer (incremental detokenizing, RequestOutputs);
- a whole engine step (``LLMEngine.step``), on the CUDA-graph runner's path run eagerly on
  the CPU, with a tiny random gemma-3 (six layers: the same six KV groups, a 384-token
  vocabulary) so the model costs little; the device's work on a GPU (the forward, the graph's
  replay, and the greedy pick) is timed apart and taken off. Its tokenizer's 381 ordinary
  tokens are words, so that its random picks detokenize as a real model's text does
  (``word_tokenizer``; bytes picked at random would be invalid UTF-8 nearly half the time, a
  path real text rarely takes). What is left is everything a GPU step's host does:
  scheduling, the graph's inputs, sampling bookkeeping (the picks themselves are device work
  there), detokenizing and outputs.

Every part runs with the garbage collector as ``tokenmill serve`` sets it after load
(memory.settle_heap).

``--layout llama`` takes Llama's KV layout instead of gemma-3's (one group, every layer
attending to every token: Llama-3.1-8B's, gpu_check.py's 8B shape) for the scheduler and the
engine step (a tiny random Llama of the same size). Each KV group is one more block table a
request keeps, so gemma-3's six cost the scheduler more.

``--forward none`` leaves the forward out of the timed steps instead (after the first steps,
whose logits stay in the buffer the sampler reads): the host's work in the caches it would
have beside a GPU, where the forward runs on the device. On a CPU the eager forward over
hundreds of rows evicts the host's data between steps, which the first figure includes.
``--forward flush`` puts one read of FLUSH_BYTES in the forward's place, on the engine's
thread: that eviction alone, without the forward's other work. What the host share grows by
then is what a CPU step pays for the memory its forward streams, not host work of its own.

The core's share is the part of it in ``EngineCore.step`` (schedule, the runner, the
scheduler's update): the engine step less its output side, what the core takes a step where
that side is elsewhere (EngineArgs.core_process; server_host.py --core-process times it there).

``--phases`` adds where an engine step's host share goes: each phase's method timed in every
step (the runner's inputs less the forward inside them), median ms; "rest" is the host share
less their sum (the engine's own calls, the timers themselves).

    .venv/bin/python benchmarks/host_step.py [--requests 256] [--steps 400] [--kinds ...]
        [--forward cpu|none|flush] [--layout gemma-3|llama] [--phases]
"""

from __future__ import annotations

import argparse
import contextlib
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from gpu_check import build_synthetic_gemma  # noqa: E402

from tokenmill.config import CacheConfig, ModelConfig, SchedulerConfig
from tokenmill.core import RunnerOutput, Scheduler
from tokenmill.core.sched_output import RequestUpdate
from tokenmill.engine import LLMEngine
from tokenmill.engine.output_processor import OutputProcessor
from tokenmill.kernels.torch_backend import TorchKernelBackend
from tokenmill.kv_layout import KVLayout, plan_kv_layout
from tokenmill.memory import settle_heap
from tokenmill.models.loader import load_model_config
from tokenmill.request import Request
from tokenmill.resolve import resolve_model
from tokenmill.sampling_params import SamplingParams
from tokenmill.tokenizer import load_tokenizer
from tokenmill.tokenizer.byte_level import write_byte_tokenizer
from tokenmill.worker import worker
from tokenmill.worker.cuda_graph import CudaDecodeGraphs
from tokenmill.worker.model_runner import ModelRunner

# What --forward flush reads in each forward's place: more than a core's caches hold, so the
# host's data is evicted as a forward's streaming evicts it (the toy's eager forward streams
# far more: its K/V over hundreds of rows).
FLUSH_BYTES = 128 << 20

# An engine step's phases (--phases): name, then the method whose calls are its time.
PHASES = (
    ("schedule", Scheduler, "schedule"),
    ("runner inputs", ModelRunner, "_decode_graph_step"),  # less the forward it runs
    ("sampling", ModelRunner, "_sample"),
    ("update_from_output", Scheduler, "update_from_output"),
    ("outputs: process", OutputProcessor, "process"),
    ("outputs: collect", OutputProcessor, "collect"),
)


@dataclass
class StepTimes:
    """Median ms of an engine's timed steps: the host share, the whole step, the core's host
    share, and with phases asked for, each phase's."""

    host: float
    whole: float
    core: float
    phases: dict[str, float] = field(default_factory=dict)


@contextlib.contextmanager
def timed_phases(step_times: dict[str, float]) -> Iterator[None]:
    """Every PHASES method adds its calls' seconds to ``step_times[name]`` while inside."""
    originals = [(cls, attr, getattr(cls, attr)) for _, cls, attr in PHASES]

    def timed(name: str, method: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                step_times[name] = step_times.get(name, 0.0) + time.perf_counter() - start

        return call

    for (name, _, _), (cls, attr, method) in zip(PHASES, originals, strict=True):
        setattr(cls, attr, timed(name, method))
    try:
        yield
    finally:
        for cls, attr, method in originals:
            setattr(cls, attr, method)


def word_tokenizer(model_dir: Path, vocab_size: int) -> None:
    """Replace ``model_dir``'s tokenizer with a byte-level one whose ids past <pad> <s> </s>
    are words with their leading space (" the", " hand", ...), as most of a model's output
    tokens are."""
    from tokenizers import Tokenizer, decoders, models

    # fmt: off
    stems = [
        "the", "of", "and", "to", "in", "is", "was", "for", "on", "that", "with", "as", "by",
        "at", "from", "his", "her", "they", "this", "are", "be", "had", "not", "have", "one",
        "all", "were", "but", "can", "time", "when", "would", "there", "so", "more", "than",
        "some", "what", "about", "into", "only", "other", "new", "make", "over", "also", "back",
        "after", "use", "two", "how", "work", "first", "well", "way", "even", "want", "because",
        "any", "these", "give", "day", "most", "us", "hand", "eye",
    ]
    # fmt: on
    words = [f"\u0120{s}{end}" for end in ("", "s", "ed", "ing", "er", "ly") for s in stems]
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2}
    for word in words:
        if len(vocab) < vocab_size:
            vocab.setdefault(word, len(vocab))
    assert len(vocab) == vocab_size, "more words are needed for this vocabulary"
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<pad>", "<s>", "</s>"])
    tok.save(str(model_dir / "tokenizer.json"))


def scheduler_ms(layout: KVLayout, num_requests: int, steps: int) -> float:
    cache = CacheConfig(
        block_size=16, enable_prefix_caching=True, num_blocks=200_000, kv_layout=layout
    )
    sched = Scheduler(SchedulerConfig(num_requests, 2048, 4096), cache)
    params = SamplingParams(temperature=0.0, max_tokens=steps + 64, ignore_eos=True)
    for i in range(num_requests):
        sched.add_request(Request(f"r{i}", [(7 * i + j) % 250 + 3 for j in range(128)], params))
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        out = sched.schedule()
        tokens = {rid: [5] for rid in out.num_scheduled_tokens}
        sched.update_from_output(out, RunnerOutput(tokens))
        times.append(time.perf_counter() - start)
    return statistics.median(times[100:]) * 1e3


def outputs_ms(config: ModelConfig, num_requests: int, steps: int, kind: str) -> float:
    assert config.source is not None
    processor = OutputProcessor(load_tokenizer(config.source.path, config.architecture))
    params = SamplingParams(temperature=0.0, max_tokens=steps + 64, output_kind=kind)
    reqs = [Request(f"r{i}", [2, 100 + i, 200 + i], params) for i in range(num_requests)]
    for req in reqs:
        processor.add_request(req.req_id, None, [req], params)
    rng = random.Random(0)
    times = []
    for _ in range(steps):
        updates = []
        for req in reqs:
            token = rng.randrange(1000, 20000)
            req.output_token_ids.append(token)
            updates.append(RequestUpdate(req.req_id, [token]))
        start = time.perf_counter()
        processor.process(updates)
        processor.collect()
        times.append(time.perf_counter() - start)
    return statistics.median(times[100:]) * 1e3


def build_toy(path: Path, layout: str) -> str:
    """The engine step's model at toy size (six layers, 64 wide, a 384-token vocabulary), of
    gemma-3's KV layout (five sliding-window layers to one global: six KV groups) or Llama's
    (one group)."""
    toy = dict(vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
               num_attention_heads=4, num_key_value_heads=2, head_dim=16,
               max_position_embeddings=4096)  # fmt: skip
    if layout == "gemma-3":
        return build_synthetic_gemma(path, **toy, sliding_window=24, query_pre_attn_scalar=16)
    import torch
    import transformers as tf

    config = tf.LlamaConfig(**toy, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    tf.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(path)
    write_byte_tokenizer(path, config.vocab_size)
    return str(path)


def engine_host_ms(
    num_requests: int,
    steps: int,
    kind: str = "cumulative",
    forward: str = "cpu",
    phases: bool = False,
    layout: str = "gemma-3",
) -> StepTimes:
    """An engine's decode steps at ``num_requests`` whose outputs are of ``kind``
    (SamplingParams.output_kind); ``forward``: "cpu" (run and timed apart), "none" (left out
    once the prompts ran) or "flush" (a read of FLUSH_BYTES in its place); ``phases``: time
    each of PHASES too; ``layout``: the toy model's (build_toy)."""
    # The CUDA-graph runner on the CPU: its buffers and inputs as on a GPU, the forward eager.
    worker.cuda_graphs_supported = lambda device: True
    # The device's work on a GPU, timed apart: the forward and the greedy pick.
    forward_s: list[float] = []
    pick_s: list[float] = []
    replay, argmax = CudaDecodeGraphs.replay, TorchKernelBackend.argmax
    run_forward = [True]
    # numpy's sum reads it on one thread, the engine's: the caches its host work runs in.
    flush = np.ones(FLUSH_BYTES // 4, np.float32) if forward == "flush" else None

    def timed_replay(graphs: CudaDecodeGraphs, b: int) -> None:
        start = time.perf_counter()
        if run_forward[0]:
            replay(graphs, b)
        elif flush is not None:
            flush.sum()
        forward_s.append(time.perf_counter() - start)

    def timed_argmax(kernels: TorchKernelBackend, x: Any) -> Any:
        start = time.perf_counter()
        try:
            return argmax(kernels, x)
        finally:
            pick_s.append(time.perf_counter() - start)

    CudaDecodeGraphs.replay = timed_replay  # type: ignore[method-assign]
    TorchKernelBackend.argmax = timed_argmax  # type: ignore[method-assign]
    with tempfile.TemporaryDirectory() as tmp:
        model = build_toy(Path(tmp), layout)
        word_tokenizer(Path(tmp), 384)
        engine = LLMEngine.from_args(
            model=model,
            dtype="float32",
            kernel_backend="torch",
            max_model_len=1024,
            max_num_seqs=num_requests,
            max_num_batched_tokens=8192,
        )
    settle_heap()
    params = SamplingParams(
        temperature=0.0, max_tokens=steps + 64, ignore_eos=True, output_kind=kind
    )
    rng = random.Random(0)
    for _ in range(num_requests):
        engine.add_request([1] + [rng.randrange(3, 259) for _ in range(100)], params)
    while engine.stats().num_waiting:
        engine.step()
    engine.step()  # a decode step: the graph path's logits buffer is made
    run_forward[0] = forward == "cpu"
    host, whole = [], []
    per_phase: dict[str, list[float]] = {name: [] for name, _, _ in PHASES}
    step_times: dict[str, float] = {}
    core_step = engine.core.step
    core_s: list[float] = []

    def timed_core_step() -> list[RequestUpdate]:
        start = time.perf_counter()
        updates = core_step()
        core_s.append(time.perf_counter() - start - sum(forward_s) - sum(pick_s))
        return updates

    engine.core.step = timed_core_step  # type: ignore[method-assign]
    with timed_phases(step_times) if phases else contextlib.nullcontext():
        for _ in range(steps):
            forward_s.clear()
            pick_s.clear()
            step_times.clear()
            start = time.perf_counter()
            engine.step()
            elapsed = time.perf_counter() - start
            whole.append(elapsed)
            host.append(elapsed - sum(forward_s) - sum(pick_s))
            if phases:
                step_times["runner inputs"] = step_times.get("runner inputs", 0) - sum(forward_s)
                step_times["sampling"] = step_times.get("sampling", 0) - sum(pick_s)
                for name, times in per_phase.items():
                    times.append(step_times.get(name, 0.0))
    engine.shutdown()
    CudaDecodeGraphs.replay = replay  # type: ignore[method-assign]
    TorchKernelBackend.argmax = argmax  # type: ignore[method-assign]
    result = StepTimes(*(statistics.median(t[100:]) * 1e3 for t in (host, whole, core_s)))
    if phases:
        result.phases = {name: statistics.median(t[100:]) * 1e3 for name, t in per_phase.items()}
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--kinds", default="cumulative,delta,final_only", help="output kinds")
    p.add_argument("--forward", default="cpu", choices=("cpu", "none", "flush"),
                   help="run the forward (timed apart), leave it out of the timed steps, or "
                   "read a buffer larger than the caches in its place")  # fmt: skip
    p.add_argument("--layout", default="gemma-3", choices=("gemma-3", "llama"),
                   help="the KV layout: gemma-3's six groups, or Llama's one")  # fmt: skip
    p.add_argument("--phases", action="store_true", help="where an engine step's host share goes")
    ns = p.parse_args()
    if ns.steps <= 100:
        p.error("--steps must be over 100 (the first 100 are a warm-up)")
    settle_heap()
    config = load_model_config(resolve_model("gemma-3-270m"))
    windows = config.layer_windows if ns.layout == "gemma-3" else [None] * 32
    layout = plan_kv_layout(windows, 4096, True)
    print(f"{ns.requests} requests, {ns.layout}'s KV layout ({layout.num_groups} groups), "
          "median ms a step:")  # fmt: skip
    print(f"  schedule + update_from_output: {scheduler_ms(layout, ns.requests, ns.steps):.2f}")
    # Output kinds: cumulative (a client that reads the whole text each step), delta (a
    # streaming client: the server's SSE), final_only (a response sent whole: the server's
    # non-streaming requests, LLM.generate).
    for kind in ns.kinds.split(","):
        print(f"  [{kind}] output processing (process + collect): "
              f"{outputs_ms(config, ns.requests, ns.steps, kind):.2f}")  # fmt: skip
        times = engine_host_ms(ns.requests, ns.steps, kind, ns.forward, ns.phases, ns.layout)
        what = {"cpu": "host share", "none": "host alone, no forward",
                "flush": "host share after a cache flush"}[ns.forward]  # fmt: skip
        print(f"  [{kind}] engine step, {what} (tiny {ns.layout}, CUDA-graph path): "
              f"{times.host:.2f} of {times.whole:.2f}; the core's step: {times.core:.2f}")  # fmt: skip
        if times.phases:
            rest = times.host - sum(times.phases.values())
            parts = [f"{name} {ms:.2f}" for name, ms in times.phases.items()]
            print(f"    {' | '.join(parts)} | rest {rest:.2f}")


if __name__ == "__main__":
    main()
