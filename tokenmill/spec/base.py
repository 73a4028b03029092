"""Proposer: guesses the next tokens of a request, for the target model to verify."""

from __future__ import annotations

from abc import ABC, abstractmethod


class Proposer(ABC):
    """Base class of draft-token proposers (one instance serves every request)."""

    num_tokens: int  # most draft tokens proposed a step

    @abstractmethod
    def propose(self, token_ids: list[int]) -> list[int]:
        """Up to ``num_tokens`` guesses of what follows ``token_ids`` (prompt + outputs); an
        empty list when it has none. Deterministic proposals (a one-hot draft distribution)
        make exact-match acceptance the rejection-sampling rule."""
