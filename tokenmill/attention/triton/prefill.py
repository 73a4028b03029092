"""Prefill / mixed-step attention over the paged cache: FlashAttention-2's online softmax.

One launch serves every prefill chunk of a step. Program (chunk, query block, head) holds
BLOCK_M queries of one head and walks the keys they may see in tiles of BLOCK_N, read from the
chunk's blocks (its new K/V were written to the cache first, so cached context and the chunk
itself are read alike, dequantized for an int8 / fp8 cache)::

    key positions   | outside the window | window of the first query ... | causal end |
                    0                    lo                              hi = last query + 1

Per query row it keeps the running max m, the running sum l of exp(s - m) and the unscaled
output acc; a new tile rescales both by exp(m_old - m_new). Scores use exp2 with
log2(e) folded into the scale. A row that no key of a tile may see yet (the window) has m = -inf;
it is kept at 0 weight instead of exp(-inf - -inf) = NaN.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from tokenmill.attention.metadata import PrefillSeq
from tokenmill.attention.triton.paged import dot, dot_dtype, head_block, load_paged_rows

LOG2E = math.log2(math.e)


@triton.jit
def _prefill_kernel(
    q_ptr,
    out_ptr,
    k_cache_ptr,
    v_cache_ptr,
    k_scale_ptr,
    v_scale_ptr,
    seq_info_ptr,  # [num_chunks, 3] int32: token_start, query_len, num_computed
    block_table_ptr,  # [num_chunks, max_blocks] long
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
    scale_log2e,
    window,
    QUERIES_PER_KV: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    QUANTIZED: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
):
    chunk = tl.program_id(0)
    m_block = tl.program_id(1)
    head = tl.program_id(2)
    token_start = tl.load(seq_info_ptr + chunk * 3)
    query_len = tl.load(seq_info_ptr + chunk * 3 + 1)
    num_computed = tl.load(seq_info_ptr + chunk * 3 + 2)
    if m_block * BLOCK_M >= query_len:  # the grid is sized for the longest chunk
        return
    kv_head = head // QUERIES_PER_KV

    offs_m = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    m_mask = offs_m < query_len
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    q_rows = (token_start + offs_m).to(tl.int64)
    q_off = q_rows[:, None] * stride_q_tok + head * stride_q_head + offs_d[None, :]
    q_io_mask = m_mask[:, None] & d_mask[None, :]
    q = tl.load(q_ptr + q_off, mask=q_io_mask, other=0.0).to(tl.float32)  # [BLOCK_M, BLOCK_D]
    q_pos = num_computed + offs_m

    # The keys any query of this block may see: causal up to its last query, windowed from
    # its first (rounded down to a tile).
    hi = num_computed + tl.minimum((m_block + 1) * BLOCK_M, query_len)
    lo = 0
    if HAS_WINDOW:
        lo = tl.maximum(0, num_computed + m_block * BLOCK_M - window + 1)
        lo = (lo // BLOCK_N) * BLOCK_N
    table_ptr = block_table_ptr + chunk * stride_table

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
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
        s = dot(q, tl.trans(k), DOT_DTYPE) * scale_log2e  # [BLOCK_M, BLOCK_N]
        seen = key_mask[None, :] & (key_pos[None, :] <= q_pos[:, None])
        if HAS_WINDOW:
            seen = seen & (key_pos[None, :] > q_pos[:, None] - window)
        s = tl.where(seen, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + dot(p, v, DOT_DTYPE)
        m_i = m_new

    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    o_off = q_rows[:, None] * stride_o_tok + head * stride_o_head + offs_d[None, :]
    tl.store(out_ptr + o_off, out.to(out_ptr.dtype.element_ty), mask=q_io_mask)


def _tiles(head_dim: int) -> tuple[int, int]:
    """(BLOCK_M, BLOCK_N): 64 x 64 tiles, 32 x 32 for wide heads (Gemma's 256) to stay in
    registers and shared memory."""
    return (64, 64) if head_dim <= 128 else (32, 32)


def prefill_attention(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]: the whole step's queries
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    kv_scales: tuple[torch.Tensor, torch.Tensor] | None,
    prefills: list[PrefillSeq],
    out: torch.Tensor,  # [num_tokens, num_heads, head_dim]: the chunks' rows are written
    scale: float,
    window: int | None,
) -> None:
    """Attend every prefill chunk, causal and within ``window``, in one launch."""
    if not prefills:
        return
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_cache.shape[2]
    assert q.stride(-1) == 1 and out.stride(-1) == 1 and k_cache.stride(-1) == 1
    device = q.device
    # Host-side ints (PrefillSeq's) go over as one small tensor; block tables are padded.
    seq_info = torch.tensor(
        [(s.token_start, s.query_len, s.num_computed) for s in prefills],
        dtype=torch.int32,
    ).to(device, non_blocking=True)
    table = torch.nn.utils.rnn.pad_sequence(
        [s.block_ids.to(device) for s in prefills], batch_first=True
    )
    block_m, block_n = _tiles(head_dim)
    max_query_len = max(s.query_len for s in prefills)
    quantized = kv_scales is not None
    k_scale, v_scale = kv_scales if quantized else (k_cache, v_cache)  # unused when float
    grid = (len(prefills), triton.cdiv(max_query_len, block_m), num_heads)
    _prefill_kernel[grid](
        q,
        out,
        k_cache,
        v_cache,
        k_scale,
        v_scale,
        seq_info,
        table,
        table.stride(0),
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        k_scale.stride(0) if quantized else 0,
        k_scale.stride(1) if quantized else 0,
        scale * LOG2E,
        window or 0,
        QUERIES_PER_KV=num_heads // num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_D=head_block(head_dim),
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_SIZE=k_cache.shape[1],
        HAS_WINDOW=window is not None,
        QUANTIZED=quantized,
        DOT_DTYPE=dot_dtype(q),
    )
