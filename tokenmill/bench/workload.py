"""Synthetic prompts of exact token lengths, the same for every engine that is compared."""

from __future__ import annotations

import random


def random_prompts(
    num_prompts: int, input_len: int, vocab_size: int, seed: int = 0
) -> list[list[int]]:
    """Token-id prompts drawn from the middle of the vocabulary (no special tokens there)."""
    rng = random.Random(seed)
    lo, hi = min(1000, vocab_size // 4), max(vocab_size - 1000, vocab_size * 3 // 4)
    return [[rng.randrange(lo, hi) for _ in range(input_len)] for _ in range(num_prompts)]
