"""Synthetic prompts of exact token lengths, the same for every engine that is compared, and
a loop that runs a batch of them to the end (for benchmarks/; the CLI's datasets, random ones
included, are bench/datasets.py)."""

from __future__ import annotations

import random
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tokenmill.engine import LLMEngine


def random_prompts(
    num_prompts: int, input_len: int, vocab_size: int, seed: int = 0
) -> list[list[int]]:
    """Token-id prompts drawn from the middle of the vocabulary (no special tokens there)."""
    from tokenmill.bench.datasets import vocab_middle

    rng = random.Random(seed)
    lo, hi = vocab_middle(vocab_size)
    return [[rng.randrange(lo, hi) for _ in range(input_len)] for _ in range(num_prompts)]


def run_to_completion(engine: LLMEngine, prompts: list[list[int]], max_tokens: int) -> list:
    """Greedy, ``max_tokens`` each (EOS ignored), all queued at once; the finished requests'
    metrics in completion order."""
    from tokenmill.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for prompt in prompts:
        engine.add_request(prompt, params)
    metrics = []
    while engine.has_unfinished_requests():
        metrics += [out.metrics for out in engine.step() if out.finished]
    return metrics
