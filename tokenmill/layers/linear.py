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

from tokenmill.kernels.base import KernelBackend
from tokenmill.kernels.torch_backend import TorchKernelBackend

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
        self.kernels: KernelBackend = TorchKernelBackend()  # a packed matmul's; bound at load

    def quantize_(self, method: QuantMethod, importance: torch.Tensor | None = None) -> None:
        """Pack the weight (``importance``: see QuantMethod.quantize)."""
        self.quant_state = method.quantize(self.weight.data, _data(self.bias), importance)
        self.quant_method = method
        self.weight = None  # type: ignore[assignment]
        self.bias = None

    def load_packed_(self, method: PackedQuantMethod, weight: PackedWeight) -> None:
        """Take a weight that arrives packed (GGUF); a bias, if any, loads as a float."""
        self.quant_state = method.wrap(weight)
        self.quant_method = method
        self.weight = None  # type: ignore[assignment]

    def fold_bias_(self) -> None:
        """After loading: a packed weight's float bias (GGUF) moves into its state, so the
        matmul kernel adds it and torch computes nothing after the kernel."""
        state = self.quant_state
        if self.bias is not None and getattr(state, "bias", False) is None:
            state.bias = self.bias.data.float().contiguous()
            self.bias = None

    def forward(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """y = x Wᵀ + b; into ``out`` when given (the output head's reused logits buffer)."""
        if self.quant_method is not None:
            y = self.quant_method.apply(self.quant_state, x, self.kernels, out=out)
        elif out is None:
            return F.linear(x, self.weight, self.bias)
        else:
            y = torch.matmul(x, self.weight.T, out=out)
        if self.bias is None:
            return y
        # A packed GGUF weight keeps its float bias here; quantize_ folded it into the state.
        return y.add_(self.bias) if out is not None else y + self.bias


def _data(p: nn.Parameter | None) -> torch.Tensor | None:
    return None if p is None else p.data


def fuse_packed(linears: list[Linear]) -> Linear | None:
    """A Linear computing ``cat([l(x) for l in linears], -1)`` in one packed matmul, when all hold
    packed weights (GGUF, int4) of one layout, biases (if any) folded into their states; the
    parts give theirs up (None otherwise, and nothing changes). Decode runs ~7 small matmuls a
    layer: fewer, larger calls save their fixed cost."""
    from tokenmill.quant.gguf import PackedQuantMethod, PackedState
    from tokenmill.quant.packed import concat_rows

    methods = {id(lin.quant_method) for lin in linears}
    first = linears[0]
    if len(methods) != 1 or not isinstance(first.quant_method, PackedQuantMethod):
        return None
    if any(lin.bias is not None for lin in linears):
        return None
    weight = concat_rows([lin.quant_state.weight for lin in linears])
    if weight is None:
        return None
    bias = None
    if any(lin.quant_state.bias is not None for lin in linears):  # Qwen2's q/k/v biases
        bias = torch.cat(
            [
                lin.quant_state.bias
                if lin.quant_state.bias is not None
                else torch.zeros(lin.out_features, dtype=torch.float32)
                for lin in linears
            ]
        )
    fused = Linear.__new__(Linear)
    nn.Module.__init__(fused)
    fused.in_features, fused.out_features = first.in_features, weight.shape[0]
    fused.weight, fused.bias = None, None  # type: ignore[assignment]
    fused.quant_method, fused.quant_state = first.quant_method, PackedState(weight, bias)
    fused.kernels = first.kernels
    for lin in linears:
        lin.quant_method, lin.quant_state = None, None  # computed by ``fused`` from now on
    return fused
