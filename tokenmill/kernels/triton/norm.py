"""Fused RMSNorm with an optional residual add: one program per row of the last dim."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rmsnorm_kernel(
    x_ptr,
    w_ptr,
    res_ptr,
    out_ptr,
    inner,  # rows of x's middle dim: row r is x[r // inner, r % inner]
    stride_xa,
    stride_xb,
    dim,
    weight_offset,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)  # row * dim may pass 2^31 in a long prefill
    cols = tl.arange(0, BLOCK)
    mask = cols < dim
    x_row = x_ptr + (row // inner) * stride_xa + (row % inner) * stride_xb
    # NOTE: widen every load to float32 before any arithmetic (bf16 math in the interpreter is
    # wrong, and the torch twin computes in float32 too).
    x = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=0) / dim + eps)
    # Rounded to x's dtype before the residual add, as the twin's ``residual + y.to(x.dtype)``.
    y = (x * rstd * (w + weight_offset)).to(x_ptr.dtype.element_ty)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * dim + cols, mask=mask, other=0.0).to(tl.float32)
        y = y.to(tl.float32) + r
    tl.store(out_ptr + row * dim + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def rmsnorm(
    x: torch.Tensor,  # [..., dim], the last dim dense (q's heads may be a view of qkv)
    weight: torch.Tensor,  # [dim]
    weight_offset: float,
    eps: float,
    residual: torch.Tensor | None = None,  # x's shape
) -> torch.Tensor:
    """residual + x / rms(x) · (weight + weight_offset), a fresh contiguous tensor."""
    dim = x.shape[-1]
    x3 = _rows_view(x)
    out_dtype = x.dtype if residual is None else torch.promote_types(x.dtype, residual.dtype)
    out = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    res = None if residual is None else residual.contiguous()  # x's shape (the backend checks)
    num_rows = x3.shape[0] * x3.shape[1]
    if num_rows:
        _rmsnorm_kernel[(num_rows,)](
            x3,
            weight.contiguous(),
            out if res is None else res,  # unread without a residual
            out,
            x3.shape[1],
            x3.stride(0),
            x3.stride(1),
            dim,
            float(weight_offset),
            float(eps),
            HAS_RESIDUAL=res is not None,
            BLOCK=triton.next_power_of_2(dim),
        )
    return out


def _rows_view(x: torch.Tensor) -> torch.Tensor:
    """x as [a, b, dim] with a dense last dim, without a copy where its strides allow (a
    [tokens, heads, head_dim] view of a fused projection has a row stride per dim)."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    if x.dim() == 1:
        return x.view(1, 1, -1)
    if x.dim() == 2:
        return x.unsqueeze(0).transpose(0, 1)  # [rows, 1, dim]: stride_xa is the row stride
    lead = x.reshape(-1, x.shape[-2], x.shape[-1]) if x.dim() > 3 else x
    return lead
