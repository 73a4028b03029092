"""Token bitmasks of constrained rows: filled from their grammar matchers, applied to logits.

A bitmask row is ceil(vocab / 32) int32 words; bit i of word w allows token 32 w + i (the
layout llguidance and xgrammar share). The sampler applies it to logits rows before anything
else, through its kernel backend (``KernelBackend.apply_token_bitmask_``: a C kernel, and its
torch twin), so greedy and random picks and every speculative row see only allowed tokens.
"""

from __future__ import annotations

import torch

from tokenmill.structured.compiler import GrammarMatcher


def allocate_bitmask(num_rows: int, vocab_size: int) -> torch.Tensor:
    """[num_rows, ceil(vocab / 32)] int32, every token allowed."""
    return torch.full((num_rows, -(-vocab_size // 32)), -1, dtype=torch.int32)


def allow_only(bitmask: torch.Tensor, row: int, token_id: int) -> None:
    """Row ``row`` allows ``token_id`` alone (a token the request must take)."""
    bitmask[row] = 0
    bitmask[row, token_id // 32] = _bit(token_id % 32)


def _bit(i: int) -> int:
    # bit 31 as an int32 word is negative
    return (1 << i) - (1 << 32 if i == 31 else 0)


def fill_row(bitmask: torch.Tensor, row: int, matcher: GrammarMatcher) -> None:
    words = bitmask[row]
    matcher.fill_bitmask(words.data_ptr(), words.numel() * words.element_size())
    refused = matcher.refused_tokens()
    if refused:  # a JSON number at its bound: no more digits, unless nothing else may follow
        kept = words.clone()
        ids = torch.tensor(refused, dtype=torch.int64)
        bits = torch.bitwise_left_shift(torch.ones_like(ids), ids % 32)
        clear = torch.zeros(words.numel(), dtype=torch.int64).index_add_(0, ids // 32, bits)
        kept &= ~_as_int32(clear)
        if bool(kept.any()):
            words.copy_(kept)


def _as_int32(words: torch.Tensor) -> torch.Tensor:
    """int64 words of 32 bits each as int32 (bit 31 the sign)."""
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
