"""CpuKernelBackend: tokenmill's C kernels (kernels/cpu_library.py) where the inputs fit, the
torch backend otherwise.

Every check of what a kernel takes (float32, contiguous CPU tensors, the shapes it handles, the
packed layouts it reads) lives here, next to the call it guards. A decode step runs ~100 norms
on a few hundred floats each, where torch's dispatch costs more than the arithmetic, and every
kernel call is recorded for decode-step graphs (worker/decode_graph.py).

The packed matmul chooses among three paths: the C kernel (int8 activations at every size, or
float activations below FLOAT_GEMM_MIN_ROWS), row tiles expanded to float32 for torch's float
GEMM (float activations, many rows: prefill), or the torch reference (layouts the kernel does
not read).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from tokenmill.kernels import cpu_library as lib
from tokenmill.kernels.torch_backend import TorchKernelBackend

if TYPE_CHECKING:
    from tokenmill.quant.packed import PackedWeight

# Rows of float32 x at or above which tiles are expanded to float32 for the float GEMM (the
# kernel's float mode is ahead below). With int8 activations the kernel runs at every size:
# measured on an AVX2 Zen 3 (2 threads, gemma-3-270m's q/k/v, o, gate/up, down) it is 1.6-2.4x
# faster than the float GEMM at 128 rows and 1.1-1.6x at 512 and 1,024.
FLOAT_GEMM_MIN_ROWS = 128
# Float32 elements per expanded tile (~16 MB): the 262k-row head is never expanded whole.
TILE_ELEMENTS = 1 << 22


class CpuKernelBackend(TorchKernelBackend):
    name = "cpu"

    def __init__(self) -> None:
        if not lib.available():
            raise ValueError("the C kernels are not built here or this CPU lacks AVX2/FMA")

    def rmsnorm(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        weight_offset: float,
        eps: float,
        residual: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if (
            x.shape[-1] % 8 == 0
            and lib.has_dense_heads(x)
            and lib.is_dense_f32(weight)
            and (residual is None or lib.is_dense_f32(residual))
        ):
            return lib.rmsnorm(x, weight, weight_offset, eps, residual)
        return super().rmsnorm(x, weight, weight_offset, eps, residual)

    def rotary(
        self,
        positions: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if (
            q.shape[-1] % 16 == 0
            and positions.dtype == torch.int64
            and positions.is_contiguous()
            and lib.has_dense_heads(q)
            and lib.has_dense_heads(k)
            and lib.is_dense_f32(cos, sin)
        ):
            # In place: q and k are fresh projections (or views of one) no one else holds.
            lib.rope_neox_(q, positions, cos, sin)
            lib.rope_neox_(k, positions, cos, sin)
            return q, k
        return super().rotary(positions, q, k, cos, sin)

    def act_and_mul(self, gate_up: torch.Tensor, act: str) -> torch.Tensor:
        d = gate_up.shape[-1] // 2
        if (
            act in lib.ACTIVATIONS
            and gate_up.dim() == 2
            and d % 8 == 0
            and lib.is_dense_f32(gate_up)
        ):
            return lib.act_mul(gate_up, act)
        return super().act_and_mul(gate_up, act)

    def add(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if x.shape == y.shape and lib.is_dense_f32(x, y):
            return lib.add(x, y)
        return x + y

    def embedding(
        self, table: torch.Tensor, ids: torch.Tensor, scale: float | None
    ) -> torch.Tensor:
        ids_fit = ids.dtype == torch.int64 and ids.is_contiguous() and ids.device.type == "cpu"
        if ids_fit and lib.is_dense_f32(table):
            return lib.gather_rows(table, ids, 1.0 if scale is None else scale)
        return super().embedding(table, ids, scale)

    def packed_matmul(
        self,
        x: torch.Tensor,
        w: PackedWeight,
        bias: torch.Tensor | None,
        act_int8: bool,
        out: torch.Tensor | None = None,
        q8_unsigned: bool = False,
    ) -> torch.Tensor:
        if not lib.supports(w):
            return super().packed_matmul(x, w, bias, act_int8, out, q8_unsigned)
        if act_int8 or x.shape[0] < FLOAT_GEMM_MIN_ROWS:
            return lib.qgemm(x, w, bias, act_int8, out, q8_unsigned)
        return _tiled_float_gemm(x.float(), w, bias)

    def packed_embedding(
        self, w: PackedWeight, ids: torch.Tensor, scale: float | None
    ) -> torch.Tensor:
        if lib.supports(w) and ids.is_contiguous():
            return lib.embed_rows(w, ids, 1.0 if scale is None else scale)
        return super().packed_embedding(w, ids, scale)

    def argmax(self, x: torch.Tensor) -> torch.Tensor:
        # torch's CPU argmax is scalar: ~0.4 ms a row over a 262k vocabulary, a few % of a
        # decode step.
        if x.dim() == 2 and lib.is_dense_f32(x):
            out = lib.argmax_rows(x)
            if out is not None:  # None: a row holds a NaN, torch decides
                return out
        return x.argmax(dim=-1)

    def apply_token_bitmask_(
        self, logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]
    ) -> None:
        if not (lib.is_dense_f32(logits) and bitmask.is_contiguous()):
            return super().apply_token_bitmask_(logits, bitmask, rows)
        for row in rows:
            lib.apply_bitmask(logits[row], bitmask[row])


def _tiled_float_gemm(x: torch.Tensor, w: PackedWeight, bias: torch.Tensor | None) -> torch.Tensor:
    n, k = w.shape
    rows = max(1, TILE_ELEMENTS // k)
    if n <= rows:
        return F.linear(x, lib.dequantize_rows(w, 0, n), bias)
    out = torch.empty(x.shape[0], n, dtype=torch.float32)
    for start in range(0, n, rows):
        end = min(n, start + rows)
        out[:, start:end] = x @ lib.dequantize_rows(w, start, end).T
    if bias is not None:
        out += bias
    return out
