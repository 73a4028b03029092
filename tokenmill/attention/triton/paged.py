"""Device helpers the attention kernels share: reading K/V rows out of the paged cache, and
the launch constants derived from tensors (dtypes, block sizes).

Cache layout (attention/kv_cache.py)::

    payload  [num_blocks, block_size, num_kv_heads, head_dim]  float | int8 | float8_e4m3fn
    scales   [num_blocks, block_size, num_kv_heads]            float32 (quantized caches)

A key at position ``pos`` of a sequence lives in block ``table[pos // block_size]`` at row
``pos % block_size``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# torch dtype -> Triton dtype for the dot products' operands on a GPU.
_DOT_DTYPES = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}


def dot_dtype(q: torch.Tensor) -> tl.dtype:
    """The operand dtype of QK^T and PV: q's dtype on a GPU (the oracle's SDPA computes in it
    too, dequantized K/V rounded to it), float32 on the CPU, where the oracle computes in
    float32 and where the interpreter's 16-bit dot is wrong (measured: garbage for bf16)."""
    if q.device.type != "cuda":
        return tl.float32
    return _DOT_DTYPES[q.dtype]


def head_block(head_dim: int) -> int:
    """The head_dim tile: a power of two of at least 16 (tl.dot's smallest K), masked."""
    return max(16, triton.next_power_of_2(head_dim))


@triton.jit
def dot(a, b, DOT_DTYPE: tl.constexpr):
    """a @ b with float32 accumulation; float32 operands at full (IEEE) precision, not TF32."""
    if tl.float32 == DOT_DTYPE:
        out = tl.dot(a, b, input_precision="ieee")
    else:
        out = tl.dot(a.to(DOT_DTYPE), b.to(DOT_DTYPE))
    return out


@triton.jit
def load_paged_rows(
    cache_ptr,
    scale_ptr,  # the scale cache; unused (any pointer) unless QUANTIZED
    table_ptr,  # this sequence's row of block ids
    key_pos,  # [BLOCK_N] positions in the sequence
    key_mask,  # [BLOCK_N] which positions to read
    kv_head,
    offs_d,  # [BLOCK_D]
    d_mask,
    stride_block,
    stride_slot,
    stride_head,
    scale_stride_block,
    scale_stride_slot,
    BLOCK_SIZE: tl.constexpr,
    QUANTIZED: tl.constexpr,
):
    """[BLOCK_N, BLOCK_D] float32 K or V rows of one KV head, dequantized (payload * scale)
    for an int8 / fp8 cache; masked rows and columns read as 0."""
    block_id = tl.load(table_ptr + key_pos // BLOCK_SIZE, mask=key_mask, other=0).to(tl.int64)
    in_block = (key_pos % BLOCK_SIZE).to(tl.int64)
    rows = block_id * stride_block + in_block * stride_slot + kv_head * stride_head
    mask = key_mask[:, None] & d_mask[None, :]
    # NOTE: converted to float32 before any arithmetic: the interpreter's 16-bit math is not
    # trustworthy (a bf16 add gave NaN), and fp8 / int8 do not promote.
    x = tl.load(cache_ptr + rows[:, None] + offs_d[None, :], mask=mask, other=0.0).to(tl.float32)
    if QUANTIZED:
        scale_off = block_id * scale_stride_block + in_block * scale_stride_slot + kv_head
        scale = tl.load(scale_ptr + scale_off, mask=key_mask, other=0.0)
        x = x * scale[:, None]
    return x
