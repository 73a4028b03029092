"""Weight-only int8 for float checkpoints: per-output-channel symmetric, W ≈ q · s, q in ±127.

Computed by the packed-weight kernel like a GGUF Q8_0 tensor whose 32-element groups of a row
share one scale (stored once per group: the kernel reads a scale per group). Activations are
quantized per 32 elements at small batch (or kept float32), never per tensor: fbgemm's dynamic
int8 linear, used before, quantizes a whole batch to 7 bits with one scale, which cost
gemma-3-270m +76% perplexity on Hamlet (78.0 vs 44.2); Gemma's activations have outliers.
"""

from __future__ import annotations

import torch

from tokenmill.quant.gguf import PackedQuantMethod, PackedState
from tokenmill.quant.packed import PackedWeight, pack_codes


def quantize_per_channel(
    weight: torch.Tensor, chunk_rows: int = 8192, group: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per output row: scale = max|w| / 127 (rows of zeros get scale 1); with
    ``group``, one scale per ``group`` elements of a row instead (scales [rows, in / group]
    rather than [rows]).

    Done in row chunks so the float temporaries stay small (the 262k-row embedding of
    gemma-3-270m would otherwise need ~2 GB of them).
    """
    rows, k = weight.shape
    group = group or k
    if k % group:
        raise ValueError(f"int8 group {group} must divide the rows' {k} elements")
    q = torch.empty(weight.shape, dtype=torch.int8, device=weight.device)
    scales = torch.empty((rows, k // group), dtype=torch.float32, device=weight.device)
    for start in range(0, rows, chunk_rows):
        w = weight[start : start + chunk_rows].float().reshape(-1, k // group, group)
        s = w.abs().amax(dim=-1) / 127.0
        s = torch.where(s > 0, s, torch.ones_like(s))
        q[start : start + chunk_rows] = torch.round(w / s[..., None]).clamp_(-127, 127).flatten(1)
        scales[start : start + chunk_rows] = s
    return q, scales if group < k else scales[:, 0]


class Int8QuantMethod(PackedQuantMethod):
    """One scale per output channel (``--quantization int8``), or with ``group_scales`` one per
    32 inputs, GGUF Q8_0's layout, which the kernel reads at the same cost (it reads a scale per
    group either way) and which recovers a Q8_0 tensor exactly (int4's int8 layers)."""

    name = "int8"

    def __init__(self, act_int8: bool = True, group_scales: bool = False) -> None:
        super().__init__(act_int8)
        self.group_scales = group_scales

    def quantize(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        importance: torch.Tensor | None = None,
    ) -> PackedState:
        # The scale is the row's max and each weight rounds to its nearest level: nothing for an
        # importance weighting to choose.
        n, k = weight.shape
        group = 32 if k % 32 == 0 else k  # rows not in 32s: one group (torch reference path)
        q, scales = quantize_per_channel(weight, group=group if self.group_scales else None)
        for start in range(0, n, 8192):  # into the kernel's order, a slice at a time
            q[start : start + 8192] = pack_codes(q[start : start + 8192], "q8")
        if scales.dim() == 1:  # one scale a row, stored once per group
            scales = scales[:, None].repeat(1, k // group).contiguous()
        packed = PackedWeight("q8", q, scales, None, group, (n, k))
        return PackedState(packed, None if bias is None else bias.float().contiguous())
