"""Packed weights computed as they are stored: GGUF block formats (and int4, quant/int4.py).

Activations: ``act_int8`` quantizes each 32-element chunk of x to int8 (llama.cpp's default,
the fast mode) and every batch runs the C kernel, which reads each packed weight once per call
and computes in integers. Without it x stays float32, exact up to rounding: small batches
(decode) run the kernel's float mode, large ones (prefill) expand row tiles to float32 for the
float GEMM, whose cost then dwarfs the expansion. That choice is the kernel backend's
(kernels/cpu_backend.py), passed in by the layer; the torch backend computes the pure-torch
reference (float32 activations).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from tokenmill.quant.base import QuantMethod
from tokenmill.quant.packed import PackedWeight

if TYPE_CHECKING:
    from tokenmill.kernels.base import KernelBackend


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
        self,
        state: PackedState,
        x: torch.Tensor,
        kernels: KernelBackend,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        w = state.weight
        n, k = w.shape
        x2 = x.reshape(-1, k)
        y = kernels.packed_matmul(x2, w, state.bias, self.act_int8, out, state.q8_unsigned)
        if out is not None:
            return y if y is out else out.copy_(y)
        return y.to(x.dtype).reshape(*x.shape[:-1], n)

    def embedding(
        self,
        state: PackedState,
        ids: torch.Tensor,
        kernels: KernelBackend,
        scale: float | None = None,
    ) -> torch.Tensor:
        """Rows ``ids`` of the table in float32 (a packed embedding's lookup), times ``scale``."""
        return kernels.packed_embedding(state.weight, ids, scale)

    def dequantize(self, state: PackedState) -> torch.Tensor:
        return state.weight.dequantize()

    def nbytes(self, state: PackedState) -> int:
        extra = 0 if state.bias is None else state.bias.numel() * 4
        return state.weight.nbytes + extra
