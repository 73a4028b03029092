"""Linear layer y = x Wᵀ (+ b). Parameters are allocated uninitialized: the loader fills them.

After loading, ``quantize_`` may hand the weight to a QuantMethod, which packs it and computes
from then on (the float parameter is dropped); a weight that arrives packed (GGUF) is handed
over by ``load_packed_`` instead of being loaded as floats.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

if TYPE_CHECKING:
    from tokenmill.quant.base import QuantMethod
    from tokenmill.quant.gguf import PackedQuantMethod
    from tokenmill.quant.packed import PackedWeight


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

    def load_packed_(self, method: PackedQuantMethod, weight: PackedWeight) -> None:
        """Take a weight that arrives packed (GGUF); a bias, if any, loads as a float."""
        self.quant_state = method.wrap(weight)
        self.quant_method = method
        self.weight = None  # type: ignore[assignment]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.quant_method is not None:
            y = self.quant_method.apply(self.quant_state, x)
            # A packed GGUF weight keeps its float bias here; quantize_ folded it into the state.
            return y if self.bias is None else y + self.bias
        return F.linear(x, self.weight, self.bias)


def _data(p: nn.Parameter | None) -> torch.Tensor | None:
    return None if p is None else p.data
