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
    weight: torch.Tensor, chunk_rows: int = 8192
) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per output row: scale = max|w| / 127 (rows of zeros get scale 1).

    Done in row chunks so the float temporaries stay small (the 262k-row embedding of
    gemma-3-270m would otherwise need ~2 GB of them).
    """
    rows = weight.shape[0]
    q = torch.empty(weight.shape, dtype=torch.int8, device=weight.device)
    scales = torch.empty(rows, dtype=torch.float32, device=weight.device)
    for start in range(0, rows, chunk_rows):
        w = weight[start : start + chunk_rows].float()
        s = w.abs().amax(dim=1) / 127.0
        s = torch.where(s > 0, s, torch.ones_like(s))
        q[start : start + chunk_rows] = torch.round(w / s[:, None]).clamp_(-127, 127)
        scales[start : start + chunk_rows] = s
    return q, scales


class Int8QuantMethod(PackedQuantMethod):
    name = "int8"

    def quantize(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        importance: torch.Tensor | None = None,
    ) -> PackedState:
        # The scale is the row's max and each weight rounds to its nearest level: nothing for an
        # importance weighting to choose.
        n, k = weight.shape
        q, scales = quantize_per_channel(weight)
        for start in range(0, n, 8192):  # into the kernel's order, a slice at a time
            q[start : start + 8192] = pack_codes(q[start : start + 8192], "q8")
        group = 32 if k % 32 == 0 else k  # rows not in 32s: one group (torch reference path)
        packed = PackedWeight(
            "q8", q, scales[:, None].repeat(1, k // group).contiguous(), None, group, (n, k)
        )
        return PackedState(packed, None if bias is None else bias.float().contiguous())
