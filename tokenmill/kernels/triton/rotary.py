"""Rotate-half ("neox") RoPE of q and k in place: one program per (token, head)."""

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
