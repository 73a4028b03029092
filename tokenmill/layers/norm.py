"""RMSNorm (Zhang & Sennrich, 2019) and Gemma's variant that scales by (1 + w)."""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim), requires_grad=False)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        # Computed in float32 as the reference implementations do, whatever the model dtype.
        xf = x.float()
        return xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self._norm(x) * self.weight.float()).to(x.dtype)


class GemmaRMSNorm(RMSNorm):
    """Gemma stores the norm weight as an offset from 1: y = norm(x) * (1 + w)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self._norm(x) * (1.0 + self.weight.float())).to(x.dtype)
