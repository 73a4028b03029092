"""Token embedding (also the tied output head: ``logits = h Eᵀ``).

``quantize_`` packs the table for the head with a QuantMethod and keeps int8 rows plus per-row
scales for lookups, so the float table is dropped.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

if TYPE_CHECKING:
    from tokenmill.quant.base import QuantMethod


class Embedding(nn.Module):
    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_embeddings, embedding_dim), requires_grad=False)
        self.quant_method: QuantMethod | None = None
        self.quant_state: Any = None

    def quantize_(self, method: QuantMethod) -> None:
        from tokenmill.quant.int8 import quantize_per_channel

        self.dtype = self.weight.dtype
        self.quant_state = method.quantize(self.weight.data, None)
        self.quant_method = method
        self.row_q, self.row_scales = quantize_per_channel(self.weight.data)
        self.weight = None  # type: ignore[assignment]

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.quant_method is not None:
            rows = F.embedding(input_ids, self.row_q).float()
            return (rows * F.embedding(input_ids, self.row_scales[:, None])).to(self.dtype)
        return F.embedding(input_ids, self.weight)

    def as_head(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.quant_method is not None:
            return self.quant_method.apply(self.quant_state, hidden)
        return F.linear(hidden, self.weight)
