"""RMSNorm (Zhang & Sennrich, 2019) and Gemma's variant that scales by (1 + w)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim), requires_grad=False)

    def _gain(self) -> torch.Tensor:
        return self.weight.float()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Computed in float32 as the reference implementations do, whatever the model dtype;
        # torch's fused kernel: one op instead of six (decode runs ~100 norms a step).
        y = F.rms_norm(x.float(), (x.shape[-1],), self._gain(), self.eps)
        return y.to(x.dtype)


class GemmaRMSNorm(RMSNorm):
    """Gemma stores the norm weight as an offset from 1: y = norm(x) * (1 + w)."""

    def _gain(self) -> torch.Tensor:
        return 1.0 + self.weight.float()
