"""Draft-model proposals: a smaller model with the target's vocabulary guesses K tokens.

The draft runs in the worker beside the target, on its own ModelRunner (its model, its own paged
KV cache, its decode graphs), driven here with hand-made steps. Per proposing request and step::

    draft cache: | valid K/V (kept from earlier steps) | catch-up | d0 .. d(K-2) fed |
    1. catch up: the tokens its cache lacks (the prompt at first, then the tokens the target
       kept last step) in one forward, whose last row gives d0;
    2. K - 1 single-token steps, each feeding the previous draft and giving the next.

Drafts of random requests are drawn from the draft's distribution q (the target's sampling
transform of the draft's logits: temperature, top-k / top-p / min-p, penalties), which comes
with the proposal for rejection sampling (worker/sampler.py); greedy requests get the draft's
argmax. After verification the draft's cache keeps the K/V of the tokens the target agreed
with and rewrites the rest (the longest common prefix with the request's tokens), so a
rejected draft's K/V is never attended to again.

The cache has its own blocks; a request that finds none free (after the blocks of requests that
no longer propose are reclaimed) simply gets no proposal.
"""

from __future__ import annotations

import torch

from tokenmill.core.block_pool import Block, BlockPool
from tokenmill.core.sched_output import CachedRequestData, SchedulerOutput
from tokenmill.spec import Draft, DraftRequest, Proposer
from tokenmill.worker.input_batch import BlockTables, RequestState
from tokenmill.worker.model_runner import ModelRunner
from tokenmill.worker.sampler import SamplingRow


class DraftModelProposer(Proposer):
    def __init__(
        self, runner: ModelRunner, num_tokens: int, num_blocks: int, max_model_len: int
    ) -> None:
        self.runner = runner  # the draft model's: its KV cache holds num_blocks blocks
        self.num_tokens = num_tokens
        self.max_model_len = max_model_len
        self.block_size = runner.block_size
        self.pool = BlockPool(num_blocks, enable_caching=False)
        self._blocks: dict[str, list[Block]] = {}
        self._num_valid: dict[str, int] = {}  # leading tokens whose K/V in the cache are right
        self._num_known: dict[str, int] = {}  # the request's known tokens at its last proposal

    def propose(self, reqs: list[DraftRequest]) -> dict[str, Draft]:
        by_id = {r.req_id: r for r in reqs}
        # Never past max_model_len: the scheduler would cut such drafts anyway.
        wanted = {
            r.req_id: min(self.num_tokens, self.max_model_len - len(r.token_ids)) for r in reqs
        }
        ready = [
            r.req_id
            for r in reqs
            if wanted[r.req_id] > 0 and self._prepare(r, by_id, wanted[r.req_id])
        ]
        tokens: dict[str, list[int]] = {rid: [] for rid in ready}
        probs: dict[str, list[torch.Tensor]] = {rid: [] for rid in ready}
        # 1. catch up: at least the last known token, whose row predicts d0
        scheduled = {rid: len(by_id[rid].token_ids) - self._num_valid[rid] for rid in ready}
        while scheduled:
            logits, order = self.runner.logits(self._step(scheduled))
            self._draw(logits, order, by_id, tokens, probs)
            # 2. feed each request's newest draft while it wants more
            scheduled = {}
            for rid in order:
                state = self.runner.requests[rid]
                self._num_valid[rid] = len(state.token_ids)
                if len(tokens[rid]) < wanted[rid]:
                    state.token_ids.append(tokens[rid][-1])
                    scheduled[rid] = 1
        return {
            rid: Draft(tokens[rid], torch.stack(probs[rid]) if probs[rid] else None)
            for rid in ready
        }

    def finish(self, req_id: str, output_token_ids: list[int] | None) -> None:
        self._release(req_id)

    # ---- the draft's cache ---------------------------------------------------------------

    def _prepare(self, req: DraftRequest, asking: dict[str, DraftRequest], num_drafts: int) -> bool:
        """Bring the request's draft state up to its tokens and reserve the slots its catch-up
        and drafts need; False when the cache has no room for it."""
        rid = req.req_id
        state = self.runner.requests.get(rid)
        if state is None:
            state = RequestState(
                token_ids=[],
                num_prompt_tokens=req.num_prompt_tokens,
                sampling_params=req.sampling_params,
                block_ids=BlockTables([[]]),  # one group (the draft's Worker: hybrid_kv=False)
                generator=req.generator,
                eos_token_ids=(),
            )
            self.runner.requests[rid] = state
            self._blocks[rid] = []
            self._num_valid[rid] = self._num_known[rid] = 0
        # Known tokens never change, so only the drafts fed after them can disagree.
        known, valid = self._num_known[rid], self._num_valid[rid]
        fed, actual = state.token_ids[known:valid], req.token_ids[known:]
        agreed = next((i for i, (a, b) in enumerate(zip(fed, actual)) if a != b), len(fed))
        self._num_valid[rid] = min(known + agreed, len(req.token_ids) - 1)
        self._num_known[rid] = len(req.token_ids)
        state.token_ids = list(req.token_ids)
        # Positions up to len + num_drafts - 2 get K/V (the last draft is never fed).
        needed = -(-(len(req.token_ids) + num_drafts - 1) // self.block_size)
        missing = needed - len(self._blocks[rid])
        if missing > self.pool.num_free_blocks:  # reclaim requests that stopped proposing
            for other in [o for o in self._blocks if o not in asking]:
                self._release(other)
        if missing > self.pool.num_free_blocks:
            return False
        if missing > 0:
            new = self.pool.allocate(missing)
            self._blocks[rid].extend(new)
            state.block_ids.extend(0, [b.block_id for b in new])
        return True

    def _release(self, req_id: str) -> None:
        blocks = self._blocks.pop(req_id, None)
        if blocks:
            self.pool.free(reversed(blocks))
        self._num_valid.pop(req_id, None)
        self._num_known.pop(req_id, None)
        self.runner.requests.pop(req_id, None)

    def _step(self, scheduled: dict[str, int]) -> SchedulerOutput:
        """A step of the draft runner: ``scheduled[rid]`` tokens after its valid ones."""
        cached = [CachedRequestData(rid, [[]], self._num_valid[rid]) for rid in scheduled]
        return SchedulerOutput(new_reqs=[], cached_reqs=cached, num_scheduled_tokens=scheduled)

    # ---- drawing drafts ------------------------------------------------------------------

    def _draw(
        self,
        logits: torch.Tensor,
        order: list[str],
        reqs: dict[str, DraftRequest],
        tokens: dict[str, list[int]],
        probs: dict[str, list[torch.Tensor]],
    ) -> None:
        """One draft token per row of ``logits`` (row i: request ``order[i]``): greedy requests
        the argmax, random ones a draw from q, whose row is kept."""
        sampler = self.runner.sampler
        picked = sampler.kernels.argmax(logits)  # [rows]
        random_idx = [i for i, rid in enumerate(order) if not reqs[rid].sampling_params.is_greedy]
        q = None
        if random_idx:
            rows = [self._row(reqs[order[i]], tokens[order[i]]) for i in random_idx]
            idx = torch.tensor(random_idx, device=logits.device)
            q = sampler.distribution(logits.index_select(0, idx), rows)
            picked = picked.clone()
            picked[idx] = sampler.draw(q, rows)
        for rid, token_id in zip(order, picked.tolist()):  # the one wait for the device
            tokens[rid].append(token_id)
        if q is not None:
            for j, i in enumerate(random_idx):
                probs[order[i]].append(q[j])

    @staticmethod
    def _row(req: DraftRequest, drafts_before: list[int]) -> SamplingRow:
        outputs = req.token_ids[req.num_prompt_tokens :]
        return SamplingRow(
            params=req.sampling_params,
            prompt_token_ids=req.token_ids[: req.num_prompt_tokens],
            output_token_ids=outputs + drafts_before,
            generator=req.generator,
            eos_token_ids=(),
        )
