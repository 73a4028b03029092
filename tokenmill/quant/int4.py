"""Weight-only int4 for float checkpoints: group-wise asymmetric, applied at load.

Each group of 32 or 128 input elements of a row gets w ≈ s · q + lo with q in 0..15, its grid
(s, lo) fit by least squares from several starting grids (quant/packed.py: quantize_int4).
The codes are stored two per byte (0.5 bytes a weight plus a float32 scale and offset per
group) and computed by the packed-weight kernel, like a GGUF Q4_1 / Q4_K tensor.

The output head (and a tied embedding) stays int8, as llama.cpp's Q4 mixes keep theirs at 6-8
bits: the logits over a large vocabulary are where 4 bits hurt most.
"""

from __future__ import annotations

import torch

from tokenmill.quant.base import QuantMethod
from tokenmill.quant.gguf import PackedQuantMethod, PackedState
from tokenmill.quant.int8 import Int8QuantMethod
from tokenmill.quant.packed import quantize_int4

INT4_GROUP_SIZES = (32, 128)


class Int4QuantMethod(PackedQuantMethod):
    name = "int4"

    def __init__(self, group_size: int = 32, act_int8: bool = True) -> None:
        if group_size not in INT4_GROUP_SIZES:
            raise ValueError(f"int4 group size must be 32 or 128; got {group_size}")
        super().__init__(act_int8)
        self.group_size = group_size

    def quantize(self, weight: torch.Tensor, bias: torch.Tensor | None) -> PackedState:
        bias = None if bias is None else bias.float().contiguous()
        return PackedState(quantize_int4(weight, self.group_size), bias)

    def head_method(self) -> QuantMethod:
        return Int8QuantMethod(self.act_int8)
