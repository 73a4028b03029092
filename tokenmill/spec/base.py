"""Proposer: guesses the next tokens of requests, for the target model to verify.

The runner asks once a step, for every request it just sampled for (in steps small enough to
speculate), and tells the proposer when a request leaves (``finish``)::

    step t:   sample -> propose(reqs) -> Draft per request -> scheduler -> step t + 1 verifies
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from tokenmill.sampling_params import SamplingParams


@dataclass(slots=True)
class DraftRequest:
    """What a proposer sees of one request."""

    req_id: str
    token_ids: list[int]  # prompt + outputs known so far
    num_prompt_tokens: int
    sampling_params: SamplingParams
    generator: torch.Generator | None  # the request's own (seeded), else None


@dataclass(slots=True)
class Draft:
    """Proposed next tokens of one request."""

    token_ids: list[int]
    # The distribution each token was drawn from ([len(token_ids), vocab] probabilities), which
    # verification needs for rejection sampling; None for a deterministic proposal (a one-hot
    # draft distribution, for which sampling the target and keeping equal tokens is the rule).
    probs: torch.Tensor | None = None


class Proposer(ABC):
    """Base class of draft-token proposers (one instance serves every request)."""

    num_tokens: int  # most draft tokens proposed a step

    @abstractmethod
    def propose(self, reqs: list[DraftRequest]) -> dict[str, Draft]:
        """Up to ``num_tokens`` guesses of what follows each request's tokens; requests with
        no guess are left out."""

    def finish(self, req_id: str, output_token_ids: list[int] | None) -> None:  # noqa: B027
        """``req_id`` left the batch: finished (or aborted) with these output tokens, or
        preempted (None: it comes back later). Stateless proposers ignore it."""
