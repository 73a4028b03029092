"""The memory plan: how many KV blocks the worker allocates, and why.

Its log line names every term of the process's memory: on CPU the runtime (what was resident
before loading: the interpreter, torch and what is imported), the weights, the step buffers
(``step_buffer_bytes``) and the KV cache; the tokenizer is the engine's (its loaded line). The
KV cache and the step buffers are anonymous maps whose pages fill as they are written, so
resident memory starts near runtime + weights + tokenizer and grows towards the sum.

The arithmetic is ``plan`` (pure, tested on CPU); the measurements are thin layers over it:

- ``kv_cache_memory`` set: that many bytes, or that fraction of the memory free after loading
  (every device; the explicit override);
- unset on CPU: ``DEFAULT_KV_CACHE_FRACTION`` of the free memory;
- unset on CUDA: what ``gpu_memory_utilization`` of the device leaves::

      | in use after loading (weights, CUDA context, others) | activations' peak | KV cache | rest |
      |<----------------- total * gpu_memory_utilization ----------------------->|

  where the activations' peak is measured on one dummy prefill step of
  ``max_num_batched_tokens`` tokens through the real model (and its logits rows), with a
  temporary KV cache just large enough for it (``dummy_prefill``).
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from dataclasses import dataclass

import torch

from tokenmill.attention import AttentionMetadata, ForwardBatch, PrefillSeq
from tokenmill.attention.recurrent import RecurrentBatch, allocate_states
from tokenmill.config import DEFAULT_KV_CACHE_FRACTION, CacheConfig
from tokenmill.memory import human_bytes
from tokenmill.models.base import CausalLM
from tokenmill.worker.model_runner import allocate_kv_caches


@dataclass(frozen=True, slots=True)
class MemoryPlan:
    """The KV cache's budget and what it was made of (None: not part of this plan)."""

    kv_cache_bytes: int
    kv_bytes_per_block: int
    num_kv_blocks: int  # the null block included
    weight_bytes: int
    basis: str  # "kv_cache_memory" (bytes), "fraction" (of free memory), "gpu_memory_utilization"
    free_bytes: int | None = None  # free after loading (a fraction's base)
    fraction: float | None = None
    total_bytes: int | None = None  # the device's memory (CUDA)
    utilization: float | None = None
    in_use_bytes: int | None = None  # in use on the device after loading
    activation_peak_bytes: int | None = None  # the profiling step's peak above what it began at
    runtime_bytes: int | None = None  # the process's resident memory before loading (CPU)
    buffer_bytes: int | None = None  # step buffers sized from max_num_seqs (step_buffer_bytes)

    @property
    def total_bytes_planned(self) -> int:
        """The terms' sum: on CPU, what the process's resident memory reaches with the KV cache
        and the step buffers full (their pages fill as they are first written)."""
        terms = (self.runtime_bytes, self.weight_bytes, self.activation_peak_bytes,
                 self.buffer_bytes, self.num_kv_blocks * self.kv_bytes_per_block)  # fmt: skip
        return sum(t for t in terms if t is not None)

    def describe(self) -> str:
        """One log line: the runtime, weights, activations, step buffers, the KV cache, their
        sum, and the budget's basis."""
        parts = []
        if self.runtime_bytes is not None:
            parts.append(f"runtime {human_bytes(self.runtime_bytes)}")
        parts.append(f"weights {human_bytes(self.weight_bytes)}")
        if self.activation_peak_bytes is not None:
            parts.append(f"activations peak {human_bytes(self.activation_peak_bytes)}")
        if self.buffer_bytes is not None:
            parts.append(f"step buffers {human_bytes(self.buffer_bytes)}")
        parts.append(
            f"KV cache {human_bytes(self.num_kv_blocks * self.kv_bytes_per_block)} = "
            f"{self.num_kv_blocks} blocks of {human_bytes(self.kv_bytes_per_block)}"
        )
        if self.basis == "gpu_memory_utilization":
            assert self.total_bytes is not None and self.in_use_bytes is not None
            basis = (
                f"gpu_memory_utilization {self.utilization:g} of {human_bytes(self.total_bytes)}, "
                f"{human_bytes(self.in_use_bytes)} in use after loading"
            )
        elif self.basis == "fraction":
            assert self.free_bytes is not None
            basis = f"kv_cache_memory {self.fraction:g} of {human_bytes(self.free_bytes)} free"
        else:
            basis = "kv_cache_memory"
        line = f"memory plan: {', '.join(parts)} ({basis})"
        if self.runtime_bytes is not None:  # CPU: the sum is the process's, pages fill as used
            line += (
                f"; {human_bytes(self.total_bytes_planned)} in all with the KV cache and step "
                "buffers full"
            )
        return line


def plan(
    kv_bytes_per_block: int,
    weight_bytes: int,
    kv_cache_memory: int | float | None,
    *,
    free_bytes: int,
    total_bytes: int | None = None,
    utilization: float = 0.9,
    in_use_bytes: int = 0,
    activation_peak_bytes: int = 0,
    runtime_bytes: int | None = None,
    buffer_bytes: int | None = None,
) -> MemoryPlan:
    """The plan for a parsed ``kv_cache_memory`` (bytes, a fraction, or None) on a device with
    ``free_bytes`` free now; ``total_bytes`` is given on CUDA only, where an unset
    ``kv_cache_memory`` is sized from ``utilization`` of it. ValueError, with the numbers, when
    fewer than 2 blocks fit."""
    common = dict(
        kv_bytes_per_block=kv_bytes_per_block,
        weight_bytes=weight_bytes,
        runtime_bytes=runtime_bytes,
        buffer_bytes=buffer_bytes,
    )
    if isinstance(kv_cache_memory, int):
        budget, hint = kv_cache_memory, "raise kv_cache_memory"
        fields: dict = dict(basis="kv_cache_memory")
    elif kv_cache_memory is not None or total_bytes is None:
        fraction = DEFAULT_KV_CACHE_FRACTION if kv_cache_memory is None else kv_cache_memory
        budget, hint = int(free_bytes * fraction), "raise kv_cache_memory"
        fields = dict(basis="fraction", free_bytes=free_bytes, fraction=fraction)
    else:
        budget = int(total_bytes * utilization) - in_use_bytes - activation_peak_bytes
        hint = (
            "raise gpu_memory_utilization, lower max_num_batched_tokens, or set kv_cache_memory "
            f"({human_bytes(in_use_bytes)} in use after loading, activations peak "
            f"{human_bytes(activation_peak_bytes)}, {utilization:g} of "
            f"{human_bytes(total_bytes)})"
        )
        fields = dict(
            basis="gpu_memory_utilization",
            free_bytes=free_bytes,
            total_bytes=total_bytes,
            utilization=utilization,
            in_use_bytes=in_use_bytes,
            activation_peak_bytes=activation_peak_bytes,
        )
    num_blocks = max(budget, 0) // kv_bytes_per_block
    if num_blocks < 2:
        raise ValueError(
            f"the KV cache budget ({budget} bytes) holds fewer than 2 KV blocks of "
            f"{kv_bytes_per_block} bytes; {hint}"
        )
    return MemoryPlan(kv_cache_bytes=budget, num_kv_blocks=int(num_blocks), **common, **fields)


def step_buffer_bytes(vocab_size: int, max_rows: int) -> int:
    """Bytes of the buffers a runner keeps between steps: one float32 [rows, vocab] logits
    buffer (the decode graphs' where there are graphs, which eager steps share), at most
    ``max_rows`` rows: max_num_seqs times 1 + drafts, and no more than
    max_num_batched_tokens (model_runner.max_logits_rows). Sized from those arguments, not a
    fixed maximum; on CPU its pages fill as rows are used."""
    return max_rows * vocab_size * 4


def dummy_prefill(
    model: CausalLM,
    cache: CacheConfig,
    dtype: torch.dtype,
    device: torch.device,
    num_tokens: int,
    max_model_len: int,
    num_logits: int,
    input_ids: torch.Tensor | None = None,
) -> Callable[[], torch.Tensor]:
    """A step of ``num_tokens`` prompt tokens (sequences of at most ``max_model_len``; token 0,
    or ``input_ids``) and the logits of its last ``num_logits`` rows, as a call that returns
    their log-softmax (benchmarks/kl_divergence.py scores a text so). Its
    temporary KV cache (``cache``'s block size and ``kv_cache_dtype``; block 0 left out as the
    pool does) is allocated now, so the call allocates only the step's activations."""
    bs = cache.block_size
    seq_lens = [max_model_len] * (num_tokens // max_model_len)
    if num_tokens % max_model_len:
        seq_lens.append(num_tokens % max_model_len)
    num_blocks = 1 + sum(-(-n // bs) for n in seq_lens)
    temporary = CacheConfig(bs, num_blocks=num_blocks, kv_cache_dtype=cache.kv_cache_dtype)
    kv_caches = allocate_kv_caches(model.config, temporary, dtype, device)
    # A hybrid model's linear-attention layers: a state slot per sequence.
    states = allocate_states(model.config, len(seq_lens), dtype, device)
    recurrent = RecurrentBatch(
        list(range(len(seq_lens))), seq_lens, 0, torch.zeros(0, dtype=torch.long, device=device)
    )
    positions, slots, prefills = [], [], []
    next_block = 1
    for n in seq_lens:
        blocks = list(range(next_block, next_block + -(-n // bs)))
        next_block += len(blocks)
        prefills.append(
            PrefillSeq(len(positions), n, 0, torch.tensor(blocks, dtype=torch.long, device=device))
        )
        positions.extend(range(n))
        slots.extend(blocks[p // bs] * bs + p % bs for p in range(n))
    long = dict(dtype=torch.long, device=device)
    input_ids = torch.zeros(num_tokens, **long) if input_ids is None else input_ids.to(**long)
    position_ids = torch.tensor(positions, **long)
    slot_mapping = torch.tensor(slots, **long)
    num_logits = max(1, min(num_logits, num_tokens))

    @torch.inference_mode()
    def run() -> torch.Tensor:
        attn = AttentionMetadata(
            block_size=bs,
            slot_mapping=slot_mapping,
            num_decodes=0,
            decode_block_table=torch.zeros((0, 1), **long),
            decode_seq_lens=torch.zeros(0, **long),
            prefills=prefills,
        )
        fwd = ForwardBatch(kv_caches, [attn], states=states, recurrent=recurrent)
        hidden = model(input_ids, position_ids, fwd)
        logits = model.compute_logits(hidden[-num_logits:]).float()  # [num_logits, vocab]
        # The sampler's own [rows, vocab] temporaries: probabilities and their running sum.
        logits.softmax(dim=-1).cumsum(dim=-1)
        return logits.log_softmax(dim=-1)

    return run


def measure_cuda(
    device: torch.device, profile: Callable[[], Callable[[], object]] | None
) -> tuple[int, int, int]:
    """(free, total, activations' peak) bytes of a CUDA device. ``profile`` makes the profiling
    step (None: none, peak 0); the peak is what its call allocates above what was allocated
    before it (not its temporary KV cache, made before), and everything it held is given back to the
    device before free and total are read."""
    peak = 0
    if profile is not None:
        run = profile()
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        run()
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device) - before
        del run
    gc.collect()
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    return int(free), int(total), int(peak)
