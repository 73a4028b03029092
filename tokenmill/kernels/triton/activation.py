"""Gated activations act(gate) * up over gate_up [..., 2d] = [gate | up]."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# The activations by name (torch_backend.ACTIVATIONS) -> the kernel's constexpr code.
ACTIVATION_CODES = {"silu": 0, "gelu": 1, "gelu_tanh": 2}

# constexpr: a compiled kernel may read no other module globals (the interpreter allows it).
_SQRT_2_OVER_PI = tl.constexpr(0.7978845608028654)
_INV_SQRT_2 = tl.constexpr(0.7071067811865476)


@triton.jit
def _act_and_mul_kernel(
    gu_ptr,  # [rows, 2d], rows at stride_gu
    out_ptr,  # [rows, d] contiguous
    d,
    stride_gu,
    ACT: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < d
    gate = tl.load(gu_ptr + row * stride_gu + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gu_ptr + row * stride_gu + d + cols, mask=mask, other=0.0).to(tl.float32)
    # sigmoid and tanh from exp(-|.|) in (0, 1]: no overflow in either tail (tl.math has no
    # tanh on every target).
    if ACT == 0:
        e = tl.exp(-tl.abs(gate))
        a = gate * tl.where(gate >= 0, 1.0 / (1.0 + e), e / (1.0 + e))
    elif ACT == 1:
        a = 0.5 * gate * (1.0 + tl.math.erf(gate * _INV_SQRT_2))
    else:
        z = _SQRT_2_OVER_PI * (gate + 0.044715 * gate * gate * gate)
        e = tl.exp(-2.0 * tl.abs(z))
        t = (1.0 - e) / (1.0 + e)  # tanh(|z|)
        a = 0.5 * gate * (1.0 + tl.where(z >= 0, t, -t))
    tl.store(out_ptr + row * d + cols, (a * up).to(out_ptr.dtype.element_ty), mask=mask)


def act_and_mul(gate_up: torch.Tensor, act: str) -> torch.Tensor:
    """act(gate) * up in gate_up's dtype (computed in float32), [..., d]."""
    code = ACTIVATION_CODES[act]  # KeyError for a name the twin does not know either
    d = gate_up.shape[-1] // 2
    rows = gate_up.reshape(-1, 2 * d)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty((rows.shape[0], d), dtype=gate_up.dtype, device=gate_up.device)
    block = min(1024, triton.next_power_of_2(max(d, 1)))
    if rows.shape[0] and d:
        grid = (rows.shape[0], triton.cdiv(d, block))
        _act_and_mul_kernel[grid](rows, out, d, rows.stride(0), ACT=code, BLOCK=block)
    return out.view(*gate_up.shape[:-1], d)
