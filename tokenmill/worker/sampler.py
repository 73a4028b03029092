"""Sampler: logit bias, penalties, temperature, top-k / top-p / min-p, then greedy or random picks.

Random picks are inverse-transform draws: one uniform u a row and the first token whose
cumulative probability exceeds u (a cumsum and a binary search, ~0.2 ms a 262k-token row, where
torch.multinomial or an exponential race over the vocabulary took ~3.7 ms). A request with a
seed draws its u from its own generator, so its tokens do not depend on what else is in the
batch.

A row that verifies a draft token drawn from a draft model's distribution q applies the
rejection-sampling rule of speculative decoding (Leviathan et al. 2023, Chen et al. 2023): keep
the draft d with probability min(1, p(d) / q(d)), else draw from max(0, p - q) normalized. The
kept token is then distributed exactly as p. A deterministic draft (one-hot q) needs no rule:
the row samples p as usual and the runner keeps the draft when they agree.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from tokenmill.core.sched_output import PromptLogprobs, SampledLogprobs
from tokenmill.kernels import KernelBackend
from tokenmill.kernels.torch_backend import TorchKernelBackend
from tokenmill.outputs import TokenLogprob
from tokenmill.sampling_params import SamplingParams


@dataclass(slots=True)
class SamplingRow:
    """One request to sample for in this step."""

    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    generator: torch.Generator | None
    eos_token_ids: tuple[int, ...]
    # The draft token this row verifies and the draft model's distribution it was drawn from
    # ([vocab] probabilities); None when there is none or the draft was deterministic.
    draft_token_id: int = -1
    draft_probs: torch.Tensor | None = None


class Sampler:
    """``kernels``: the backend whose argmax picks greedy tokens (the model's, so a C argmax
    runs where the model's kernels do: torch's CPU argmax is scalar, ~0.4 ms a row over a 262k
    vocabulary, a few % of a decode step); the torch backend when not given."""

    def __init__(
        self, device: torch.device, seed: int = 0, kernels: KernelBackend | None = None
    ) -> None:
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)
        self.kernels = kernels or TorchKernelBackend()

    def __call__(
        self,
        logits: torch.Tensor,
        rows: list[SamplingRow],
        bitmask: tuple[torch.Tensor, list[int]] | None = None,
    ) -> tuple[list[int], list[SampledLogprobs | None]]:
        """``bitmask``: the allowed tokens of the constrained rows (a bitmask with a row per
        logits row, and which rows to apply it to), applied before anything else; logprobs
        stay those of the model's own distribution (vLLM's raw logprobs)."""
        logits = logits.float()  # [num_rows, vocab]
        raw_logprobs = None
        if any(r.params.logprobs is not None for r in rows):
            raw_logprobs = torch.log_softmax(logits, dim=-1)
        if bitmask is not None:  # before anything else: every pick sees only allowed tokens
            self.kernels.apply_token_bitmask_(logits, *bitmask)
        logits = self._apply_penalties_and_bans(logits, rows)
        token_ids = self._pick(logits, rows)
        logprobs: list[SampledLogprobs | None] = []
        for i, row in enumerate(rows):
            k = row.params.logprobs
            if k is None or raw_logprobs is None:
                logprobs.append(None)
                continue
            logprobs.append(_gather_logprobs(raw_logprobs[i], token_ids[i], k))
        return token_ids, logprobs

    @staticmethod
    def _apply_penalties_and_bans(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        for i, row in enumerate(rows):
            p = row.params
            if p.logit_bias:
                _apply_logit_bias(logits[i], p.logit_bias)
            if p.has_penalties:
                logits[i] = _penalize(logits[i], p, row.prompt_token_ids, row.output_token_ids)
            if len(row.output_token_ids) < p.min_tokens:
                banned = list(p.stop_token_ids) + ([] if p.ignore_eos else list(row.eos_token_ids))
                if banned:
                    logits[i, banned] = float("-inf")
        return logits

    def distribution(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """The probabilities [rows, vocab] that random rows sample from: after penalties, bans,
        temperature and top-k / top-p / min-p. A draft model's proposals are drawn from this, so
        that its q and the target's p are the same transform of two models' logits."""
        logits = self._apply_penalties_and_bans(logits.float(), rows)
        return self._probs(logits, [r.params for r in rows])

    def draw(self, probs: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """One token per row of ``probs`` (non-negative, not necessarily normalized), each from
        its request's generator (or the shared one)."""
        cdf = probs.cumsum(dim=-1)  # [rows, vocab]
        u = torch.stack(
            [
                torch.rand((), generator=r.generator or self.generator, device=probs.device)
                for r in rows
            ]
        )
        picked = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True)[:, 0]
        # u * total rounds up to total once in ~2^24 draws: the likeliest token, not past the end.
        return torch.where(picked < probs.shape[-1], picked, probs.argmax(dim=-1))

    def _pick(self, logits: torch.Tensor, rows: list[SamplingRow]) -> list[int]:
        greedy = self.kernels.argmax(logits)
        random_idx = [i for i, r in enumerate(rows) if not r.params.is_greedy]
        if not random_idx:
            return greedy.tolist()
        idx = torch.tensor(random_idx, device=logits.device)
        random_rows = [rows[i] for i in random_idx]
        probs = self._probs(logits.index_select(0, idx), [r.params for r in random_rows])
        picked = self.draw(probs, random_rows)
        for j, row in enumerate(random_rows):
            if row.draft_probs is not None:
                picked[j] = self._verify(probs[j], row)
        out = greedy.clone()
        out[idx] = picked
        return out.tolist()

    @staticmethod
    def _probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
        temps = torch.tensor([p.temperature for p in params], device=logits.device)
        return torch.softmax(_top_k_top_p_min_p(logits / temps[:, None], params), dim=-1)

    def _verify(self, p: torch.Tensor, row: SamplingRow) -> int:
        """The rejection-sampling rule on one row: the draft, or a draw from the residual."""
        q, d = row.draft_probs, row.draft_token_id
        assert q is not None
        generator = row.generator or self.generator
        u = torch.rand((), generator=generator, device=p.device)
        if u * q[d] <= p[d]:  # accept with probability min(1, p(d) / q(d))
            return d
        residual = (p - q).clamp_(min=0.0)
        if not residual.sum() > 0:  # p == q up to rounding: nothing is left to correct
            residual = p
        return int(self.draw(residual[None], [row])[0])


def _apply_logit_bias(logits: torch.Tensor, logit_bias: dict[int, float]) -> None:
    """Add each bias to its token's logit in place (ids past the vocabulary are skipped)."""
    vocab = logits.shape[0]
    items = [(t, b) for t, b in logit_bias.items() if t < vocab]
    if not items:
        return
    ids = torch.tensor([t for t, _ in items], dtype=torch.long, device=logits.device)
    biases = torch.tensor([b for _, b in items], dtype=logits.dtype, device=logits.device)
    logits[ids] += biases


def _penalize(
    logits: torch.Tensor, p: SamplingParams, prompt_ids: list[int], output_ids: list[int]
) -> torch.Tensor:
    vocab = logits.shape[0]
    if p.repetition_penalty != 1.0:
        # HF/vLLM semantics: every token seen in prompt or output is made less likely.
        seen = torch.tensor(sorted(set(prompt_ids) | set(output_ids)), dtype=torch.long)
        seen = seen[seen < vocab].to(logits.device)
        vals = logits[seen]
        logits[seen] = torch.where(
            vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty
        )
    if output_ids and (p.presence_penalty or p.frequency_penalty):
        # OpenAI semantics: only generated tokens count.
        counts = torch.bincount(torch.tensor(output_ids, dtype=torch.long), minlength=vocab)
        counts = counts[:vocab].to(logits.device, logits.dtype)
        logits -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)
    return logits


def _top_k_top_p_min_p(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    vocab = logits.shape[-1]
    top_k = [p.top_k if p.top_k > 0 else vocab for p in params]
    if any(k < vocab for k in top_k):
        k_max = min(max(top_k), vocab)
        top_vals = logits.topk(k_max, dim=-1).values  # [rows, k_max]
        k_idx = torch.tensor([min(k, vocab) - 1 for k in top_k], device=logits.device)
        kth = top_vals.gather(1, k_idx.clamp(max=k_max - 1)[:, None])
        keep_all = torch.tensor([k >= vocab for k in top_k], device=logits.device)[:, None]
        logits = logits.masked_fill(~keep_all & (logits < kth), float("-inf"))
    if any(p.top_p < 1.0 for p in params):
        top_p = torch.tensor([p.top_p for p in params], device=logits.device)
        logits = logits.masked_fill(_top_p_drop(logits, top_p), float("-inf"))
    if any(p.min_p > 0.0 for p in params):
        min_p = torch.tensor([p.min_p for p in params], device=logits.device)
        probs = logits.softmax(dim=-1)
        threshold = probs.max(dim=-1, keepdim=True).values * min_p[:, None]
        logits = logits.masked_fill(probs < threshold, float("-inf"))
    return logits


# How many of a row's likeliest tokens are searched for the top-p cut, tried in turn before
# sorting the whole row: a sorted top-128 of a 262k-token row takes ~0.25 ms, a top-1,024
# ~0.8 ms, a full sort ~18 ms. On gemma-3-270m's own outputs (temperature 0.8, top-p 0.95) 95%
# of rows were cut within 128 tokens and every one within 1,024.
TOP_P_CANDIDATES = (128, 1024)


def _top_p_drop(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Tokens outside each row's nucleus: a token is dropped when the mass of strictly likelier
    tokens already reaches top_p (tokens tied with the last one kept stay too)."""
    probs = logits.softmax(dim=-1)  # [rows, vocab]
    vocab = probs.shape[-1]
    drop = torch.empty_like(probs, dtype=torch.bool)
    todo = torch.arange(probs.shape[0], device=probs.device)  # rows whose cut is not found yet
    for k in [k for k in TOP_P_CANDIDATES if k < vocab] + [vocab]:
        rows, p = probs[todo], top_p[todo, None]
        vals = rows.topk(k, dim=-1).values if k < vocab else rows.sort(dim=-1, descending=True)[0]
        num_kept = ((vals.cumsum(dim=-1) - vals) < p).sum(dim=-1, keepdim=True)
        threshold = vals.gather(1, num_kept - 1)  # [rows, 1]: the least likely token kept
        # The cut lies among the k searched once they hold top_p of the mass (all do at last).
        found = (vals.sum(dim=-1) >= p[:, 0]) | (k == vocab)
        drop[todo[found]] = rows[found] < threshold[found]
        todo = todo[~found]
        if not todo.numel():
            break
    return drop


def _gather_logprobs(row_logprobs: torch.Tensor, token_id: int, k: int) -> SampledLogprobs:
    sampled_lp = row_logprobs[token_id]
    rank = int((row_logprobs > sampled_lp).sum().item()) + 1
    sampled = TokenLogprob(token_id, float(sampled_lp), rank)
    top: list[TokenLogprob] = []
    if k > 0:
        vals, ids = row_logprobs.topk(k)
        top = [
            TokenLogprob(int(t), float(v), r + 1)
            for r, (v, t) in enumerate(zip(vals.tolist(), ids.tolist()))
        ]
    return SampledLogprobs(sampled=[sampled], top=[top])


# Rows of logits made at once for prompt log-probs: 128 x a 262,144-token vocabulary is 128 MiB
# of fp32 logits, where a 1,024-token chunk at once would be 1 GiB.
PROMPT_LOGPROBS_ROWS = 128


def compute_prompt_logprobs(
    hidden: torch.Tensor,
    compute_logits: Callable[[torch.Tensor], torch.Tensor],
    target_ids: list[int],
    k: int,
    first_pos: int,
) -> PromptLogprobs:
    """Log-probs of ``target_ids`` (prompt tokens ``first_pos ..``) from the hidden states of the
    positions just before them, a slice of rows at a time; only the needed values are kept.

    The log-probs are of the raw model distribution (no penalties, bias or temperature), like
    the sampled tokens' logprobs and vLLM's prompt_logprobs.
    """
    assert hidden.shape[0] == len(target_ids)  # hidden: [num_targets, hidden_size]
    targets = torch.tensor(target_ids, dtype=torch.long, device=hidden.device)
    sampled: list[TokenLogprob] = []
    top: list[list[TokenLogprob]] = []
    for lo in range(0, len(target_ids), PROMPT_LOGPROBS_ROWS):
        hi = min(lo + PROMPT_LOGPROBS_ROWS, len(target_ids))
        # log p = logit - logsumexp(logits): no second [rows, vocab] tensor for a log-softmax.
        logits = compute_logits(hidden[lo:hi]).float()  # [rows, vocab]
        log_norm = logits.logsumexp(dim=-1, keepdim=True)  # [rows, 1]
        target_logits = logits.gather(1, targets[lo:hi, None])  # [rows, 1]
        ranks = torch.count_nonzero(logits > target_logits, dim=-1) + 1
        target_lps = (target_logits - log_norm)[:, 0].tolist()
        for t, lp, rank in zip(target_ids[lo:hi], target_lps, ranks.tolist()):
            sampled.append(TokenLogprob(t, lp, rank))
        if k == 0:
            top.extend([] for _ in range(hi - lo))
            continue
        vals, ids = logits.topk(k, dim=-1)  # [rows, k]
        vals -= log_norm
        for row_vals, row_ids in zip(vals.tolist(), ids.tolist()):
            top.append(
                [TokenLogprob(t, v, r + 1) for r, (v, t) in enumerate(zip(row_vals, row_ids))]
            )
    return PromptLogprobs(first_pos=first_pos, sampled=sampled, top=top)
