"""CpuKernelBackend: tokenmill's C kernels (kernels/cpu_library.py) where the inputs fit, the
torch backend otherwise.

Every check of what a kernel takes (float32, contiguous CPU tensors, the shapes it handles, the
packed layouts it reads) lives here, next to the call it guards. A decode step runs ~100 norms
on a few hundred floats each, where torch's dispatch costs more than the arithmetic, and every
kernel call is recorded for decode-step graphs (worker/decode_graph.py).

The packed matmul chooses among three paths: the C kernel (int8 activations at every size, or
float activations below FLOAT_GEMM_MIN_ROWS), row tiles expanded to float32 for torch's float
GEMM (float activations, many rows: prefill), or the torch reference (layouts the kernel does
not read). A mixture-of-experts layer's experts run in one C call on the same terms (int8
activations at every size, float ones below FLOAT_GEMM_MIN_ROWS (token, choice) pairs), else
in the torch twin, which calls packed_matmul per expert.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from tokenmill.kernels import cpu_library as lib
from tokenmill.kernels.torch_backend import TorchKernelBackend
from tokenmill.quant.packed import HALF_KINDS

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
        if w.kind in HALF_KINDS and w.codes.is_contiguous() and w.codes.device.type == "cpu":
            # Halves: the kernel reads each weight once per call; many rows: float GEMM tiles.
            if x.shape[0] < FLOAT_GEMM_MIN_ROWS:
                return lib.half_gemm(x, w, bias, out)
            return _tiled_float_gemm(x.float(), w, bias)
        if not lib.supports(w):
            return super().packed_matmul(x, w, bias, act_int8, out, q8_unsigned)
        if act_int8 or x.shape[0] < FLOAT_GEMM_MIN_ROWS:
            return lib.qgemm(x, w, bias, act_int8, out, q8_unsigned)
        return _tiled_float_gemm(x.float(), w, bias)

    def packed_embedding(
        self, w: PackedWeight, ids: torch.Tensor, scale: float | None
    ) -> torch.Tensor:
        if w.kind in HALF_KINDS and w.codes.is_contiguous() and ids.is_contiguous():
            return lib.half_rows(w, ids, 1.0 if scale is None else scale)
        if lib.supports(w) and ids.is_contiguous():
            return lib.embed_rows(w, ids, 1.0 if scale is None else scale)
        return super().packed_embedding(w, ids, scale)

    def moe_route(
        self, x: torch.Tensor, router: torch.Tensor, top_k: int, renormalize: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        num_experts = router.shape[0]
        if (
            x.dim() == 2
            and router.shape == (num_experts, x.shape[1])
            and 0 < top_k <= num_experts <= lib.MOE_MAX_EXPERTS
            and lib.is_dense_f32(x, router)
        ):
            return lib.moe_route(x, router, top_k, renormalize)
        return super().moe_route(x, router, top_k, renormalize)

    def moe_experts(
        self,
        x: torch.Tensor,
        weights: torch.Tensor,
        ids: torch.Tensor,
        gate_up: PackedWeight,
        down: PackedWeight,
        act: str,
        act_int8: bool,
        counts: torch.Tensor | None = None,
        shared: torch.Tensor | None = None,
        shared_gate: torch.Tensor | None = None,
    ) -> torch.Tensor:
        args = (x, weights, ids, gate_up, down, act, act_int8, counts, shared, shared_gate)
        # Float activations over many rows: packed_matmul's float GEMM would be faster than the
        # kernel; torch's twin (one packed_matmul per expert) takes it.
        if _fits_moe_kernel(*args) and (act_int8 or ids.numel() < FLOAT_GEMM_MIN_ROWS):
            return lib.moe_experts(*args)
        return super().moe_experts(*args)

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


def _fits_moe_kernel(
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    gate_up: PackedWeight,
    down: PackedWeight,
    act: str,
    act_int8: bool,
    counts: torch.Tensor | None,
    shared: torch.Tensor | None,
    shared_gate: torch.Tensor | None,
) -> bool:
    """Whether lib.moe_experts reads these: dense float32 / int64 CPU tensors, and stacked
    weights the packed kernel reads whose experts lie at one stride (contiguous tensors)."""
    if x.dim() != 2 or ids.dim() != 2 or weights.shape != ids.shape or ids.shape[0] != x.shape[0]:
        return False
    hidden, inter = x.shape[1], down.shape[1]
    num_experts = down.shape[0] // hidden
    dense_ints = all(
        t.dtype == torch.int64 and t.device.type == "cpu" and t.is_contiguous()
        for t in (ids, *([counts] if counts is not None else []))
    )
    floats = [x, weights] + ([shared, shared_gate] if shared is not None else [])
    stacked = all(
        t is None or t.is_contiguous()
        for w in (gate_up, down)
        for t in (w.codes, w.scales, w.offsets)
    )
    return (
        act in lib.ACTIVATIONS
        and inter % 8 == 0
        and num_experts > 0
        and gate_up.shape == (num_experts * 2 * inter, hidden)
        and down.shape == (num_experts * hidden, inter)
        and (counts is None or counts.shape == (num_experts,))
        and (shared is None or (shared.shape == x.shape and shared_gate is not None))
        and (shared_gate is None or shared_gate.shape == (hidden,))
        and dense_ints
        and lib.is_dense_f32(*floats)
        and stacked
        and lib.supports(gate_up)
        and lib.supports(down)
    )


def _tiled_float_gemm(x: torch.Tensor, w: PackedWeight, bias: torch.Tensor | None) -> torch.Tensor:
    n, k = w.shape
    rows = max(1, TILE_ELEMENTS // k)
    if w.kind in HALF_KINDS:  # halves widen in torch; the others in the C kernel
        expand = lambda a, b: w.dequantize(slice(a, b))  # noqa: E731
    else:
        expand = functools.partial(lib.dequantize_rows, w)
    if n <= rows:
        return F.linear(x, expand(0, n), bias)
    out = torch.empty(x.shape[0], n, dtype=torch.float32)
    for start in range(0, n, rows):
        end = min(n, start + rows)
        out[:, start:end] = x @ expand(start, end).T
    if bias is not None:
        out += bias
    return out
