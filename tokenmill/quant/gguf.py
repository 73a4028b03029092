"""Packed weights computed as they are stored: GGUF block formats (and int4, quant/int4.py).

Activations: ``act_int8`` quantizes each 32-element chunk of x to int8 (llama.cpp's default,
the fast mode) and every batch runs the C kernel, which reads each packed weight once per call
and computes in integers. Without it x stays float32, exact up to rounding: small batches
(decode) run the kernel's float mode, large ones (prefill) expand row tiles to float32 for the
float GEMM, whose cost then dwarfs the expansion. Where the kernel is not built, the pure-torch
reference runs (float32 activations).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tokenmill import kernels
from tokenmill.quant.base import QuantMethod
from tokenmill.quant.packed import PackedWeight, reference_matmul

# Rows of float32 x at or above which tiles are expanded to float32 for the float GEMM (the
# kernel's float mode is ahead below). With int8 activations the kernel runs at every size:
# measured on an AVX2 Zen 3 (2 threads, gemma-3-270m's q/k/v, o, gate/up, down) it is 1.6-2.4x
# faster than the float GEMM at 128 rows and 1.1-1.6x at 512 and 1,024.
FLOAT_GEMM_MIN_ROWS = 128
# Float32 elements per expanded tile (~16 MB): the 262k-row head is never expanded whole.
TILE_ELEMENTS = 1 << 22


@dataclass(slots=True)
class PackedState:
    weight: PackedWeight
    bias: torch.Tensor | None = None
    # With int8 activations, "q8" codes run as unsigned bytes against 7-bit activations
    # (packed.activation_levels): 1.1-1.3x faster at many rows. Set for the output head (the
    # loader), the cost of batched decode, where it measured +0.07% perplexity; layers keep 8 bits.
    q8_unsigned: bool = False


class PackedQuantMethod(QuantMethod):
    """Weights that arrive packed (GGUF) and are computed packed."""

    name = "gguf"

    def __init__(self, act_int8: bool = True) -> None:
        self.act_int8 = act_int8

    def wrap(self, weight: PackedWeight) -> PackedState:
        return PackedState(weight)

    def quantize(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        importance: torch.Tensor | None = None,
    ) -> PackedState:
        raise ValueError("GGUF weights are packed when the file is read, not from floats")

    def apply(
        self, state: PackedState, x: torch.Tensor, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        w = state.weight
        n, k = w.shape
        x2 = x.reshape(-1, k)
        if not kernels.available() or not kernels.supports(w):
            y = reference_matmul(x2, w, state.bias, act_int8=False)
        elif self.act_int8 or x2.shape[0] < FLOAT_GEMM_MIN_ROWS:
            y = kernels.qgemm(x2, w, state.bias, self.act_int8, out, state.q8_unsigned)
        else:
            y = _tiled_float_gemm(x2.float(), w, state.bias)
        if out is not None:
            return y if y is out else out.copy_(y)
        return y.to(x.dtype).reshape(*x.shape[:-1], n)

    def embedding(
        self, state: PackedState, ids: torch.Tensor, scale: float | None = None
    ) -> torch.Tensor:
        """Rows ``ids`` of the table in float32 (a packed embedding's lookup), times ``scale``."""
        w = state.weight
        if kernels.available() and kernels.supports(w) and ids.is_contiguous():
            return kernels.embed_rows(w, ids, 1.0 if scale is None else scale)
        h = w.dequantize(ids.reshape(-1)).reshape(*ids.shape, -1)
        return h if scale is None else h * torch.tensor(scale, dtype=h.dtype)

    def dequantize(self, state: PackedState) -> torch.Tensor:
        return state.weight.dequantize()

    def nbytes(self, state: PackedState) -> int:
        extra = 0 if state.bias is None else state.bias.numel() * 4
        return state.weight.nbytes + extra


def _tiled_float_gemm(x: torch.Tensor, w: PackedWeight, bias: torch.Tensor | None) -> torch.Tensor:
    n, k = w.shape
    rows = max(1, TILE_ELEMENTS // k)
    if n <= rows:
        return F.linear(x, kernels.dequantize_rows(w, 0, n), bias)
    out = torch.empty(x.shape[0], n, dtype=torch.float32)
    for start in range(0, n, rows):
        end = min(n, start + rows)
        out[:, start:end] = x @ kernels.dequantize_rows(w, start, end).T
    if bias is not None:
        out += bias
    return out
