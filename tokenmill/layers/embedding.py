"""Token embedding (also the tied output head: ``logits = h Eᵀ``).

``quantize_`` packs the table for the head with a QuantMethod; lookups read the packed table
where the method can (packed GGUF, int4), else int8 rows plus per-row scales kept beside it
(int8, whose fbgemm form cannot be indexed). The float table is dropped.
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


class Embedding(nn.Module):
    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_embeddings, embedding_dim), requires_grad=False)
        self.quant_method: QuantMethod | None = None
        self.quant_state: Any = None
        # int8 rows for lookups when the head's packed form cannot serve them (fbgemm's).
        self.row_q: torch.Tensor | None = None
        self.row_scales: torch.Tensor | None = None

    def quantize_(self, method: QuantMethod) -> None:
        from tokenmill.quant.int8 import quantize_per_channel

        self.dtype = self.weight.dtype
        self.quant_state = method.quantize(self.weight.data, None)
        self.quant_method = method
        if not hasattr(method, "embedding"):
            self.row_q, self.row_scales = quantize_per_channel(self.weight.data)
        self.weight = None  # type: ignore[assignment]

    def load_packed_(self, method: PackedQuantMethod, weight: PackedWeight) -> None:
        """Take a table that arrives packed (GGUF): lookups and the head both read it."""
        self.dtype = self.weight.dtype
        self.quant_state = method.wrap(weight)
        self.quant_method = method
        self.weight = None  # type: ignore[assignment]

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.row_q is not None:
            rows = F.embedding(input_ids, self.row_q).float()
            return (rows * F.embedding(input_ids, self.row_scales[:, None])).to(self.dtype)
        if self.quant_method is not None:
            return self.quant_method.embedding(self.quant_state, input_ids).to(self.dtype)
        return F.embedding(input_ids, self.weight)

    def as_head(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.quant_method is not None:
            return self.quant_method.apply(self.quant_state, hidden)
        return F.linear(hidden, self.weight)
