"""Decode attention over the paged cache: PagedAttention v2's split-K.

One query per decode. The context is cut into partitions of PARTITION_SIZE keys; program
(decode, KV head, partition) attends the query heads of one KV head (GQA: the group shares
each K/V tile it loads, padded to 16 rows for tl.dot) to one partition with an online softmax
and writes its partial max, sum and unscaled output. A second kernel, one program per (decode,
head), combines the partitions a sequence has::

    partials m_p, l_p, acc_p  ->  M = max_p m_p
                                  out = sum_p e^(m_p - M) acc_p / sum_p e^(m_p - M) l_p

Nothing reads the host: the grid comes from tensor shapes (num_decodes, the block table's
width), and each program finds its sequence's length on the device, so a CUDA graph can capture
a padded batch. Partitions past a sequence's end (or before its window) do nothing, and are not
read back; a padding row of seq_len 0 has none and gets zeros. A block table that fits one
partition skips the reduce: its program normalizes and writes the output (PagedAttention v1).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from tokenmill.attention.triton.paged import dot, dot_dtype, head_block, load_paged_rows

LOG2E = math.log2(math.e)
PARTITION_SIZE = 512  # keys per program (vLLM's v2 default) once the batch fills the GPU
MIN_PARTITION_SIZE = 64  # a small batch's: more programs share each context
MAX_PARTITIONS = 128  # per sequence: bounds the reduce's work and the partials' memory
FULL_BATCH_PROGRAMS = 128  # (decode, KV head) pairs that keep an H100/H200's 132 SMs busy


def decode_partition_size(num_decodes: int, num_kv_heads: int, max_keys: int) -> int:
    """Keys per decode program for a launch: PARTITION_SIZE when the batch alone has a program
    for every multiprocessor, else as few as MIN_PARTITION_SIZE, so that a small batch's
    context is read by several programs at once (batch 1 at 146 tokens of context ran as one
    program of 5 serial tiles: 13 us a layer on an H200), within MAX_PARTITIONS of
    ``max_keys``."""
    if num_decodes * num_kv_heads >= FULL_BATCH_PROGRAMS:
        return PARTITION_SIZE
    size = triton.next_power_of_2(triton.cdiv(max_keys, MAX_PARTITIONS))
    return min(max(size, MIN_PARTITION_SIZE), PARTITION_SIZE)


@triton.jit
def _partition_range(seq_len, window, PARTITION_SIZE: tl.constexpr, HAS_WINDOW: tl.constexpr):
    """[first, end) of the partitions holding this sequence's attended keys."""
    first = seq_len * 0  # a tensor like seq_len either way
    if HAS_WINDOW:
        first = tl.maximum(seq_len - window, 0) // PARTITION_SIZE
    return first, tl.cdiv(seq_len, PARTITION_SIZE)


@triton.jit
def _decode_partition_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    k_scale_ptr,
    v_scale_ptr,
    block_table_ptr,  # [num_decodes, max_blocks] long
    seq_lens_ptr,  # [num_decodes] long
    part_max_ptr,  # [num_decodes, num_heads, num_partitions] f32
    part_sum_ptr,
    part_acc_ptr,  # [num_decodes, num_heads, num_partitions, head_dim] f32
    out_ptr,  # [num_decodes, num_heads, head_dim], written here when ONE_PARTITION
    stride_table,
    stride_q_tok,
    stride_q_head,
    stride_o_tok,
    stride_o_head,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_sb,
    stride_ss,
    num_partitions,
    scale_log2e,
    window,
    NUM_HEADS: tl.constexpr,
    QUERIES_PER_KV: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    PARTITION_SIZE: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    QUANTIZED: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    ONE_PARTITION: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    part = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    if not ONE_PARTITION:  # the one partition runs even when empty: it writes the zeros
        first_part, end_part = _partition_range(seq_len, window, PARTITION_SIZE, HAS_WINDOW)
        if (part < first_part) | (part >= end_part):
            return
    lo = part * PARTITION_SIZE
    hi = tl.minimum(lo + PARTITION_SIZE, seq_len)
    if HAS_WINDOW:
        lo = tl.maximum(lo, seq_len - window)  # the query sits at seq_len - 1

    offs_h = tl.arange(0, BLOCK_H)
    h_mask = offs_h < QUERIES_PER_KV
    heads = kv_head * QUERIES_PER_KV + offs_h
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    q_off = seq.to(tl.int64) * stride_q_tok + heads[:, None] * stride_q_head + offs_d[None, :]
    q_mask = h_mask[:, None] & d_mask[None, :]
    q = tl.load(q_ptr + q_off, mask=q_mask, other=0.0).to(tl.float32)  # [BLOCK_H, BLOCK_D]
    table_ptr = block_table_ptr + seq.to(tl.int64) * stride_table

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    for start in range(lo, hi, BLOCK_N):
        key_pos = start + tl.arange(0, BLOCK_N)
        key_mask = key_pos < hi
        k = load_paged_rows(
            k_cache_ptr, k_scale_ptr, table_ptr, key_pos, key_mask, kv_head, offs_d, d_mask,
            stride_cb, stride_cs, stride_ch, stride_sb, stride_ss, BLOCK_SIZE, QUANTIZED,
        )  # fmt: skip
        v = load_paged_rows(
            v_cache_ptr, v_scale_ptr, table_ptr, key_pos, key_mask, kv_head, offs_d, d_mask,
            stride_cb, stride_cs, stride_ch, stride_sb, stride_ss, BLOCK_SIZE, QUANTIZED,
        )  # fmt: skip
        s = dot(q, tl.trans(k), DOT_DTYPE) * scale_log2e  # [BLOCK_H, BLOCK_N]
        s = tl.where(key_mask[None, :], s, float("-inf"))
        # Every tile here holds at least one key (the loop runs only while start < hi), so
        # m_new is finite.
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + dot(p, v, DOT_DTYPE)
        m_i = m_new

    if ONE_PARTITION:  # PagedAttention v1: no reduce; seq_len 0 leaves l = 0, acc = 0
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        o_off = seq.to(tl.int64) * stride_o_tok + heads[:, None] * stride_o_head + offs_d[None, :]
        tl.store(out_ptr + o_off, out.to(out_ptr.dtype.element_ty), mask=q_mask)
    else:
        row = (seq.to(tl.int64) * NUM_HEADS + heads) * num_partitions + part  # [BLOCK_H]
        tl.store(part_max_ptr + row, m_i, mask=h_mask)
        tl.store(part_sum_ptr + row, l_i, mask=h_mask)
        acc_off = row[:, None] * HEAD_DIM + offs_d[None, :]
        tl.store(part_acc_ptr + acc_off, acc, mask=q_mask)


@triton.jit
def _decode_reduce_kernel(
    out_ptr,
    seq_lens_ptr,
    part_max_ptr,
    part_sum_ptr,
    part_acc_ptr,
    stride_o_tok,
    stride_o_head,
    num_partitions,
    window,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_P: tl.constexpr,
    PARTITION_SIZE: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + seq)
    first_part, end_part = _partition_range(seq_len, window, PARTITION_SIZE, HAS_WINDOW)
    base = (seq.to(tl.int64) * NUM_HEADS + head) * num_partitions
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM

    # Pass 1: the largest partial max; pass 2: the partials rescaled to it.
    m_all = tl.full([BLOCK_P], float("-inf"), tl.float32)
    for p0 in range(first_part, end_part, BLOCK_P):
        parts = p0 + tl.arange(0, BLOCK_P)
        m = tl.load(part_max_ptr + base + parts, mask=parts < end_part, other=float("-inf"))
        m_all = tl.maximum(m_all, m)
    m_max = tl.max(m_all, axis=0)
    m_safe = tl.where(m_max == float("-inf"), 0.0, m_max)  # seq_len 0: no partition
    l_sum = tl.zeros([BLOCK_P], tl.float32)
    acc = tl.zeros([BLOCK_D], tl.float32)
    for p0 in range(first_part, end_part, BLOCK_P):
        parts = p0 + tl.arange(0, BLOCK_P)
        p_mask = parts < end_part
        m = tl.load(part_max_ptr + base + parts, mask=p_mask, other=float("-inf"))
        w = tl.exp2(m - m_safe)  # [BLOCK_P]
        l_sum += w * tl.load(part_sum_ptr + base + parts, mask=p_mask, other=0.0)
        a_off = (base + parts)[:, None] * HEAD_DIM + offs_d[None, :]
        a = tl.load(part_acc_ptr + a_off, mask=p_mask[:, None] & d_mask[None, :], other=0.0)
        acc += tl.sum(w[:, None] * a, axis=0)
    total = tl.sum(l_sum, axis=0)
    out = acc / tl.where(total == 0.0, 1.0, total)
    o_off = seq.to(tl.int64) * stride_o_tok + head * stride_o_head + offs_d
    tl.store(out_ptr + o_off, out.to(out_ptr.dtype.element_ty), mask=d_mask)


def decode_attention(
    q: torch.Tensor,  # [num_decodes, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    kv_scales: tuple[torch.Tensor, torch.Tensor] | None,
    block_table: torch.Tensor,  # [num_decodes, max_blocks] long
    seq_lens: torch.Tensor,  # [num_decodes] long, the new token included
    out: torch.Tensor,  # [num_decodes, num_heads, head_dim]
    scale: float,
    window: int | None,
    partition_size: int | None = None,
) -> None:
    """One query per decode against its paged K/V, within ``window``; no host sync.
    ``partition_size``: keys per program (a power of two), by default decode_partition_size's
    for this batch."""
    num_decodes, num_heads, head_dim = q.shape
    if num_decodes == 0:
        return
    _, block_size, num_kv_heads, _ = k_cache.shape
    if partition_size is None:
        max_keys = block_table.shape[1] * block_size
        partition_size = decode_partition_size(num_decodes, num_kv_heads, max_keys)
    assert q.stride(-1) == 1 and out.stride(-1) == 1 and k_cache.stride(-1) == 1
    queries_per_kv = num_heads // num_kv_heads
    block_n = min(64 if head_dim <= 128 else 32, partition_size)
    assert partition_size % block_n == 0 and partition_size & (partition_size - 1) == 0
    num_partitions = triton.cdiv(block_table.shape[1] * block_size, partition_size)
    # Partials of each (decode, head, partition); one partition writes out directly instead
    # (``out`` then stands in for the unused workspace pointers: no empty tensors passed).
    if num_partitions > 1:
        shape = (num_decodes, num_heads, num_partitions)
        part_max = torch.empty(shape, dtype=torch.float32, device=q.device)
        part_sum = torch.empty_like(part_max)
        part_acc = torch.empty(*shape, head_dim, dtype=torch.float32, device=q.device)
    else:
        part_max = part_sum = part_acc = out
    quantized = kv_scales is not None
    k_scale, v_scale = kv_scales if quantized else (k_cache, v_cache)  # unused when float
    common = dict(
        NUM_HEADS=num_heads,
        HEAD_DIM=head_dim,
        BLOCK_D=head_block(head_dim),
        PARTITION_SIZE=partition_size,
        HAS_WINDOW=window is not None,
    )
    _decode_partition_kernel[(num_decodes, num_kv_heads, num_partitions)](
        q,
        k_cache,
        v_cache,
        k_scale,
        v_scale,
        block_table,
        seq_lens,
        part_max,
        part_sum,
        part_acc,
        out,
        block_table.stride(0),
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        k_scale.stride(0) if quantized else 0,
        k_scale.stride(1) if quantized else 0,
        num_partitions,
        scale * LOG2E,
        window or 0,
        QUERIES_PER_KV=queries_per_kv,
        BLOCK_H=max(16, triton.next_power_of_2(queries_per_kv)),
        BLOCK_N=block_n,
        BLOCK_SIZE=block_size,
        QUANTIZED=quantized,
        DOT_DTYPE=dot_dtype(q),
        ONE_PARTITION=num_partitions == 1,
        **common,
    )
    if num_partitions == 1:
        return
    _decode_reduce_kernel[(num_decodes, num_heads)](
        out,
        seq_lens,
        part_max,
        part_sum,
        part_acc,
        out.stride(0),
        out.stride(1),
        num_partitions,
        window or 0,
        BLOCK_P=min(32, triton.next_power_of_2(num_partitions)),
        **common,
    )
