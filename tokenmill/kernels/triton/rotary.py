"""Rotate-half ("neox") RoPE of q and k in place: one program per (token, head). With QK-norm
(Qwen 3, Gemma 3) one kernel norms and rotates q's and k's heads together: four launches a
layer become one, which at batch 1 on a GPU is what a small model's step is made of."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rope_neox_kernel(
    x_ptr,  # [num_tokens, num_heads, head_dim], rotated in place
    pos_ptr,  # [num_tokens]
    cos_ptr,  # [max_position, head_dim / 2] float32
    sin_ptr,
    stride_xt,
    stride_xh,
    stride_cos,
    half,
    BLOCK: tl.constexpr,
):
    token = tl.program_id(0)
    head = tl.program_id(1)
    cols = tl.arange(0, BLOCK)
    mask = cols < half
    pos = tl.load(pos_ptr + token).to(tl.int64)
    cos = tl.load(cos_ptr + pos * stride_cos + cols, mask=mask, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + pos * stride_cos + cols, mask=mask, other=0.0).to(tl.float32)
    row = x_ptr + token.to(tl.int64) * stride_xt + head * stride_xh
    x1 = tl.load(row + cols, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(row + half + cols, mask=mask, other=0.0).to(tl.float32)
    dtype = x_ptr.dtype.element_ty
    # Both halves are read before either is written: the program owns its row.
    tl.store(row + cols, (x1 * cos - x2 * sin).to(dtype), mask=mask)
    tl.store(row + half + cols, (x2 * cos + x1 * sin).to(dtype), mask=mask)


def rope_neox_(
    x: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    positions: torch.Tensor,  # [num_tokens]
    cos: torch.Tensor,  # [max_position, head_dim / 2]
    sin: torch.Tensor,
) -> torch.Tensor:
    """Rotate x in place where its last dim is dense (views of a fused q/k/v projection are);
    otherwise a rotated copy. Returns the rotated tensor."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    num_tokens, num_heads, head_dim = x.shape
    half = head_dim // 2
    cos, sin = cos.contiguous(), sin.contiguous()
    if num_tokens and num_heads:
        _rope_neox_kernel[(num_tokens, num_heads)](
            x,
            positions.contiguous(),
            cos,
            sin,
            x.stride(0),
            x.stride(1),
            cos.stride(0),
            half,
            BLOCK=triton.next_power_of_2(half),
        )
    return x


@triton.jit
def _qk_norm_rope_kernel(
    q_ptr,  # [num_tokens, num_heads, head_dim], normed and rotated in place
    k_ptr,  # [num_tokens, num_kv_heads, head_dim], the same
    pos_ptr,  # [num_tokens]
    qw_ptr,  # [head_dim]: q's norm weight
    kw_ptr,  # [head_dim]: k's
    cos_ptr,  # [max_position, head_dim / 2] float32
    sin_ptr,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_cos,
    num_heads,
    head_dim,
    weight_offset,
    eps,
    BLOCK: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)  # q's heads, then k's
    if head < num_heads:
        row = q_ptr + token * stride_qt + head * stride_qh
        w_ptr = qw_ptr
    else:
        row = k_ptr + token * stride_kt + (head - num_heads) * stride_kh
        w_ptr = kw_ptr
    half = head_dim // 2
    cols = tl.arange(0, BLOCK)
    mask = cols < head_dim
    first = cols < half
    # Each element's partner in the rotation: the other half's element at the same frequency.
    partner = tl.where(first, cols + half, cols - half)
    freq = tl.where(first, cols, cols - half)
    # The norm as _rmsnorm_kernel computes it (same row, same reduction), rounded to the
    # model's dtype as its output is; then the rotation as _rope_neox_kernel computes it.
    x = tl.load(row + cols, mask=mask, other=0.0).to(tl.float32)
    xp = tl.load(row + partner, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    wp = tl.load(w_ptr + partner, mask=mask, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=0) / head_dim + eps)
    dtype = q_ptr.dtype.element_ty
    y = (x * rstd * (w + weight_offset)).to(dtype).to(tl.float32)
    yp = (xp * rstd * (wp + weight_offset)).to(dtype).to(tl.float32)
    pos = tl.load(pos_ptr + token).to(tl.int64)
    cos = tl.load(cos_ptr + pos * stride_cos + freq, mask=mask, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + pos * stride_cos + freq, mask=mask, other=0.0).to(tl.float32)
    # first half: y1 cos - y2 sin; second half: y2 cos + y1 sin. Every load above comes before
    # this store: the program owns its row.
    out = tl.where(first, y * cos - yp * sin, y * cos + yp * sin)
    tl.store(row + cols, out.to(dtype), mask=mask)


def qk_norm_rope_(
    positions: torch.Tensor,  # [num_tokens]
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim], its last dim dense
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim], the same
    q_weight: torch.Tensor,  # [head_dim]
    k_weight: torch.Tensor,
    weight_offset: float,
    eps: float,
    cos: torch.Tensor,  # [max_position, head_dim / 2]
    sin: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE of rmsnorm(q) and rmsnorm(k) per head, in place, in one launch."""
    num_tokens, num_heads, head_dim = q.shape
    cos, sin = cos.contiguous(), sin.contiguous()
    if num_tokens:
        _qk_norm_rope_kernel[(num_tokens, num_heads + k.shape[1])](
            q,
            k,
            positions.contiguous(),
            q_weight.contiguous(),
            k_weight.contiguous(),
            cos,
            sin,
            q.stride(0),
            q.stride(1),
            k.stride(0),
            k.stride(1),
            cos.stride(0),
            num_heads,
            head_dim,
            float(weight_offset),
            float(eps),
            BLOCK=triton.next_power_of_2(head_dim),
        )
    return q, k
