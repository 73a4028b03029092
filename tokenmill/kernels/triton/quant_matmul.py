"""Weight-only dequant-matmul y = x Wᵀ + b over tokenmill's packed weights ("q8", "q4").

Layout (quant/packed.py): w[n, k] = scales[n, k // G] · code[n, k] - offsets[n, k // G], with
each row's codes stored in the C kernel's lane order where K is a multiple of 64. The kernel
walks a row's *stored* codes in tiles, so the weight, the bulk of the bytes, is read densely;
the element index of each stored code (``lane_order``) picks its scale group and the column of
x it meets (x is small and stays in cache). A tile of W is dequantized in registers and fed to
tl.dot, accumulating in float32.

    stored code p, "q8": int8 byte p of the row
    stored code p, "q4": nibble (p // H) % 2 of byte (p // 2H) · H + p % H, with H = 32 in
                         lane order (two 32-code vectors per 32 bytes), else 16 (ggml's Q4_0)
"""

from __future__ import annotations

import os
from functools import lru_cache

import torch
import triton
import triton.language as tl

from tokenmill.quant.packed import PackedWeight, lane_order

# The packed kinds this kernel reads; the backend sends the others to the torch twin.
KINDS = {"q8": 0, "q4": 1}
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _packed_matmul_kernel(
    x_ptr,  # [M, K], rows at stride_xm
    codes_ptr,  # "q8": int8 [N, K]; "q4": uint8 [N, K / 2]
    scales_ptr,  # float32 / float16 [N, K / G]
    offsets_ptr,  # float32 [N, K / G] (read only with HAS_OFFSETS)
    bias_ptr,  # float32 [N] (read only with HAS_BIAS)
    order_ptr,  # int32 [K]: element index of each stored code (read only with LANE)
    out_ptr,  # float32 [M, N], rows at stride_om
    M,
    N,
    K,
    stride_xm,
    stride_cn,
    stride_sn,
    stride_on,
    stride_om,
    GROUP: tl.constexpr,
    KIND: tl.constexpr,
    ZERO: tl.constexpr,  # stored code = code + ZERO (GGUF Q4_0's "q4": 8)
    LANE: tl.constexpr,
    HAS_OFFSETS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    DOT_F32: tl.constexpr,
    EMULATE_DOT: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    rows = (pid_m * BM + tl.arange(0, BM)).to(tl.int64)  # [BM]; rows · N may pass 2^31
    cols = (pid_n * BN + tl.arange(0, BN)).to(tl.int64)  # [BN], output channels
    row_mask = rows < M
    col_mask = cols < N
    half = 32 if LANE else 16  # nibble layout of "q4" (module docstring)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        p = k0 + tl.arange(0, BK)  # [BK] stored positions
        p_mask = p < K
        e = tl.load(order_ptr + p, mask=p_mask, other=0) if LANE else p  # element indices
        x_mask = row_mask[:, None] & p_mask[None, :]
        x = tl.load(x_ptr + rows[:, None] * stride_xm + e[None, :], mask=x_mask, other=0.0)
        w_mask = p_mask[:, None] & col_mask[None, :]  # [BK, BN]: W's tile, transposed
        if KIND == 0:
            c = tl.load(codes_ptr + cols[None, :] * stride_cn + p[:, None], mask=w_mask, other=0)
        else:
            byte = (p // (2 * half)) * half + p % half
            shift = ((p // half) % 2) * 4
            b = tl.load(codes_ptr + cols[None, :] * stride_cn + byte[:, None], mask=w_mask, other=0)
            c = ((b.to(tl.int32) >> shift[:, None]) & 0xF) - ZERO
        g = e // GROUP
        s = tl.load(scales_ptr + cols[None, :] * stride_sn + g[:, None], mask=w_mask, other=0.0)
        w = s.to(tl.float32) * c.to(tl.float32)
        if HAS_OFFSETS:
            o = tl.load(
                offsets_ptr + cols[None, :] * stride_on + g[:, None], mask=w_mask, other=0.0
            )
            w -= o.to(tl.float32)
        if DOT_F32:
            # float32 activations: full-precision products, as the torch twin (no TF32).
            acc += tl.dot(x.to(tl.float32), w, input_precision="ieee")
        elif EMULATE_DOT:
            # NOTE: the interpreter's bf16 tl.dot returns garbage: the same products (W rounded
            # to x's dtype) as float32.
            w16 = w.to(x_ptr.dtype.element_ty).to(tl.float32)
            acc += tl.dot(x.to(tl.float32), w16, input_precision="ieee")
        else:
            # bf16/fp16 activations meet W rounded to their dtype (tensor cores), summed in fp32.
            acc += tl.dot(x, w.to(x_ptr.dtype.element_ty))
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    out_mask = row_mask[:, None] & col_mask[None, :]
    tl.store(out_ptr + rows[:, None] * stride_om + cols[None, :], acc, mask=out_mask)


def supports(w: PackedWeight) -> bool:
    """Whether the kernel reads w's layout (the int8 and int4 methods' kinds, and GGUF's Q8_0,
    Q4_0 and Q4_1, which share them)."""
    parts = [w.codes, w.scales] + ([] if w.offsets is None else [w.offsets])
    return w.kind in KINDS and all(t.stride(-1) == 1 for t in parts)


def packed_matmul(
    x: torch.Tensor,  # [rows, in]
    w: PackedWeight,
    bias: torch.Tensor | None,
    out: torch.Tensor | None = None,
    *,
    block_n: int = 64,
    block_k: int = 64,
) -> torch.Tensor:
    """x Wᵀ + b in float32 [rows, out], into ``out`` where it is a float32 [rows, out] tensor
    with dense rows on x's device. x is read in its dtype: float32 exactly, bf16 / fp16 against
    W rounded to that dtype. ``block_n`` / ``block_k``: a program's tile of W (powers of two,
    16 or more; benchmarks/gpu_quant_matmul.py times them)."""
    m, k = x.shape
    n = w.shape[0]
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        x = x.float()
    if x.stride(-1) != 1:
        x = x.contiguous()
    fits = (
        out is not None
        and out.dtype == torch.float32
        and out.shape == (m, n)
        and out.stride(-1) == 1
        and out.device == x.device
    )
    y = out if fits else torch.empty((m, n), dtype=torch.float32, device=x.device)
    if m == 0 or n == 0:
        return y
    order = _element_index(k, x.device)
    offsets = w.offsets
    block_m = min(64, max(16, triton.next_power_of_2(m)))  # tl.dot takes tiles of 16 or more
    grid = (triton.cdiv(n, block_n), triton.cdiv(m, block_m))
    _packed_matmul_kernel[grid](
        x,
        w.codes,
        w.scales,
        w.scales if offsets is None else offsets,  # unread without offsets
        y if bias is None else bias.contiguous(),  # unread without a bias
        x if order is None else order,  # unread in element order
        y,
        m,
        n,
        k,
        x.stride(0),
        w.codes.stride(0),
        w.scales.stride(0),
        0 if offsets is None else offsets.stride(0),
        y.stride(0),
        GROUP=w.group,
        KIND=KINDS[w.kind],
        ZERO=w.zero,
        LANE=order is not None,
        HAS_OFFSETS=offsets is not None,
        HAS_BIAS=bias is not None,
        DOT_F32=x.dtype == torch.float32,
        EMULATE_DOT=_INTERPRET,
        BM=block_m,
        BN=block_n,
        BK=block_k,
    )
    return y


@lru_cache(maxsize=64)
def _element_index(k: int, device: torch.device) -> torch.Tensor | None:
    """Element index of each stored code of a K-element row (int32, on ``device``), or None
    where rows keep element order."""
    order = lane_order(k)
    return None if order is None else order.to(device=device, dtype=torch.int32)
