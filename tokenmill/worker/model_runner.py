"""ModelRunner: owns the model, the paged KV cache and per-request token state on the worker side.

Each step it receives a SchedulerOutput, lays all scheduled tokens of all requests out flat
(decodes first, then prefill chunks), runs one forward pass, computes logits only for requests
whose last known token was run, and samples their next token. Requests that asked for prompt
log-probs also get logits at the prompt positions of their chunk (a slice of rows at a time).
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass

import numpy as np
import torch

from tokenmill.attention import (
    AttentionMetadata,
    ForwardBatch,
    PrefillSeq,
    is_quantized_kv,
    kv_bytes_per_token,
    kv_storage_dtype,
)
from tokenmill.config import ModelConfig
from tokenmill.core.sched_output import PromptLogprobs, RunnerOutput, SchedulerOutput
from tokenmill.models.base import CausalLM
from tokenmill.sampling_params import SamplingParams
from tokenmill.worker.decode_graph import DecodeGraphs
from tokenmill.worker.sampler import Sampler, SamplingRow, compute_prompt_logprobs

logger = logging.getLogger(__name__)

# Decode steps of up to this many requests (and max_num_seqs) replay a recorded graph
# (worker/decode_graph.py); each size is recorded once, at its first step.
DECODE_GRAPH_MAX_BATCH = 128


@dataclass(slots=True)
class RunnerRequestState:
    token_ids: list[int]  # prompt + outputs known to the worker
    num_prompt_tokens: int
    sampling_params: SamplingParams
    block_ids: list[int]
    generator: torch.Generator | None
    # The next prompt position whose log-prob is owed (with SamplingParams.prompt_logprobs).
    next_prompt_logprob_idx: int = 1


@dataclass(frozen=True, slots=True)
class PromptLogprobRows:
    """Rows of the flat batch whose logits give one request's prompt log-probs: row
    ``row_idx + i`` runs position ``first_pos - 1 + i`` and so predicts prompt token
    ``first_pos + i``."""

    req_id: str
    row_idx: int
    first_pos: int
    num_rows: int


def kv_bytes_per_block(
    config: ModelConfig, block_size: int, dtype: torch.dtype, kv_cache_dtype: str = "auto"
) -> int:
    """Bytes of one block over all layers: K and V (and their scales, if quantized)."""
    per_token = kv_bytes_per_token(
        config.num_key_value_heads, config.head_dim, kv_cache_dtype, dtype
    )
    return per_token * block_size * config.num_hidden_layers


class ModelRunner:
    def __init__(
        self,
        model: CausalLM,
        num_blocks: int,
        block_size: int,
        device: torch.device,
        dtype: torch.dtype,
        eos_token_ids: tuple[int, ...],
        seed: int = 0,
        kv_cache_dtype: str = "auto",
        max_model_len: int | None = None,
        decode_graphs: bool = False,
        max_num_seqs: int = DECODE_GRAPH_MAX_BATCH,
        capture_warm_up: threading.Thread | None = None,
    ) -> None:
        c = model.config
        self.model = model
        self.device = device
        self.block_size = block_size
        self.eos_token_ids = eos_token_ids
        self.kv_cache_dtype = kv_cache_dtype
        storage_dtype = kv_storage_dtype(kv_cache_dtype, dtype)
        shape = (num_blocks, block_size, c.num_key_value_heads, c.head_dim)
        self.kv_caches = [
            (_zeros(shape, storage_dtype, device), _zeros(shape, storage_dtype, device))
            for _ in range(c.num_hidden_layers)
        ]
        if is_quantized_kv(kv_cache_dtype):
            # Per layer K, V, K scales, V scales: [num_blocks, block_size, num_kv_heads] float32.
            scale_shape = shape[:-1]
            self.kv_caches = [
                (
                    *kv,
                    _zeros(scale_shape, torch.float32, device),
                    _zeros(scale_shape, torch.float32, device),
                )
                for kv in self.kv_caches
            ]
        self.sampler = Sampler(device, seed, model.kernels)
        # Decode attention gathers each layer's K/V blocks into these (grown on demand).
        self._gather_buffers: tuple[torch.Tensor, torch.Tensor] | None = None
        self._block_elems = block_size * c.num_key_value_heads * c.head_dim
        self._cache_dtype = storage_dtype
        self.requests: dict[str, RunnerRequestState] = {}
        # Generators of preempted requests, handed back when they resume.
        self._parked_generators: dict[str, torch.Generator | None] = {}
        # Prompt log-probs already sent for preempted requests: their recompute sends no repeats.
        self._parked_prompt_logprob_idx: dict[str, int] = {}
        # One logits buffer for every step, grown to the largest batch seen: a fresh [32, 262k]
        # float32 tensor each step cost ~10 ms of page faults (over 32 MB, malloc maps anew).
        self._logits_buffer: torch.Tensor | None = None
        self.decode_graphs: DecodeGraphs | None = None
        if decode_graphs:
            max_len = max_model_len or c.max_position_embeddings
            self.decode_graphs = DecodeGraphs(
                model,
                self.kv_caches,
                block_size,
                -(-max_len // block_size),
                min(DECODE_GRAPH_MAX_BATCH, max_num_seqs),
                capture_warm_up,
            )

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> RunnerOutput:
        self._update_states(sched)
        if sched.is_empty:
            return RunnerOutput(sampled_token_ids={})
        out = RunnerOutput(sampled_token_ids={})
        graph_logits = self._decode_graph_step(sched)
        if graph_logits is not None:
            return self._sample(list(sched.num_scheduled_tokens), graph_logits, out)
        input_ids, positions, attn, sample_req_ids, sample_idx, prompt_rows = self._prepare(sched)
        fwd = ForwardBatch(self.kv_caches, attn)
        hidden = self.model(input_ids, positions, fwd)
        for rows in prompt_rows:
            out.prompt_logprobs[rows.req_id] = self._prompt_logprobs(hidden, rows)
        if not sample_req_ids:
            return out
        rows = hidden.index_select(0, sample_idx)
        logits = self.model.compute_logits(rows, self._logits_out(rows))
        return self._sample(sample_req_ids, logits, out)

    def _logits_out(self, rows: torch.Tensor) -> torch.Tensor | None:
        """A [rows, vocab] view of the reused logits buffer (float32 models), valid until the
        next step: the sampler consumes the logits within this one."""
        if rows.dtype != torch.float32:
            return None
        vocab = self.model.config.vocab_size
        buf = self._logits_buffer
        if buf is None or buf.shape[0] < rows.shape[0] or buf.device != rows.device:
            buf = self._logits_buffer = torch.empty(rows.shape[0], vocab, device=rows.device)
        return buf[: rows.shape[0]]

    def _sample(
        self, sample_req_ids: list[str], logits: torch.Tensor, out: RunnerOutput
    ) -> RunnerOutput:
        rows = [self._sampling_row(rid) for rid in sample_req_ids]
        token_ids, logprobs = self.sampler(logits, rows)
        for rid, tok, lp in zip(sample_req_ids, token_ids, logprobs):
            self.requests[rid].token_ids.append(tok)
            out.sampled_token_ids[rid] = [tok]
            if lp is not None:
                out.logprobs[rid] = lp
        return out

    def _decode_graph_step(self, sched: SchedulerOutput) -> torch.Tensor | None:
        """Logits of a step of decodes only, each sampling, through a decode graph; None when
        the step is not one (it then runs eagerly)."""
        graphs, scheduled = self.decode_graphs, sched.num_scheduled_tokens
        if graphs is None or not graphs.runs(len(scheduled)) or len(scheduled) == 0:
            return None
        if any(n != 1 for n in scheduled.values()):
            return None
        num_computed = _num_computed(sched)
        bs = self.block_size
        ids, positions, slots, tables, seq_lens = [], [], [], [], []
        for rid in scheduled:
            state, p = self.requests[rid], num_computed[rid]
            if p + 1 != len(state.token_ids) or self._prompt_logprob_rows(rid, 0, p, 1):
                return None  # a prompt token: no sample, or prompt log-probs owed
            ids.append(state.token_ids[p])
            positions.append(p)
            slots.append(self._slot(state, p))
            tables.append(state.block_ids[: p // bs + 1])
            seq_lens.append(p + 1)
        return graphs.step(ids, positions, slots, tables, seq_lens)

    def _update_states(self, sched: SchedulerOutput) -> None:
        for rid in sched.finished_req_ids:
            self.requests.pop(rid, None)
            self._parked_generators.pop(rid, None)
            self._parked_prompt_logprob_idx.pop(rid, None)
        for rid in sched.preempted_req_ids:
            state = self.requests.pop(rid, None)
            if state is not None:
                self._parked_generators[rid] = state.generator
                self._parked_prompt_logprob_idx[rid] = state.next_prompt_logprob_idx
        for new in sched.new_reqs:
            generator = self._parked_generators.pop(new.req_id, None)
            if generator is None and new.sampling_params.seed is not None:
                generator = torch.Generator(device=self.device)
                generator.manual_seed(new.sampling_params.seed)
            self.requests[new.req_id] = RunnerRequestState(
                token_ids=list(new.token_ids),
                num_prompt_tokens=new.num_prompt_tokens,
                sampling_params=new.sampling_params,
                block_ids=list(new.block_ids),
                generator=generator,
                next_prompt_logprob_idx=self._parked_prompt_logprob_idx.pop(new.req_id, 1),
            )
        for cached in sched.cached_reqs:
            self.requests[cached.req_id].block_ids.extend(cached.new_block_ids)

    def _prepare(
        self, sched: SchedulerOutput
    ) -> tuple[
        torch.Tensor,
        torch.Tensor,
        AttentionMetadata,
        list[str],
        torch.Tensor,
        list[PromptLogprobRows],
    ]:
        num_computed = _num_computed(sched)
        decodes = [rid for rid, n in sched.num_scheduled_tokens.items() if n == 1]
        prefills = [rid for rid, n in sched.num_scheduled_tokens.items() if n > 1]
        bs = self.block_size
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        sample_req_ids: list[str] = []
        sample_idx: list[int] = []
        # Decodes: one token each at the end of the context.
        max_blocks = 1
        for rid in decodes:
            state, p = self.requests[rid], num_computed[rid]
            ids.append(state.token_ids[p])
            pos.append(p)
            slots.append(self._slot(state, p))
            max_blocks = max(max_blocks, p // bs + 1)
        table = torch.zeros((len(decodes), max_blocks), dtype=torch.long)
        for i, rid in enumerate(decodes):
            blocks = self.requests[rid].block_ids[: num_computed[rid] // bs + 1]
            table[i, : len(blocks)] = torch.tensor(blocks, dtype=torch.long)
        seq_lens = torch.tensor([num_computed[rid] + 1 for rid in decodes], dtype=torch.long)
        # Prefill chunks.
        prefill_seqs: list[PrefillSeq] = []
        for rid in prefills:
            state, start, n = self.requests[rid], num_computed[rid], sched.num_scheduled_tokens[rid]
            seq_len = start + n
            blocks = torch.tensor(state.block_ids[: -(-seq_len // bs)], dtype=torch.long)
            prefill_seqs.append(PrefillSeq(len(ids), n, start, blocks.to(self.device)))
            ids.extend(state.token_ids[start:seq_len])
            chunk_pos = torch.arange(start, seq_len)
            pos.extend(chunk_pos.tolist())
            slots.extend((blocks[chunk_pos // bs] * bs + chunk_pos % bs).tolist())
        # Sample for requests whose last known token runs now (not mid-prompt chunks).
        offset = 0
        prompt_rows: list[PromptLogprobRows] = []
        for rid in decodes + prefills:
            n = sched.num_scheduled_tokens[rid]
            rows = self._prompt_logprob_rows(rid, offset, num_computed[rid], n)
            if rows is not None:
                prompt_rows.append(rows)
            offset += n
            if num_computed[rid] + n == len(self.requests[rid].token_ids):
                sample_req_ids.append(rid)
                sample_idx.append(offset - 1)
        dev = self.device
        attn = AttentionMetadata(
            block_size=bs,
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev),
            num_decodes=len(decodes),
            decode_block_table=table.to(dev),
            decode_seq_lens=seq_lens.to(dev),
            prefills=prefill_seqs,
            gather_buffers=self._gather_workspace(len(decodes) * max_blocks),
        )
        return (
            torch.tensor(ids, dtype=torch.long, device=dev),
            torch.tensor(pos, dtype=torch.long, device=dev),
            attn,
            sample_req_ids,
            torch.tensor(sample_idx, dtype=torch.long, device=dev),
            prompt_rows,
        )

    def _prompt_logprob_rows(
        self, req_id: str, row_idx: int, start: int, num_tokens: int
    ) -> PromptLogprobRows | None:
        """The rows of a request's chunk (positions ``start ..``, flat rows ``row_idx ..``) whose
        next token is a prompt token still owed a log-prob; None if there are none.

        chunk positions:  | sent before a preemption | lo .. hi - 1: ours | P - 1 |
        Position P - 1 (the last prompt token) predicts the first output token: the sampler's row.
        """
        state = self.requests[req_id]
        if state.sampling_params.prompt_logprobs is None:
            return None
        lo = max(start, state.next_prompt_logprob_idx - 1)
        hi = min(start + num_tokens, state.num_prompt_tokens - 1)
        if hi <= lo:
            return None
        return PromptLogprobRows(req_id, row_idx + lo - start, lo + 1, hi - lo)

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

    def _gather_workspace(self, num_blocks: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        if num_blocks == 0:
            return None
        bufs = self._gather_buffers
        if bufs is None or bufs[0].shape[0] < num_blocks:
            rows = max(num_blocks, 2 * (bufs[0].shape[0] if bufs else 0))  # amortized growth
            shape = (rows, self._block_elems)
            kw = dict(dtype=self._cache_dtype, device=self.device)
            bufs = (torch.empty(shape, **kw), torch.empty(shape, **kw))
            self._gather_buffers = bufs
        return bufs

    def _slot(self, state: RunnerRequestState, position: int) -> int:
        """Where the K/V of the token at ``position`` goes in the paged cache."""
        bs = self.block_size
        return state.block_ids[position // bs] * bs + position % bs

    def _sampling_row(self, req_id: str) -> SamplingRow:
        state = self.requests[req_id]
        return SamplingRow(
            params=state.sampling_params,
            prompt_token_ids=state.token_ids[: state.num_prompt_tokens],
            output_token_ids=state.token_ids[state.num_prompt_tokens :],
            generator=state.generator,
            eos_token_ids=self.eos_token_ids,
        )


def _num_computed(sched: SchedulerOutput) -> dict[str, int]:
    """Tokens already in the cache, per scheduled request."""
    num_computed = {r.req_id: r.num_computed_tokens for r in sched.new_reqs}
    num_computed |= {r.req_id: r.num_computed_tokens for r in sched.cached_reqs}
    return num_computed


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zeroed KV tensor. Zeroed, not empty: padded decode slots are masked, but NaN garbage
    would leak through the softmax-weighted sum (0 * NaN = NaN).

    On CPU it comes from numpy's calloc, whose pages the OS zeroes lazily on first touch, so a
    large cache costs nothing until it is used (torch.zeros writes every page up front).
    """
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    elem = torch.empty((), dtype=dtype).element_size()
    raw = np.zeros(int(np.prod(shape)) * elem, dtype=np.uint8)
    return torch.from_numpy(raw).view(dtype).view(shape)
