"""Perplexity of a model over a text, measured through the engine's prompt log-probs.

The text is tokenized once and cut into windows; each window is one request (BOS, if the model
has one, then the window's tokens) with ``SamplingParams(prompt_logprobs=0, max_tokens=1)``, and
the log-probs of its tokens not scored by an earlier window are summed::

    tokens     | t0 ................................................. tN |
    window 0   [BOS t0 ...... t1022]                      scores t0 .. t1022
    window 1         [BOS t511 ...... t1533]              scores t1023 .. t1533 (stride 512)

Windows overlap by ``window - stride`` text tokens. With the default stride (= window) they do
not overlap and every token is scored once, the first of each window given only BOS; an overlap
gives the later windows' new tokens more context. A model without BOS cannot score a window's
first token, so that token is context only.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tokenmill.sampling_params import SamplingParams

if TYPE_CHECKING:
    from tokenmill.entrypoints.llm import LLM


@dataclass(frozen=True, slots=True)
class Window:
    """Text tokens ``start .. end`` are fed; those from ``score_from`` on are scored."""

    start: int
    end: int
    score_from: int


@dataclass(frozen=True, slots=True)
class PerplexityResult:
    num_tokens: int  # tokens scored
    total_nll: float  # sum of -log p over them, in nats
    num_windows: int
    seconds: float  # engine time for all windows (model loading excluded)

    @property
    def mean_nll(self) -> float:
        return self.total_nll / self.num_tokens

    @property
    def perplexity(self) -> float:
        return math.exp(self.mean_nll)


def make_windows(
    num_tokens: int,
    window: int,
    stride: int | None = None,
    max_tokens_total: int | None = None,
    min_context: int = 0,
) -> list[Window]:
    """Windows of ``window`` tokens every ``stride`` tokens; each token is scored at most once.

    ``min_context`` tokens at the start of each window are never scored (1 for a model without
    BOS: nothing predicts a window's first token). ``max_tokens_total`` caps the tokens scored.
    """
    stride = window if stride is None else stride
    if window <= min_context:
        raise ValueError(f"window must be > {min_context}; got {window}")
    if not 1 <= stride <= window:
        raise ValueError(f"stride must be in [1, window ({window})]; got {stride}")
    if max_tokens_total is not None and max_tokens_total < 1:
        raise ValueError(f"max_tokens_total must be >= 1; got {max_tokens_total}")
    budget = max_tokens_total if max_tokens_total is not None else num_tokens
    windows: list[Window] = []
    scored_to = 0
    start = 0
    while budget > 0:
        score_from = max(start + min_context, scored_to)
        end = min(start + window, num_tokens, score_from + budget)
        if end > score_from:
            windows.append(Window(start, end, score_from))
            budget -= end - score_from
            scored_to = end
        if start + window >= num_tokens:
            break
        start += stride
    return windows


def measure_perplexity(
    llm: LLM,
    text: str,
    window: int = 1024,
    stride: int | None = None,
    max_tokens_total: int | None = None,
) -> PerplexityResult:
    """Perplexity of ``llm``'s model over ``text``.

    ``window`` counts the tokens of one request (BOS included); consecutive windows overlap by
    ``window - stride`` tokens (default stride: ``window``, no overlap). ``max_tokens_total``
    caps the tokens scored.
    """
    tokenizer = llm.tokenizer
    token_ids = tokenizer.encode(text, add_special_tokens=False)
    prefix = [tokenizer.bos_token_id] if tokenizer.add_bos else []
    stride = window if stride is None else stride
    if not len(prefix) < stride <= window:
        raise ValueError(f"stride must be in [{len(prefix) + 1}, window ({window})]; got {stride}")
    windows = make_windows(
        len(token_ids),
        window - len(prefix),  # text tokens per window
        stride - len(prefix),
        max_tokens_total,
        min_context=0 if prefix else 1,
    )
    if not windows:
        raise ValueError("the text is too short to score any token")
    prompts = [prefix + token_ids[w.start : w.end] for w in windows]
    params = SamplingParams(prompt_logprobs=0, max_tokens=1, temperature=0.0)
    started = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - started
    total_nll = 0.0
    num_scored = 0
    for w, out in zip(windows, outputs):
        entries = out.prompt_logprobs
        assert entries is not None and len(entries) == len(prefix) + w.end - w.start
        for pos in range(w.score_from, w.end):
            entry = entries[len(prefix) + pos - w.start]
            assert entry is not None and entry.sampled.token_id == token_ids[pos]
            total_nll -= entry.sampled.logprob
            num_scored += 1
    return PerplexityResult(num_scored, total_nll, len(windows), seconds)
