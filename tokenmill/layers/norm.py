"""RMSNorm (Zhang & Sennrich, 2019) and Gemma's variant that scales by (1 + w).

``forward(x, residual)`` returns ``residual + norm(x)`` in one step (Gemma adds its normalized
attention / MLP outputs to the residual stream). Float32 CPU tensors take the C kernel: a decode
step runs ~100 of these on a few hundred floats each, where torch's dispatch costs more than
the arithmetic.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill import kernels


class RMSNorm(nn.Module):
    weight_offset = 0.0  # gain = weight + weight_offset

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim), requires_grad=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        if (
            x.shape[-1] % 8 == 0
            and kernels.heads_fit(x)
            and kernels.fits(self.weight)
            and (residual is None or kernels.fits(residual))
        ):
            return kernels.rmsnorm(x, self.weight, self.weight_offset, self.eps, residual)
        # Computed in float32 as the reference implementations do, whatever the model dtype.
        gain = self.weight.float() + self.weight_offset
        y = F.rms_norm(x.float(), (x.shape[-1],), gain, self.eps).to(x.dtype)
        return y if residual is None else residual + y


class GemmaRMSNorm(RMSNorm):
    """Gemma stores the norm weight as an offset from 1: y = norm(x) * (1 + w)."""

    weight_offset = 1.0
