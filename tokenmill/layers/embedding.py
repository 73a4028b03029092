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

from tokenmill.config import TensorParallel
from tokenmill.kernels.base import KernelBackend
from tokenmill.kernels.torch_backend import TorchKernelBackend
from tokenmill.layers.linear import default_weight_loader, packed_weight_loader
from tokenmill.layers.parallel import Shard, all_reduce_, load_shard_, vocab_range
from tokenmill.quant.packed import GGUFBlocks, PackedWeight

if TYPE_CHECKING:
    from tokenmill.quant.gguf import PackedQuantMethod


class Embedding(nn.Module):
    """``tp`` (tensor parallelism): this rank holds its slice of the vocabulary's rows
    (``vocab_range``); a lookup takes the ids in its slice, zeros the others' rows and sums
    over the ranks, and ``as_head`` gives this rank's slice of the logits (the model gathers
    them)."""

    def __init__(
        self, num_embeddings: int, embedding_dim: int, tp: TensorParallel | None = None
    ) -> None:
        super().__init__()
        self.tp = tp if tp is not None and tp.size > 1 else None
        if self.tp is not None:
            self.vocab_start, vocab_end = vocab_range(num_embeddings, self.tp)
            num_embeddings = vocab_end - self.vocab_start
        self.num_local_rows = num_embeddings
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
        if self.tp is not None:
            if isinstance(loaded, GGUFBlocks):  # this rank's vocabulary rows, packed
                packed = loaded.shard(0, self.tp.rank, self.tp.size).pack()
                packed_weight_loader(self, self.weight, packed, packed_method)
            elif isinstance(loaded, PackedWeight):
                raise ValueError(
                    "arrived packed where a tensor-parallel shard is cut from it (the loader "
                    "gives such weights as GGUFBlocks)"
                )
            else:
                load_shard_(self.weight.data, loaded, Shard(0, self.tp.rank, self.tp.size))
        elif isinstance(loaded, PackedWeight):
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
        if self.tp is not None:
            return self._parallel_lookup(input_ids, scale)
        if self.quant_method is not None:
            h = self.quant_method.embedding(self.quant_state, input_ids, self.kernels, scale)
            return h.to(self.dtype)
        return self.kernels.embedding(self.weight, input_ids, scale)

    def _parallel_lookup(self, input_ids: torch.Tensor, scale: float | None) -> torch.Tensor:
        local_ids = input_ids - self.vocab_start
        outside = (local_ids < 0) | (local_ids >= self.num_local_rows)
        local_ids = local_ids.masked_fill(outside, 0)
        if self.quant_method is not None:
            h = self.quant_method.embedding(self.quant_state, local_ids, self.kernels, scale)
            h = h.to(self.dtype)
        else:
            h = self.kernels.embedding(self.weight, local_ids, scale)
        h = h.masked_fill(outside.unsqueeze(-1), 0.0)  # [num_tokens, hidden]
        return all_reduce_(h)

    def as_head(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Logits h Eᵀ, written into ``out`` when given (a reused [rows, vocab] buffer)."""
        if self.quant_method is not None:
            return self.quant_method.apply(self.quant_state, hidden, self.kernels, out=out)
        if out is not None:
            return torch.matmul(hidden, self.weight.T, out=out)
        return F.linear(hidden, self.weight)
