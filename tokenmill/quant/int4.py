"""Weight-only int4 for float checkpoints: group-wise asymmetric, applied at load.

Each group of 32 or 128 input elements of a row gets w ≈ s · q + lo with q in 0..15, its grid
(s, lo) fit by least squares from several starting grids (quant/packed.py: quantize_int4).
The codes are stored two per byte (0.5 bytes a weight plus a float32 scale and offset per
group) and computed by the packed-weight kernel, like a GGUF Q4_1 / Q4_K tensor. Given a
calibration text (EngineArgs.int4_calibration, engine/calibration.py), each input's squared
errors count by its activations' mean square, as llama.cpp's imatrix does.

Two kinds of layer stay int8 (a scale per 32 inputs, quant/int8.py), as llama.cpp's Q4
mixes keep them at 6-8 bits:
- the output head (and a tied embedding): the logits over a large vocabulary are where 4 bits
  hurt most;
- the key and value projections: under grouped-query attention each feeds every query head of
  its group, and they are the smallest projections (gemma-3-270m, 1 KV head for 4 query heads:
  6% of a layer's weights; measured on its first 4,096 Hamlet tokens, 4-bit v_proj alone cost
  +5.5% perplexity, k_proj +1.0%, each of the larger q/gate/up/down 0.7-2.5%).
"""

from __future__ import annotations

import torch

from tokenmill.quant.base import QuantMethod
from tokenmill.quant.gguf import PackedQuantMethod, PackedState
from tokenmill.quant.int8 import Int8QuantMethod
from tokenmill.quant.packed import quantize_int4

INT4_GROUP_SIZES = (32, 128)
INT8_PROJECTIONS = ("k_proj", "v_proj")  # kept int8: see above


class Int4QuantMethod(PackedQuantMethod):
    name = "int4"

    def __init__(self, group_size: int = 32, act_int8: bool = True) -> None:
        if group_size not in INT4_GROUP_SIZES:
            raise ValueError(f"int4 group size must be 32 or 128; got {group_size}")
        super().__init__(act_int8)
        self.group_size = group_size
        # One instance for every int8 layer, so k_proj and v_proj can fuse (layers.linear);
        # a scale per 32 inputs: finer than per channel at no cost, exact for a Q8_0 source.
        self.wide = Int8QuantMethod(act_int8, group_scales=True)

    def quantize(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        importance: torch.Tensor | None = None,
    ) -> PackedState:
        bias = None if bias is None else bias.float().contiguous()
        return PackedState(quantize_int4(weight, self.group_size, importance), bias)

    def method_for(self, module_name: str, is_head: bool) -> QuantMethod:
        if is_head or module_name.rpartition(".")[2] in INT8_PROJECTIONS:
            return self.wide
        return self
