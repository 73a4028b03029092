"""RMSNorm (Zhang & Sennrich, 2019) and Gemma's variant that scales by (1 + w).

``forward(x, residual)`` returns ``residual + norm(x)`` in one step (Gemma adds its normalized
attention / MLP outputs to the residual stream). Computed by the kernel backend bound at load.
"""

from __future__ import annotations

import torch
from torch import nn

from tokenmill.kernels.base import KernelBackend
from tokenmill.kernels.torch_backend import TorchKernelBackend


class RMSNorm(nn.Module):
    weight_offset = 0.0  # gain = weight + weight_offset

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim), requires_grad=False)
        self.kernels: KernelBackend = TorchKernelBackend()  # bound at load

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        return self.kernels.rmsnorm(x, self.weight, self.weight_offset, self.eps, residual)


class GemmaRMSNorm(RMSNorm):
    """Gemma stores the norm weight as an offset from 1: y = norm(x) * (1 + w)."""

    weight_offset = 1.0
