"""N-gram proposals (prompt lookup decoding, Saxena 2023): the request's last n tokens are
looked up in its own earlier tokens, and what followed the latest match is proposed.

Longer n first (a longer match predicts better), down to ``ngram_min``. Output that repeats or
edits its prompt (code edits, quotes, summaries with names) is where this pays.
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from tokenmill.spec.base import Draft, DraftRequest, Proposer

# Tokens of context searched, the most recent: a step's lookup stays ~O(this) on long contexts.
MAX_LOOKUP_TOKENS = 4096


class NgramProposer(Proposer):
    def __init__(self, num_tokens: int, ngram_min: int = 2, ngram_max: int = 4) -> None:
        if not 1 <= ngram_min <= ngram_max:
            raise ValueError(f"need 1 <= ngram_min <= ngram_max; got {ngram_min}, {ngram_max}")
        self.num_tokens = num_tokens
        self.ngram_min = ngram_min
        self.ngram_max = ngram_max

    def propose(self, reqs: list[DraftRequest]) -> dict[str, Draft]:
        drafts = {r.req_id: self.propose_tokens(r.token_ids) for r in reqs}
        return {rid: Draft(tokens) for rid, tokens in drafts.items() if tokens}

    def propose_tokens(self, token_ids: list[int]) -> list[int]:
        """What followed the latest earlier occurrence of the longest matching suffix."""
        context = np.asarray(token_ids[-MAX_LOOKUP_TOKENS:], dtype=np.int64)
        for n in range(min(self.ngram_max, len(context) - 1), self.ngram_min - 1, -1):
            suffix = context[-n:]
            # Windows that end before the suffix itself starts: an earlier occurrence.
            windows = sliding_window_view(context[:-1], n)
            hits = np.flatnonzero((windows == suffix).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n  # what followed the latest occurrence
                return context[start : start + self.num_tokens].tolist()
        return []
