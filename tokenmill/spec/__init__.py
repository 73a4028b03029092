"""Speculative decoding: proposers of draft tokens. Verification is the worker's
(worker/model_runner.py ``accept_drafts``), scheduling the scheduler's (core/scheduler.py)."""

from __future__ import annotations

from tokenmill.spec.base import Proposer
from tokenmill.spec.ngram import NgramProposer

__all__ = ["NgramProposer", "Proposer", "create_proposer"]


def create_proposer(
    method: str, num_tokens: int, ngram_min: int = 2, ngram_max: int = 4
) -> Proposer:
    if method == "ngram":
        return NgramProposer(num_tokens, ngram_min, ngram_max)
    raise ValueError(f"speculative_method must be ngram; got {method!r}")
