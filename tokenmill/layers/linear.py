"""Linear layer y = x Wᵀ (+ b). Parameters are allocated uninitialized: the loader fills them.

After loading, ``quantize_`` may hand the weight to a QuantMethod, which packs it and computes
from then on (the float parameter is dropped).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

if TYPE_CHECKING:
    from tokenmill.quant.base import QuantMethod


class Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None
        self.quant_method: QuantMethod | None = None
        self.quant_state: Any = None

    def quantize_(self, method: QuantMethod) -> None:
        self.quant_state = method.quantize(self.weight.data, _data(self.bias))
        self.quant_method = method
        self.weight = None  # type: ignore[assignment]
        self.bias = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.quant_method is not None:
            return self.quant_method.apply(self.quant_state, x)
        return F.linear(x, self.weight, self.bias)


def _data(p: nn.Parameter | None) -> torch.Tensor | None:
    return None if p is None else p.data
