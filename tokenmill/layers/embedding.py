"""Token embedding (also the tied output head: ``logits = h Eᵀ``).

``weight_loader`` fills the table; ``quantize_`` (float checkpoints) or a table that arrives
packed (GGUF) hands it to a packed method: the head's matmul and the lookups both read the one
packed table.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.kernels.base import KernelBackend
from tokenmill.kernels.torch_backend import TorchKernelBackend
from tokenmill.layers.linear import default_weight_loader, packed_weight_loader
from tokenmill.quant.packed import PackedWeight

if TYPE_CHECKING:
    from tokenmill.quant.gguf import PackedQuantMethod


class Embedding(nn.Module):
    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_embeddings, embedding_dim), requires_grad=False)
        self.quant_method: PackedQuantMethod | None = None
        self.quant_state: Any = None
        self.kernels: KernelBackend = TorchKernelBackend()  # bound at load

    def weight_loader(
        self,
        param_name: str,
        loaded: torch.Tensor | PackedWeight,
        packed_method: PackedQuantMethod | None = None,
    ) -> None:
        """Fill the table from a checkpoint tensor; a packed one (GGUF) stays packed."""
        if isinstance(loaded, PackedWeight):
            packed_weight_loader(self, self.weight, loaded, packed_method)
        else:
            default_weight_loader(self.weight, loaded)

    def quantize_(self, method: PackedQuantMethod, importance: torch.Tensor | None = None) -> None:
        self.dtype = self.weight.dtype
        self.quant_state = method.quantize(self.weight.data, None, importance)
        self.quant_method = method
        self.weight = None  # type: ignore[assignment]

    def load_packed_(self, method: PackedQuantMethod, weight: PackedWeight) -> None:
        """Take a table that arrives packed (GGUF): lookups and the head both read it."""
        self.dtype = self.weight.dtype
        self.quant_state = method.wrap(weight)
        self.quant_method = method
        self.weight = None  # type: ignore[assignment]

    def forward(self, input_ids: torch.Tensor, scale: float | None = None) -> torch.Tensor:
        """Rows ``input_ids`` of the table, times ``scale`` if given (Gemma's sqrt(hidden))."""
        if self.quant_method is not None:
            h = self.quant_method.embedding(self.quant_state, input_ids, self.kernels, scale)
            return h.to(self.dtype)
        return self.kernels.embedding(self.weight, input_ids, scale)

    def as_head(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Logits h Eᵀ, written into ``out`` when given (a reused [rows, vocab] buffer)."""
        if self.quant_method is not None:
            return self.quant_method.apply(self.quant_state, hidden, self.kernels, out=out)
        if out is not None:
            return torch.matmul(hidden, self.weight.T, out=out)
        return F.linear(hidden, self.weight)
