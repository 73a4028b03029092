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
from dataclasses import dataclass, field

import torch

from tokenmill.core.sched_output import PromptLogprobs, SampledLogprobs
from tokenmill.kernels import KernelBackend
from tokenmill.kernels.torch_backend import TorchKernelBackend
from tokenmill.outputs import TokenLogprob
from tokenmill.sampling_params import SamplingParams
from tokenmill.worker.transfer import host_to_device, to_device


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
    # What its params ask of a pick, read once (a row is reused from step to step): whether
    # it is greedy, whether its logits are adjusted first (a bias, penalties, min_tokens),
    # and whether it returns log-probs.
    greedy: bool = field(init=False)
    adjusted: bool = field(init=False)
    wants_logprobs: bool = field(init=False)

    def __post_init__(self) -> None:
        p = self.params
        self.greedy = p.is_greedy
        self.adjusted = bool(p.logit_bias) or p.has_penalties or p.min_tokens > 0
        self.wants_logprobs = p.logprobs is not None


class Sampler:
    """``kernels``: the backend whose argmax picks greedy tokens (the model's, so a C argmax
    runs where the model's kernels do: torch's CPU argmax is scalar, ~0.4 ms a row over a 262k
    vocabulary, a few % of a decode step); the torch backend when not given.

    A call keeps everything on the logits' device until its end: the picks, the verified
    drafts and the requested log-probs are tensors, moved to the host in one transfer (on CUDA
    the step's only wait for the device). Inputs built from Python lists (temperatures,
    penalties' token ids, indices) go the other way, as copies that need no wait.
    """

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
        logprob_idx = [i for i, r in enumerate(rows) if r.wants_logprobs]
        if not logprob_idx:
            return self.pick(logits, rows, bitmask).tolist(), [None] * len(rows)
        logits = logits.float()  # [num_rows, vocab]
        raw_logprobs = torch.log_softmax(logits, dim=-1)
        token_ids = self.pick(logits, rows, bitmask)
        ks = [rows[i].params.logprobs or 0 for i in logprob_idx]
        packed = _logprob_tensors(raw_logprobs, token_ids, to_device(logprob_idx, logits), ks)
        # One transfer: the token ids and every log-prob value, as float64 (exact for both).
        values = torch.cat([token_ids.double(), packed]).tolist()
        return _unpack(values, len(rows), logprob_idx, ks)

    def pick(
        self,
        logits: torch.Tensor,
        rows: list[SamplingRow],
        bitmask: tuple[torch.Tensor, list[int]] | None = None,
    ) -> torch.Tensor:
        """One token a row [num_rows] long, left on the logits' device (no transfer, no wait);
        the logits may be changed in place."""
        logits = logits.float()
        if bitmask is not None:  # before anything else: every pick sees only allowed tokens
            self.kernels.apply_token_bitmask_(logits, *bitmask)
        logits = self._apply_penalties_and_bans(logits, rows)
        return self._pick(logits, rows)

    @staticmethod
    def _apply_penalties_and_bans(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        for i, row in enumerate(rows):
            if not row.adjusted:
                continue
            p = row.params
            if p.logit_bias:
                _apply_logit_bias(logits[i], p.logit_bias)
            if p.has_penalties:
                logits[i] = _penalize(logits[i], p, row.prompt_token_ids, row.output_token_ids)
            if len(row.output_token_ids) < p.min_tokens:
                banned = list(p.stop_token_ids) + ([] if p.ignore_eos else list(row.eos_token_ids))
                if banned:
                    logits[i, to_device(banned, logits)] = float("-inf")
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
        return _inverse_cdf(probs, self._uniforms(rows, probs.device))

    def _uniforms(self, rows: list[SamplingRow], device: torch.device) -> torch.Tensor:
        """One uniform draw a row [rows], each from its request's generator (or the shared
        one), in row order."""
        return torch.stack(
            [torch.rand((), generator=r.generator or self.generator, device=device) for r in rows]
        )

    def _pick(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        greedy = self.kernels.argmax(logits)
        random_idx = [i for i, r in enumerate(rows) if not r.greedy]
        if not random_idx:
            return greedy
        idx = to_device(random_idx, logits)
        random_rows = [rows[i] for i in random_idx]
        probs = self._probs(logits.index_select(0, idx), [r.params for r in random_rows])
        picked = self.draw(probs, random_rows)
        verify = [j for j, r in enumerate(random_rows) if r.draft_probs is not None]
        if verify:
            at = to_device(verify, logits)
            verified = self._verify(probs.index_select(0, at), [random_rows[j] for j in verify])
            picked = picked.index_copy(0, at, verified)
        out = greedy.clone()
        out[idx] = picked
        return out

    @staticmethod
    def _probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
        temps = to_device([p.temperature for p in params], logits)
        return torch.softmax(_top_k_top_p_min_p(logits / temps[:, None], params), dim=-1)

    def _verify(self, p: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """The rejection-sampling rule on rows p [rows, vocab] that verify a draft each: the
        draft, or a draw from the residual max(0, p - q).

        NOTE: every row draws both its acceptance uniform and its residual uniform (in that
        order, row by row), kept or not: a draw only on rejection would need the verdict on
        the host first."""
        q = torch.stack([r.draft_probs for r in rows]).to(p)  # type: ignore[misc]
        d = to_device([r.draft_token_id for r in rows], p, torch.long)[:, None]
        u = torch.stack(  # [rows, 2]: acceptance, residual
            [
                torch.stack([torch.rand((), generator=g, device=p.device) for _ in range(2)])
                for g in (r.generator or self.generator for r in rows)
            ]
        )
        accept = (u[:, 0:1] * q.gather(1, d) <= p.gather(1, d))[:, 0]  # min(1, p(d) / q(d))
        residual = (p - q).clamp_(min=0.0)
        # p == q up to rounding leaves nothing to correct: draw from p itself.
        empty = ~(residual.sum(dim=-1, keepdim=True) > 0)
        residual = torch.where(empty, p, residual)
        return torch.where(accept, d[:, 0], _inverse_cdf(residual, u[:, 1]))


def _inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Row i's first token whose cumulative probability exceeds u[i] of its row's total."""
    cdf = probs.cumsum(dim=-1)  # [rows, vocab]
    picked = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True)[:, 0]
    # u * total rounds up to total once in ~2^24 draws: the likeliest token, not past the end.
    return torch.where(picked < probs.shape[-1], picked, probs.argmax(dim=-1))


def _apply_logit_bias(logits: torch.Tensor, logit_bias: dict[int, float]) -> None:
    """Add each bias to its token's logit in place (ids past the vocabulary are skipped)."""
    vocab = logits.shape[0]
    items = [(t, b) for t, b in logit_bias.items() if t < vocab]
    if not items:
        return
    ids = to_device([t for t, _ in items], logits, torch.long)
    biases = to_device([b for _, b in items], logits, logits.dtype)
    logits[ids] += biases


def _penalize(
    logits: torch.Tensor, p: SamplingParams, prompt_ids: list[int], output_ids: list[int]
) -> torch.Tensor:
    vocab = logits.shape[0]
    if p.repetition_penalty != 1.0:
        # HF/vLLM semantics: every token seen in prompt or output is made less likely.
        seen = to_device(
            [t for t in sorted(set(prompt_ids) | set(output_ids)) if t < vocab], logits, torch.long
        )
        vals = logits[seen]
        logits[seen] = torch.where(
            vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty
        )
    if output_ids and (p.presence_penalty or p.frequency_penalty):
        # OpenAI semantics: only generated tokens count.
        counts = torch.bincount(torch.tensor(output_ids, dtype=torch.long), minlength=vocab)
        counts = host_to_device(counts[:vocab].to(logits.dtype), logits)
        logits -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)
    return logits


def _top_k_top_p_min_p(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    vocab = logits.shape[-1]
    top_k = [p.top_k if p.top_k > 0 else vocab for p in params]
    if any(k < vocab for k in top_k):
        k_max = min(max(top_k), vocab)
        top_vals = logits.topk(k_max, dim=-1).values  # [rows, k_max]
        k_idx = to_device([min(k, vocab) - 1 for k in top_k], logits)
        kth = top_vals.gather(1, k_idx.clamp(max=k_max - 1)[:, None])
        keep_all = to_device([k >= vocab for k in top_k], logits)[:, None]
        logits = logits.masked_fill(~keep_all & (logits < kth), float("-inf"))
    if any(p.top_p < 1.0 for p in params):
        top_p = to_device([p.top_p for p in params], logits)
        logits = logits.masked_fill(_top_p_drop(logits, top_p), float("-inf"))
    if any(p.min_p > 0.0 for p in params):
        min_p = to_device([p.min_p for p in params], logits)
        probs = logits.softmax(dim=-1)
        threshold = probs.max(dim=-1, keepdim=True).values * min_p[:, None]
        logits = logits.masked_fill(probs < threshold, float("-inf"))
    return logits


# How many of a row's likeliest tokens are searched for the top-p cut on CPU, tried in turn
# before sorting the whole row: a sorted top-128 of a 262k-token row takes ~0.25 ms, a top-1,024
# ~0.8 ms, a full sort ~18 ms. On gemma-3-270m's own outputs (temperature 0.8, top-p 0.95) 95%
# of rows were cut within 128 tokens and every one within 1,024. Other devices sort at once:
# picking the rows left for the next round waits for the device, and a GPU sorts fast.
TOP_P_CANDIDATES = (128, 1024)


def _top_p_drop(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Tokens outside each row's nucleus: a token is dropped when the mass of strictly likelier
    tokens already reaches top_p (tokens tied with the last one kept stay too)."""
    probs = logits.softmax(dim=-1)  # [rows, vocab]
    vocab = probs.shape[-1]
    if probs.device.type != "cpu":
        return probs < _nucleus_threshold(probs.sort(dim=-1, descending=True)[0], top_p[:, None])
    drop = torch.empty_like(probs, dtype=torch.bool)
    todo = torch.arange(probs.shape[0], device=probs.device)  # rows whose cut is not found yet
    for k in [k for k in TOP_P_CANDIDATES if k < vocab] + [vocab]:
        rows, p = probs[todo], top_p[todo, None]
        vals = rows.topk(k, dim=-1).values if k < vocab else rows.sort(dim=-1, descending=True)[0]
        threshold = _nucleus_threshold(vals, p)
        # The cut lies among the k searched once they hold top_p of the mass (all do at last).
        found = (vals.sum(dim=-1) >= p[:, 0]) | (k == vocab)
        drop[todo[found]] = rows[found] < threshold[found]
        todo = todo[~found]
        if not todo.numel():
            break
    return drop


def _nucleus_threshold(vals: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """[rows, 1]: the least likely token kept, of each row's probabilities sorted descending
    (``vals``, a prefix of them or all) and its top_p [rows, 1]."""
    num_kept = ((vals.cumsum(dim=-1) - vals) < top_p).sum(dim=-1, keepdim=True)
    return vals.gather(1, num_kept - 1)


def _logprob_tensors(
    raw_logprobs: torch.Tensor, token_ids: torch.Tensor, idx: torch.Tensor, ks: list[int]
) -> torch.Tensor:
    """The log-probs the rows ``idx`` asked for, flat, as float64 on the device:
    | sampled logprob [n] | sampled rank [n] | top-k_max logprobs [n * k_max] | their ids |."""
    lps = raw_logprobs.index_select(0, idx)  # [n, vocab]
    sampled_lp = lps.gather(1, token_ids.index_select(0, idx)[:, None])  # [n, 1]
    rank = (lps > sampled_lp).sum(dim=-1) + 1
    parts = [sampled_lp[:, 0].double(), rank.double()]
    k_max = max(ks)
    if k_max > 0:
        vals, ids = lps.topk(k_max, dim=-1)  # [n, k_max]
        parts += [vals.flatten().double(), ids.flatten().double()]
    return torch.cat(parts)


def _unpack(
    values: list[float], num_rows: int, logprob_idx: list[int], ks: list[int]
) -> tuple[list[int], list[SampledLogprobs | None]]:
    """Token ids and each row's SampledLogprobs back from ``Sampler.__call__``'s transfer."""
    token_ids = [int(t) for t in values[:num_rows]]
    n, k_max = len(logprob_idx), max(ks)
    sampled_lps = values[num_rows : num_rows + n]
    ranks = values[num_rows + n : num_rows + 2 * n]
    top_vals = values[num_rows + 2 * n : num_rows + 2 * n + n * k_max]
    top_ids = values[num_rows + 2 * n + n * k_max :]
    logprobs: list[SampledLogprobs | None] = [None] * num_rows
    for j, (i, k) in enumerate(zip(logprob_idx, ks)):
        sampled = TokenLogprob(token_ids[i], sampled_lps[j], int(ranks[j]))
        lo = j * k_max
        top = [TokenLogprob(int(top_ids[lo + r]), top_vals[lo + r], r + 1) for r in range(k)]
        logprobs[i] = SampledLogprobs(sampled=[sampled], top=[top])
    return token_ids, logprobs


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
    targets = to_device(target_ids, hidden, torch.long)
    sampled: list[TokenLogprob] = []
    top: list[list[TokenLogprob]] = []
    for lo in range(0, len(target_ids), PROMPT_LOGPROBS_ROWS):
        hi = min(lo + PROMPT_LOGPROBS_ROWS, len(target_ids))
        # log p = logit - logsumexp(logits): no second [rows, vocab] tensor for a log-softmax.
        logits = compute_logits(hidden[lo:hi]).float()  # [rows, vocab]
        log_norm = logits.logsumexp(dim=-1, keepdim=True)  # [rows, 1]
        target_logits = logits.gather(1, targets[lo:hi, None])  # [rows, 1]
        ranks = torch.count_nonzero(logits > target_logits, dim=-1) + 1
        parts = [(target_logits - log_norm)[:, 0].double(), ranks.double()]
        if k > 0:
            vals, ids = logits.topk(k, dim=-1)  # [rows, k]
            parts += [(vals - log_norm).flatten().double(), ids.flatten().double()]
        # One transfer a slice: | logprobs | ranks | top-k logprobs | their ids |.
        values, n = torch.cat(parts).tolist(), hi - lo
        for j, t in enumerate(target_ids[lo:hi]):
            sampled.append(TokenLogprob(t, values[j], int(values[n + j])))
        if k == 0:
            top.extend([] for _ in range(n))
            continue
        top_vals, top_ids = values[2 * n : 2 * n + n * k], values[2 * n + n * k :]
        for j in range(n):
            top.append(
                [
                    TokenLogprob(int(top_ids[j * k + r]), top_vals[j * k + r], r + 1)
                    for r in range(k)
                ]
            )
    return PromptLogprobs(first_pos=first_pos, sampled=sampled, top=top)
