"""TritonKernelBackend: the element-wise ops and the weight-only packed matmul as Triton
kernels (kernels/triton/), for CUDA devices; every other op is the torch twin's.

It imports triton, so it loads only when picked (the registry is lazy). Off a GPU the kernels
run only in Triton's interpreter (``TRITON_INTERPRET=1``, the tests' mode); a tensor the kernels
cannot take there (CPU without the interpreter) goes to the torch twin, so a wrong pick is slow,
never wrong.
"""

from __future__ import annotations

import os

import torch

from tokenmill.kernels import torch_int4
from tokenmill.kernels.torch_backend import TorchKernelBackend
from tokenmill.quant.packed import TORCH_INT4_KIND, PackedWeight

try:
    from tokenmill.kernels.triton import activation, norm, quant_matmul, rotary
except ImportError as e:  # create_kernel_backend's ValueError for a backend that cannot run
    raise ValueError(
        'kernel backend "triton" needs the triton package (pip install "tokenmill[cuda]")'
    ) from e

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def _runs(*tensors: torch.Tensor) -> bool:
    """Whether the Triton kernels can take these tensors: on one CUDA device, or on the CPU in
    the interpreter."""
    devices = {t.device for t in tensors}
    if len(devices) != 1:
        return False
    device = next(iter(devices))
    return device.type == "cuda" or (_INTERPRET and device.type == "cpu")


class TritonKernelBackend(TorchKernelBackend):
    """Triton for rmsnorm, rotary (with QK-norm: one fused kernel), act_and_mul and
    packed_matmul ("q8" / "q4" weights; on CUDA a linear layer's "q4" weight runs torch's own
    int4 kernel where it takes it, kernels/torch_int4.py).

    Inherited from the torch twin, on purpose: ``add``, ``embedding`` and ``argmax`` are one
    torch call each, already a single fused CUDA kernel; ``apply_token_bitmask_`` is a gather
    and a where per constrained row; ``moe_route`` is a small softmax and sort; ``moe_experts``
    loops over the active experts and calls this backend's ``packed_matmul`` and
    ``act_and_mul`` (through ``self``), so it runs the Triton kernels anyway;
    ``packed_embedding`` dequantizes a few rows. Another kernel would add launches, not speed.
    """

    name = "triton"

    def rmsnorm(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        weight_offset: float,
        eps: float,
        residual: torch.Tensor | None = None,
    ) -> torch.Tensor:
        tensors = (x, weight) if residual is None else (x, weight, residual)
        if not _runs(*tensors) or (residual is not None and residual.shape != x.shape):
            return super().rmsnorm(x, weight, weight_offset, eps, residual)
        return norm.rmsnorm(x, weight, weight_offset, eps, residual)

    def rotary(
        self,
        positions: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not _runs(positions, q, k, cos, sin) or q.dim() != 3 or k.dim() != 3:
            return super().rotary(positions, q, k, cos, sin)
        # In place: q and k are fresh projections (or views of one) no one else holds.
        return rotary.rope_neox_(q, positions, cos, sin), rotary.rope_neox_(k, positions, cos, sin)

    def qk_norm_rotary(
        self,
        positions: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        q_weight: torch.Tensor,
        k_weight: torch.Tensor,
        weight_offset: float,
        eps: float,
        cos: torch.Tensor,
        sin: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        fused = (
            _runs(positions, q, k, q_weight, k_weight, cos, sin)
            and q.dim() == k.dim() == 3
            and q.dtype == k.dtype
            and q.stride(-1) == k.stride(-1) == 1
            and q.shape[-1] == k.shape[-1] == q_weight.numel() == k_weight.numel()
        )
        if not fused:
            return super().qk_norm_rotary(
                positions, q, k, q_weight, k_weight, weight_offset, eps, cos, sin
            )
        return rotary.qk_norm_rope_(
            positions, q, k, q_weight, k_weight, weight_offset, eps, cos, sin
        )

    def act_and_mul(self, gate_up: torch.Tensor, act: str) -> torch.Tensor:
        if not _runs(gate_up) or act not in activation.ACTIVATION_CODES:
            return super().act_and_mul(gate_up, act)
        return activation.act_and_mul(gate_up, act)

    def prepare_packed(self, w: PackedWeight) -> PackedWeight:
        # torch's int4 kernel where it takes the weight (CUDA): faster than ours at 256 rows.
        return torch_int4.convert(w) or w

    def packed_matmul(
        self,
        x: torch.Tensor,
        w: PackedWeight,
        bias: torch.Tensor | None,
        act_int8: bool,
        out: torch.Tensor | None = None,
        q8_unsigned: bool = False,
    ) -> torch.Tensor:
        # ``act_int8`` is not honoured: activations stay float (the base contract allows it;
        # on a GPU the float path is memory-bound at decode, and int8 would cost accuracy).
        # GGUF's other kinds ("u8", "n4", halves) go to the torch twin; on CUDA the worker
        # dequantizes GGUF files to float weights at load anyway (worker.pick_quantization).
        if w.kind == TORCH_INT4_KIND:
            return torch_int4.matmul(x, w, bias, out)
        tensors = [x, w.codes, w.scales] + [t for t in (w.offsets, bias) if t is not None]
        if not quant_matmul.supports(w) or not _runs(*tensors):
            return super().packed_matmul(x, w, bias, act_int8, out, q8_unsigned)
        return quant_matmul.packed_matmul(x, w, bias, out)
