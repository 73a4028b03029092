"""ModelRunner: the model, the paged KV cache and per-request token state on the worker side.

A step (``execute``):
1. update the request states from the SchedulerOutput (new, resumed, finished, preempted,
   new blocks);
2. lay the scheduled tokens of all requests out flat (worker/input_batch.py): any number of
   query tokens per request (a prefill chunk, one decode token, or one token plus K drafts);
3. one forward pass, then logits only at the rows that predict a new token (and, for requests
   that asked for prompt log-probs, at the prompt positions of their chunk);
4. sample every logits row and keep, per request, the sampled tokens up to the first draft the
   sample disagrees with (``accept_drafts``): one or more new tokens.
A step of single-token decodes replays a recorded decode graph instead of 2. and 3.: on CPU a
recording of the C kernels' calls (worker/decode_graph.py), on CUDA a CUDA graph of its padded
batch size (worker/cuda_graph.py).

Async scheduling splits a step in two: ``launch`` queues its work on the device, picks
included, and returns; ``collect`` waits for the picks and returns the step's output. The
engine schedules and launches step N+1 between step N's two halves. Step N+1's rows that run
step N's picks read them on the device: until step N is collected, each such token is a
placeholder in its request's ``token_ids`` (``pending_token``: which pick it is), and the
step's input ids take the pick where the placeholder stands (``PendingIds``). The device runs
the steps in order, so a launched step's buffers (logits, graph inputs, KV blocks freed and
handed out again) are never overwritten before it has read them.
"""

from __future__ import annotations

import logging
import mmap
from collections import deque
from dataclasses import dataclass

import numpy as np
import torch

from tokenmill.attention import ForwardBatch, is_quantized_kv, kv_bytes_per_token, kv_storage_dtype
from tokenmill.config import CacheConfig, ModelConfig
from tokenmill.core.sched_output import (
    PromptLogprobs,
    RunnerOutput,
    SampledLogprobs,
    SchedulerOutput,
)
from tokenmill.kv_layout import KVLayout, kv_tensors, uniform_layout
from tokenmill.models.base import CausalLM
from tokenmill.reasoning import BudgetState, ThinkingBudget
from tokenmill.spec import Draft, DraftRequest, Proposer
from tokenmill.structured import CompiledGrammar, GrammarCompiler, GrammarMatcher, GrammarSource
from tokenmill.structured.bitmask import allocate_bitmask, allow_only, fill_row
from tokenmill.tokenizer import load_tokenizer
from tokenmill.worker.cuda_graph import CUDA_GRAPH_MAX_BATCH, CudaDecodeGraphs
from tokenmill.worker.decode_graph import DecodeGraphs
from tokenmill.worker.input_batch import (
    BlockTables,
    PendingIds,
    PoolingRows,
    PromptLogprobRows,
    RequestState,
    RowTables,
    StepInputs,
    build_step_inputs,
    pending_token,
)
from tokenmill.worker.recurrent_state import RecurrentStatePool
from tokenmill.worker.sampler import Sampler, SamplingRow, compute_prompt_logprobs

logger = logging.getLogger(__name__)

# Decode steps of up to this many requests (and max_num_seqs) replay a recorded graph
# (worker/decode_graph.py); each size is recorded once, at its first step.
DECODE_GRAPH_MAX_BATCH = 128


KVCaches = list[tuple[torch.Tensor, ...]]


@dataclass(slots=True)
class LaunchedStep:
    """A step whose picks are still on the device: one a sampled request, in row order."""

    sampled: torch.Tensor  # [rows] long, on the device
    host: torch.Tensor  # their copy on the host (pinned on CUDA), complete once ``copied``
    copied: torch.cuda.Event | None  # None on CPU, where the copy is done on return
    # Each row's request, its state then and the index of its placeholder in state.token_ids.
    rows: list[tuple[str, RequestState, int]]


def max_logits_rows(max_num_seqs: int, num_draft_tokens: int, max_num_batched_tokens: int) -> int:
    """The most rows with logits one step can have: each request's next token and its drafts,
    and never more than the step's tokens."""
    return max(1, min(max_num_seqs * (1 + num_draft_tokens), max_num_batched_tokens))


def decode_graph_rows(max_rows: int) -> int:
    """Rows of the decode graphs' buffers (worker/decode_graph.py) for a runner of ``max_rows``."""
    return min(DECODE_GRAPH_MAX_BATCH, max_rows)


def kv_bytes_per_block(
    config: ModelConfig,
    block_size: int,
    dtype: torch.dtype,
    kv_cache_dtype: str = "auto",
    layout: KVLayout | None = None,
) -> int:
    """Bytes of one block: K and V (and their scales, if quantized) of the layers it holds
    (every layer without a layout), in each shape they come in (kv_layout.kv_tensors)."""
    layout = layout or uniform_layout(config.num_kv_layers)
    shapes, _, _ = kv_tensors(
        layout, config.kv_layer_shapes, config.num_local_heads, is_quantized_kv(kv_cache_dtype)
    )
    per_token = sum(kv_bytes_per_token(h, d, kv_cache_dtype, dtype) for h, d in shapes)
    return per_token * block_size


def allocate_kv_caches(
    config: ModelConfig, cache: CacheConfig, dtype: torch.dtype, device: torch.device
) -> KVCaches:
    """Per layer K, V [num_blocks, block_size, num_kv_heads, head_dim]; a quantized cache adds
    K and V scales [num_blocks, block_size, num_kv_heads] float32. Layers of different groups
    (kv_layout.py) share tensors: layer i's are tensor ``layout.layer_tensors[i]``'s."""
    layout = cache.layout(config.num_kv_layers)
    storage_dtype = kv_storage_dtype(cache.kv_cache_dtype, dtype)
    # This rank's KV heads (all of them without tensor parallelism), per shape (Gemma 4's
    # global layers have their own).
    quantized = is_quantized_kv(cache.kv_cache_dtype)
    shapes, layer_tensors, views = kv_tensors(
        layout, config.kv_layer_shapes, config.num_local_heads, exact=quantized
    )
    tensors = []
    for num_kv_heads, head_dim in shapes:
        shape = (cache.num_blocks, cache.block_size, num_kv_heads, head_dim)
        tensor = [_zeros(shape, storage_dtype, device), _zeros(shape, storage_dtype, device)]
        if quantized:
            tensor += [_zeros(shape[:-1], torch.float32, device) for _ in range(2)]
        tensors.append(tuple(tensor))
    caches = []
    for (num_kv_heads, head_dim), t in zip(views, layer_tensors):
        k, v, *scales = tensors[t]  # viewed in this layer's shape (rows of the same length)
        shape = (cache.num_blocks, cache.block_size, num_kv_heads, head_dim)
        caches.append((k.view(shape), v.view(shape), *scales))
    return caches


class ModelRunner:
    def __init__(
        self,
        model: CausalLM,
        cache: CacheConfig,
        device: torch.device,
        dtype: torch.dtype,
        max_model_len: int,
        seed: int = 0,
        decode_graphs: bool = False,
        max_num_seqs: int = DECODE_GRAPH_MAX_BATCH,
        max_num_batched_tokens: int | None = None,
        cuda_graphs: bool = False,
        proposer: Proposer | None = None,
        speculative_max_batch: int = 2,
    ) -> None:
        self.model = model
        self.proposer = proposer  # drafts for each request's next step, if speculating
        self.speculative_max_batch = speculative_max_batch  # EngineArgs says why
        self.device = device
        self.block_size = cache.block_size
        self.kv_cache_dtype = cache.kv_cache_dtype
        self.kv_layout = cache.layout(model.config.num_kv_layers)
        self.kv_caches = allocate_kv_caches(model.config, cache, dtype, device)
        # Hybrid models: a recurrent-state slot per running request, beside the KV blocks.
        self.recurrent: RecurrentStatePool | None = None
        if model.config.linear_attention is not None:
            self.recurrent = RecurrentStatePool(model.config, max_num_seqs, dtype, device)
        self.sampler = Sampler(device, seed, model.kernels)
        self.requests: dict[str, RequestState] = {}
        # Proposals with a draft distribution, kept until the step that verifies them.
        self._drafts: dict[str, Draft] = {}
        self._bitmask_buffer: torch.Tensor | None = None  # grown to the most rows seen
        # Compiles the structured-output formats that came from another process as their
        # sources (structured/compiler.py); built with the first, from the model's tokenizer.
        self._grammar_compiler: GrammarCompiler | None = None
        # What preempted requests keep for when they resume: their generator (a seeded request
        # samples the same after it), and the prompt log-probs already sent (no repeats).
        self._parked: dict[str, tuple[torch.Generator | None, int]] = {}
        # Decode attention gathers each layer's K/V blocks into these (grown on demand).
        self._gather_buffers: tuple[torch.Tensor, torch.Tensor] | None = None
        # One logits buffer for every step, grown to the largest batch seen: a fresh [32, 262k]
        # float32 tensor each step cost ~10 ms of page faults (over 32 MB, malloc maps anew).
        self._logits_buffer: torch.Tensor | None = None
        self._row_tables = RowTables(self.kv_layout.num_groups)  # decode graph steps' tables
        self.decode_graphs: DecodeGraphs | None = None
        self.cuda_graphs: CudaDecodeGraphs | None = None
        # Launched steps not yet collected, oldest first (at most two: async scheduling).
        self._launched: deque[LaunchedStep] = deque()
        max_blocks_per_seq = -(-max_model_len // cache.block_size)
        # A graph row per query: each decode's next token and its drafts.
        num_drafts = proposer.num_tokens if proposer is not None else 0
        max_rows = max_logits_rows(
            max_num_seqs, num_drafts, max_num_batched_tokens or max_num_seqs * (1 + num_drafts)
        )
        if cuda_graphs:
            self.cuda_graphs = CudaDecodeGraphs(
                model,
                self.kv_caches,
                self.kv_layout,
                cache.block_size,
                max_blocks_per_seq,
                min(CUDA_GRAPH_MAX_BATCH, max_rows),
                device,
            )
            if device.type == "cuda":
                self.cuda_graphs.capture()
        elif decode_graphs:
            self.decode_graphs = DecodeGraphs(
                model,
                self.kv_caches,
                self.kv_layout,
                cache.block_size,
                max_blocks_per_seq,
                decode_graph_rows(max_rows),
            )

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> RunnerOutput:
        assert not self._launched, "collect the launched steps before a step runs whole"
        self.update_states(sched)
        out = RunnerOutput(sampled_token_ids={})
        if sched.is_empty:
            return out
        graph_logits = self._decode_graph_step(sched)
        if graph_logits is not None:
            req_ids = list(sched.num_scheduled_tokens)
            return self._sample(req_ids, sched.draft_token_ids, graph_logits, out)
        step = self.prepare_step(sched)
        hidden = self.forward(step)
        for rows in step.prompt_logprob_rows:
            out.prompt_logprobs[rows.req_id] = self._prompt_logprobs(hidden, rows)
        for pooled in step.pooling_rows:
            embedding = self._pool(hidden, pooled)
            if embedding is not None:
                out.embeddings[pooled.req_id] = embedding
        if step.logits_indices.numel() == 0:
            return out
        logits = self.compute_logits(hidden, step)
        req_ids = [r.req_id for r in step.sampling_reqs]
        drafts_of = {r.req_id: r.draft_token_ids for r in step.sampling_reqs if r.draft_token_ids}
        return self._sample(req_ids, drafts_of, logits, out)

    @torch.inference_mode()
    def launch(self, sched: SchedulerOutput) -> None:
        """Queue a step on the device, its picks included, and return without waiting for them
        (``collect`` does). Its requests are ones the scheduler lets run ahead
        (``sched.can_run_ahead``: no drafts, log-probs, penalties or grammar), so the picks are
        all the step returns. Its input ids may be picks of the step launched before it."""
        assert sched.can_run_ahead
        self.update_states(sched)
        logits, req_ids = self._logits(sched)
        if logits is None:
            sampled = torch.empty(0, dtype=torch.long, device=self.device)
        else:
            rows = [row for rid in req_ids for row in self._sampling_rows(rid, [])]
            sampled = self.sampler.pick(logits, rows)
        copied = None
        if sampled.device.type == "cpu":
            host = sampled
        else:
            host = torch.empty(sampled.shape, dtype=sampled.dtype, pin_memory=True)
            host.copy_(sampled, non_blocking=True)
            copied = torch.cuda.Event()
            copied.record()
        launched = LaunchedStep(sampled, host, copied, [])
        for row, rid in enumerate(req_ids):
            state = self.requests[rid]
            launched.rows.append((rid, state, len(state.token_ids)))
            state.token_ids.append(pending_token(row))
        self._launched.append(launched)

    def collect(self) -> RunnerOutput:
        """The output of the oldest launched step: waits for its picks, which replace their
        placeholders (in requests still here: a finished or preempted one has left)."""
        launched = self._launched.popleft()
        if launched.copied is not None:
            launched.copied.synchronize()
        out = RunnerOutput(sampled_token_ids={})
        for (rid, state, index), token_id in zip(launched.rows, launched.host.tolist()):
            out.sampled_token_ids[rid] = [token_id]
            if self.requests.get(rid) is state:
                state.token_ids[index] = token_id
        return out

    def logits(self, sched: SchedulerOutput) -> tuple[torch.Tensor, list[str]]:
        """The logits rows of a step that predict next tokens (a graph replay when the step is
        all decodes, else eager) and the request of each row, for a caller that samples itself
        (a draft model's proposer, which keeps ``requests`` up to date itself). One row per
        request: steps without drafts, in which every request reaches its last known token."""
        logits, req_ids = self._logits(sched)
        assert logits is not None, "every request of the step predicts a token"
        return logits, req_ids

    def _logits(self, sched: SchedulerOutput) -> tuple[torch.Tensor | None, list[str]]:
        """``logits``, where a step of prompt chunks alone predicts nothing (None)."""
        graph_logits = self._decode_graph_step(sched)
        if graph_logits is not None:
            return graph_logits, list(sched.num_scheduled_tokens)
        step = self.prepare_step(sched)
        hidden = self.forward(step)
        req_ids = [r.req_id for r in step.sampling_reqs]
        return (self.compute_logits(hidden, step) if req_ids else None), req_ids

    # ---- the eager step, in its parts ---------------------------------------------------

    def prepare_step(self, sched: SchedulerOutput) -> StepInputs:
        """The step's flat batch (call after ``update_states``), the launched step's picks in
        its input ids."""
        step = build_step_inputs(
            self.requests,
            sched.num_scheduled_tokens,
            sched.num_computed_tokens(),
            sched.draft_token_ids,
            self.block_size,
            self.device,
            self._gather_workspace,
            self.kv_layout.group_windows,
        )
        pending = self._pending_ids(step.pending)
        if pending is not None:
            pending.apply(step.input_ids)
        return step

    def forward(self, step: StepInputs) -> torch.Tensor:
        """Hidden states [num_tokens, hidden] of every row; new K/V written to the cache."""
        fwd = ForwardBatch(self.kv_caches, step.attn, self.kv_layout.layer_groups)
        if self.recurrent is not None:
            fwd.states, fwd.recurrent = self.recurrent.states, self.recurrent.batch(step.reqs)
        return self.model(step.input_ids, step.positions, fwd)

    def compute_logits(self, hidden: torch.Tensor, step: StepInputs) -> torch.Tensor:
        """Logits [num_logits, vocab] at ``step.logits_indices``: valid until the next step (they
        sit in a reused buffer)."""
        rows = hidden.index_select(0, step.logits_indices)
        return self.model.compute_logits(rows, self._logits_out(rows))

    def update_states(self, sched: SchedulerOutput) -> None:
        for rid in sched.finished_req_ids:
            state = self.requests.pop(rid, None)
            self._parked.pop(rid, None)
            outputs = state.token_ids[state.num_prompt_tokens :] if state is not None else None
            self._forget_draft(rid, outputs)
            if self.recurrent is not None:
                self.recurrent.release(rid)
        for rid in sched.preempted_req_ids:
            state = self.requests.pop(rid, None)
            self._forget_draft(rid, None)
            if self.recurrent is not None:  # it recomputes from its first token on resuming
                self.recurrent.release(rid)
            if state is not None:
                self._parked[rid] = (state.generator, state.next_prompt_logprob_idx)
        for new in sched.new_reqs:
            if self.recurrent is not None:
                self.recurrent.assign(new.req_id)
            generator, next_prompt_logprob_idx = self._parked.pop(new.req_id, (None, 1))
            if generator is None and new.sampling_params.seed is not None:
                generator = torch.Generator(device=self.device)
                generator.manual_seed(new.sampling_params.seed)
            self.requests[new.req_id] = RequestState(
                token_ids=list(new.token_ids),
                num_prompt_tokens=new.num_prompt_tokens,
                sampling_params=new.sampling_params,
                block_ids=BlockTables(new.block_ids),
                generator=generator,
                eos_token_ids=new.eos_token_ids,
                next_prompt_logprob_idx=next_prompt_logprob_idx,
                grammar=self._matcher(new.grammar, new.token_ids[new.num_prompt_tokens :]),
                thinking=_budget_state(new.thinking, new.token_ids[new.num_prompt_tokens :]),
            )
        for cached in sched.cached_reqs:
            if not any(cached.new_block_ids):  # most steps of a running request
                continue
            tables = self.requests[cached.req_id].block_ids
            for g, new_ids in enumerate(cached.new_block_ids):
                if new_ids:
                    tables.extend(g, new_ids)

    def _matcher(self, grammar: object | None, outputs: list[int]) -> GrammarMatcher | None:
        """A request's matcher, advanced over the outputs it already has (a resumed request)."""
        if grammar is None:
            return None
        if isinstance(grammar, GrammarSource):  # compiled in another process
            grammar = self._compile_here(grammar)
        assert isinstance(grammar, CompiledGrammar)
        matcher = grammar.matcher()
        matcher.accept(outputs)
        return matcher

    def _compile_here(self, source: GrammarSource) -> CompiledGrammar:
        """A format from another process (the engine's, for a tensor-parallel rank or the core's
        own process) compiled again here, once per format (~6 ms at 262k tokens). The first
        also loads the tokenizer and builds llguidance's, in this step: ~3 s at 262k tokens."""
        if self._grammar_compiler is None:
            config = self.model.config
            assert config.source is not None
            self._grammar_compiler = GrammarCompiler(
                load_tokenizer(config.source.path, config.architecture),
                source.vocab_size,
                source.eos_token_ids,
                source.json_number_digits,
            )
        return self._grammar_compiler.compile_source(source)

    # ---- sampling -----------------------------------------------------------------------

    def _sample(
        self,
        req_ids: list[str],
        drafts_of: dict[str, list[int]],
        logits: torch.Tensor,
        out: RunnerOutput,
    ) -> RunnerOutput:
        """Sample every logits row (each request's 1 + K rows in order, K its drafts in
        ``drafts_of``) and append the accepted tokens to the requests."""
        requests = self.requests
        states = [requests[rid] for rid in req_ids]
        reuse_rows = not drafts_of and not self._drafts
        rows: list[SamplingRow] = []
        constrained = False  # a grammar or a thinking budget among them
        for rid, state in zip(req_ids, states):
            if state.grammar is not None or state.thinking is not None:
                constrained = True
            if reuse_rows and state.plain_row is not None:
                rows.append(state.plain_row)  # what _sampling_rows would return
            else:
                rows += self._sampling_rows(rid, drafts_of.get(rid, []))
        bitmask = self._token_bitmask(req_ids, drafts_of, len(rows)) if constrained else None
        token_ids, logprobs = self.sampler(logits, rows, bitmask)
        sampled = out.sampled_token_ids
        if len(rows) == len(states) and not constrained and logprobs.count(None) == len(rows):
            # Most steps: a row a request, no matcher to advance, no log-probs (one pass).
            for rid, state, token_id in zip(req_ids, states, token_ids):
                state.token_ids.append(token_id)
                sampled[rid] = [token_id]
        else:
            self._accept(req_ids, drafts_of, states, token_ids, logprobs, out)
        # Proposals for the next step: only in small batches (EngineArgs.speculative_max_batch).
        if self.proposer is not None and len(req_ids) <= self.speculative_max_batch:
            self._propose(self.proposer, req_ids, out)
        return out

    @staticmethod
    def _accept(
        req_ids: list[str],
        drafts_of: dict[str, list[int]],
        states: list[RequestState],
        token_ids: list[int],
        logprobs: list[SampledLogprobs | None],
        out: RunnerOutput,
    ) -> None:
        """Each request's picks from its rows (``token_ids``): the accepted drafts and the
        pick after them, appended to it and its matcher, with their log-probs."""
        i = 0
        for rid, state in zip(req_ids, states):
            drafts = drafts_of.get(rid)
            if drafts:
                num_rows = len(drafts) + 1
                new = accept_drafts(token_ids[i : i + num_rows], drafts)
                state.token_ids += new
            else:
                num_rows, new = 1, [token_ids[i]]
                state.token_ids.append(token_ids[i])
            if state.grammar is not None:
                state.grammar.accept(new)
            if state.thinking is not None:
                state.thinking.accept(new)
            out.sampled_token_ids[rid] = new
            if logprobs[i] is not None:  # a request's rows have log-probs, or none do
                out.logprobs[rid] = _concat_logprobs(logprobs[i : i + len(new)])
            i += num_rows

    def _propose(self, proposer: Proposer, req_ids: list[str], out: RunnerOutput) -> None:
        asked = []
        for rid in req_ids:
            state = self.requests[rid]
            if state.sampling_params.speculative:
                asked.append(
                    DraftRequest(
                        rid,
                        state.token_ids,
                        state.num_prompt_tokens,
                        state.sampling_params,
                        state.generator,
                    )
                )
        if not asked:
            return
        for rid, draft in proposer.propose(asked).items():
            out.draft_token_ids[rid] = draft.token_ids
            if draft.probs is not None:
                self._drafts[rid] = draft

    def _sampling_rows(self, req_id: str, drafts: list[int]) -> list[SamplingRow]:
        """The 1 + K rows of a request: row j predicts the token after its known tokens and
        ``drafts[:j]``, and verifies ``drafts[j]`` against the draft distribution it came from
        (when the proposal had one)."""
        state = self.requests[req_id]
        proposal = self._drafts.pop(req_id, None) if self._drafts else None
        params = state.sampling_params
        if not drafts and not params.min_tokens and not params.has_penalties:
            # The common row reads nothing that changes between steps: made once, reused
            # (building rows was ~5 us a request a step, 1.3 ms at 256 requests).
            if state.plain_row is None:
                state.plain_row = SamplingRow(params, [], [], state.generator, state.eos_token_ids)
            return [state.plain_row]
        q = None
        if proposal is not None and drafts:
            # The scheduler sends a prefix of the proposal (its token budget may cut it).
            assert proposal.token_ids[: len(drafts)] == drafts
            q = proposal.probs
        # The sampler reads a row's tokens only for penalties, and their count for min_tokens:
        # copying a long context's lists for every row of every step cost ~25 us a row.
        n = state.num_prompt_tokens
        prompt = state.token_ids[:n] if params.has_penalties else []
        outputs = state.token_ids[n:] if params.has_penalties or params.min_tokens else []
        rows = []
        for j in range(len(drafts) + 1):
            row = SamplingRow(
                params=state.sampling_params,
                prompt_token_ids=prompt,
                output_token_ids=outputs + drafts[:j] if j else outputs,
                generator=state.generator,
                eos_token_ids=state.eos_token_ids,
            )
            if q is not None and j < len(drafts):
                row.draft_token_id, row.draft_probs = drafts[j], q[j]
            rows.append(row)
        return rows

    def _token_bitmask(
        self, req_ids: list[str], drafts_of: dict[str, list[int]], num_rows: int
    ) -> tuple[torch.Tensor, list[int]] | None:
        """The allowed tokens of every row of the constrained requests (None if there are
        none): a structured-output grammar's, or the one token a spent thinking budget makes
        the request write next.

        Row j of a request is filled after its drafts[:j] advanced its matcher, which then
        rolls back. A draft the grammar refuses is not allowed in its row, so it is rejected
        there; the rows after it are dropped whatever they sample."""
        constrained = [
            (i, rid, drafts)
            for i, (rid, drafts) in _row_starts(req_ids, drafts_of)
            if self.requests[rid].grammar is not None or self.requests[rid].thinking is not None
        ]
        if not constrained:
            return None
        buf = self._bitmask_buffer
        if buf is None or buf.shape[0] < num_rows:
            buf = self._bitmask_buffer = allocate_bitmask(num_rows, self.model.config.vocab_size)
        bitmask, masked = buf[:num_rows], []
        for start, rid, drafts in constrained:
            matcher = self.requests[rid].grammar
            if matcher is None:
                masked += self._budget_rows(bitmask, start, rid, drafts)
                continue
            advanced = 0
            for j in range(len(drafts) + 1):
                fill_row(bitmask, start + j, matcher)
                masked.append(start + j)
                if j == len(drafts) or not matcher.accept([drafts[j]]):
                    break
                advanced += 1
            matcher.rollback(advanced)
        return bitmask, masked

    def _budget_rows(
        self, bitmask: torch.Tensor, start: int, req_id: str, drafts: list[int]
    ) -> list[int]:
        """The rows of a request whose thinking budget forces a token: only that token."""
        budget = self.requests[req_id].thinking
        assert budget is not None
        if drafts:
            budget = budget.copy()
        masked = []
        for j in range(len(drafts) + 1):
            forced = budget.forced_token()
            if forced is not None:
                allow_only(bitmask, start + j, forced)
                masked.append(start + j)
            if j < len(drafts):
                budget.accept([drafts[j]])
        return masked

    def _forget_draft(self, req_id: str, output_token_ids: list[int] | None) -> None:
        self._drafts.pop(req_id, None)
        if self.proposer is not None:
            self.proposer.finish(req_id, output_token_ids)

    def _prompt_logprobs(self, hidden: torch.Tensor, rows: PromptLogprobRows) -> PromptLogprobs:
        state = self.requests[rows.req_id]
        end = rows.first_pos + rows.num_rows
        k = state.sampling_params.prompt_logprobs
        assert k is not None
        out = compute_prompt_logprobs(
            hidden[rows.row_idx : rows.row_idx + rows.num_rows],
            self.model.compute_logits,
            state.token_ids[rows.first_pos : end],
            k,
            rows.first_pos,
        )
        state.next_prompt_logprob_idx = end
        return out

    def _pool(self, hidden: torch.Tensor, rows: PoolingRows) -> list[float] | None:
        """An embedding request's chunk pooled into its state (pooling.py); its vector once the
        chunk ends its prompt, else None."""
        state = self.requests[rows.req_id]
        pooling = state.sampling_params.pooling
        assert pooling is not None
        h = hidden[rows.row_idx : rows.row_idx + rows.num_rows].float()
        if pooling.method == "mean":
            part = h.sum(dim=0)
            state.pooled = part if state.pooled is None else state.pooled + part
        elif pooling.method == "cls" and rows.first_pos == 0:
            state.pooled = h[0]
        if not rows.ends_prompt:
            return None
        if pooling.method == "last":
            vector = h[-1]
        else:
            assert state.pooled is not None  # every position ran: no prefix-cache hits
            vector = state.pooled / state.num_prompt_tokens if pooling.method == "mean" else (
                state.pooled)  # fmt: skip
        if pooling.normalize:
            vector = torch.nn.functional.normalize(vector, dim=0)
        return vector.cpu().tolist()

    # ---- decode graphs and buffers ------------------------------------------------------

    def _decode_graph_step(self, sched: SchedulerOutput) -> torch.Tensor | None:
        """Logits of a step of decodes only (each its next token and any drafts, every row
        sampled) through a decode graph of one row per query; None when the step is not one
        (it then runs eagerly)."""
        graphs = self.cuda_graphs or self.decode_graphs
        scheduled = sched.num_scheduled_tokens
        if graphs is None or not scheduled or not graphs.runs(sum(scheduled.values())):
            return None
        num_computed = sched.num_computed_tokens()
        drafts_of = sched.draft_token_ids
        requests = self.requests
        ids: list[int] = []
        positions: list[int] = []
        row_tables: list[BlockTables] = []  # each row's request's tables
        pending: list[tuple[int, int]] = []  # (row, pick) of the launched step's picks
        for rid, n in scheduled.items():
            state, p = requests[rid], num_computed[rid]
            token_ids = state.token_ids
            # A decode runs its last known token (so no prompt log-prob is owed: the token it
            # predicts is an output); else a prompt chunk, or a one-token prompt to embed.
            if p + 1 != len(token_ids):
                return None
            if p < state.num_prompt_tokens and state.sampling_params.pooling is not None:
                return None  # an embedding's last prompt token (outputs never follow one)
            token = token_ids[p]
            if token < 0:  # a placeholder (pending_token): the launched step's pick
                pending.append((len(ids), -1 - token))
            ids.append(token)
            drafts = drafts_of.get(rid) if drafts_of else None
            if n == 1 and not drafts:  # the common row: one token, no drafts
                positions.append(p)
                row_tables.append(state.block_ids)
                continue
            if not drafts or n != 1 + len(drafts):
                return None  # a query of several known tokens
            ids += drafts
            positions += range(p, p + n)
            row_tables += [state.block_ids] * n
        # Every row's tables as far as the furthest row reaches, then its K/V's slot in each
        # group's: numpy over all rows at once. Entries before a row's window or past its
        # position count for no query: the kernels start at its window and stop at its length
        # (torch's attention masks them).
        bs = self.block_size
        pos = np.array(positions)
        cols = int(pos.max()) // bs + 1
        tables = self._row_tables.take(row_tables, cols)  # [groups, rows, cols]
        slots = tables[:, np.arange(len(ids)), pos // bs] * bs + pos % bs  # [groups, rows]
        return graphs.step(ids, pos, slots, tables, self._pending_ids(pending))

    def _pending_ids(self, rows: list[tuple[int, int]]) -> PendingIds | None:
        """Where a step's input ids take the picks of the step launched before it."""
        if not rows:
            return None
        # Only the latest launched step can still have placeholders: the engine collects a
        # step before it launches the one after the next.
        sampled = self._launched[-1].sampled
        return PendingIds([r for r, _ in rows], [pick for _, pick in rows], sampled)

    def _logits_out(self, rows: torch.Tensor) -> torch.Tensor | None:
        """A [rows, vocab] view of the reused logits buffer (float32 models), valid until the
        next step: the sampler consumes the logits within this one."""
        if rows.dtype != torch.float32:
            return None
        graphs = self.decode_graphs
        if graphs is not None and rows.shape[0] <= graphs.max_batch and rows.device.type == "cpu":
            # The decode graphs' own buffer: one step runs at a time, so eager steps may use it
            # too (a second [rows, vocab] buffer would double the step buffers).
            return graphs.logits[: rows.shape[0]]
        vocab = self.model.config.vocab_size
        buf = self._logits_buffer
        if buf is None or buf.shape[0] < rows.shape[0] or buf.device != rows.device:
            buf = self._logits_buffer = torch.empty(rows.shape[0], vocab, device=rows.device)
        return buf[: rows.shape[0]]

    def _gather_workspace(self, num_blocks: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        if num_blocks == 0:
            return None
        bufs = self._gather_buffers
        if bufs is None or bufs[0].shape[0] < num_blocks:
            rows = max(num_blocks, 2 * (bufs[0].shape[0] if bufs else 0))  # amortized growth
            k_cache = self.kv_caches[0][0]
            # The largest block of any layer (Gemma 4's differ): smaller ones use its prefix.
            shape = (rows, max(caches[0][0].numel() for caches in self.kv_caches))
            kw = dict(dtype=k_cache.dtype, device=self.device)
            bufs = (torch.empty(shape, **kw), torch.empty(shape, **kw))
            self._gather_buffers = bufs
        return bufs


def accept_drafts(sampled: list[int], drafts: list[int]) -> list[int]:
    """The new tokens of a request: its sampled rows up to and including the first whose draft
    differs from the sample (all of them when every draft matched).

    Row j was sampled from the model given the known tokens and drafts 0..j-1, so while the
    drafts match, each kept token is exactly what plain decoding could have drawn at its
    position: lossless for every sampling setting. A row that verified a draft model's token
    by rejection sampling (worker/sampler.py) returns the draft itself when it is kept, and a
    token the draft never is (drawn from max(0, p - q)) when it is not."""
    num_accepted = 0
    while num_accepted < len(drafts) and sampled[num_accepted] == drafts[num_accepted]:
        num_accepted += 1
    return sampled[: num_accepted + 1]


def _row_starts(req_ids: list[str], drafts_of: dict[str, list[int]]):
    """(first logits row, (request, drafts)) of each request: 1 + K rows each, in order."""
    start = 0
    for rid in req_ids:
        drafts = drafts_of.get(rid, [])
        yield start, (rid, drafts)
        start += 1 + len(drafts)


def _budget_state(budget: ThinkingBudget | None, outputs: list[int]) -> BudgetState | None:
    """A request's thinking budget, advanced over the outputs it already has (a resumed
    request)."""
    if budget is None:
        return None
    state = budget.state()
    state.accept(outputs)
    return state


def _concat_logprobs(parts: list[SampledLogprobs]) -> SampledLogprobs:
    if len(parts) == 1:
        return parts[0]
    return SampledLogprobs(
        sampled=[s for p in parts for s in p.sampled], top=[t for p in parts for t in p.top]
    )


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zeroed KV tensor. Zeroed, not empty: padded decode slots are masked, but NaN garbage
    would leak through the softmax-weighted sum (0 * NaN = NaN).

    On CPU it is an anonymous mmap of its own, whose pages the OS zeroes lazily on first touch:
    a large cache costs nothing until it is used (torch.zeros writes every page up front).
    NOTE: not numpy's calloc: where glibc placed that depended on what was allocated and freed
    before (the loader's temporaries), and a 1,024-token prefill's K/V writes measured 2-3x
    slower (~50 ms) in one placement than in another; mmap'd pages cost the same every time.
    """
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = int(np.prod(shape)) * torch.empty((), dtype=dtype).element_size()
    region = np.frombuffer(mmap.mmap(-1, max(nbytes, 1)), dtype=np.uint8, count=nbytes)
    return torch.from_numpy(region).view(dtype).view(shape)
