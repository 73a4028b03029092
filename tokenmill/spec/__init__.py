"""Speculative decoding: proposers of draft tokens. Verification is the worker's
(worker/model_runner.py ``accept_drafts``), scheduling the scheduler's (core/scheduler.py)."""

from __future__ import annotations

from tokenmill.spec.base import Draft, DraftRequest, Proposer
from tokenmill.spec.ngram import NgramProposer
from tokenmill.spec.suffix import SuffixProposer

__all__ = [
    "Draft",
    "DraftRequest",
    "NgramProposer",
    "Proposer",
    "SuffixProposer",
    "create_proposer",
]


def create_proposer(
    method: str, num_tokens: int, ngram_min: int = 2, ngram_max: int = 4
) -> Proposer:
    if method == "ngram":
        return NgramProposer(num_tokens, ngram_min, ngram_max)
    if method == "suffix":
        return SuffixProposer(num_tokens)
    raise ValueError(f"speculative_method must be ngram or suffix; got {method!r}")
