"""Rotary position embeddings (Su et al., 2021), half-rotation ("neox") layout as in HF models.

Frequencies follow the checkpoint's scaling: ``linear`` divides positions by a factor; ``llama3``
(Llama 3.1) keeps high frequencies, divides low ones by the factor and blends in between.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from tokenmill import kernels
from tokenmill.config import RopeScaling


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    if scaling is None:
        return inv_freq
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor
    # llama3
    old_len = scaling.original_max_position_embeddings
    low_wavelen = old_len / scaling.low_freq_factor
    high_wavelen = old_len / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (old_len / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    blended = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(is_medium, blended, scaled)


class RotaryEmbedding(nn.Module):
    """Applies RoPE to q and k at given positions, from a cos/sin table built once."""

    def __init__(
        self,
        head_dim: int,
        max_position: int,
        theta: float,
        scaling: RopeScaling | None = None,
    ) -> None:
        super().__init__()
        inv_freq = rope_inv_freq(head_dim, theta, scaling).float()
        positions = torch.arange(max_position, dtype=torch.float32)
        freqs = torch.outer(positions, inv_freq)  # [max_position, head_dim / 2]
        self.register_buffer("cos", freqs.cos(), persistent=False)
        self.register_buffer("sin", freqs.sin(), persistent=False)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # q: [num_tokens, num_heads, head_dim], k: [num_tokens, num_kv_heads, head_dim]
        if (
            q.shape[-1] % 16 == 0
            and positions.dtype == torch.int64
            and positions.is_contiguous()
            and kernels.heads_fit(q)
            and kernels.heads_fit(k)
            and kernels.fits(self.cos, self.sin)
        ):
            # In place: q and k are fresh projections (or views of one) no one else holds.
            kernels.rope_neox_(q, positions, self.cos, self.sin)
            kernels.rope_neox_(k, positions, self.cos, self.sin)
            return q, k
        cos = self.cos[positions].unsqueeze(1)  # [num_tokens, 1, head_dim / 2]
        sin = self.sin[positions].unsqueeze(1)
        return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.float().chunk(2, dim=-1)
    out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return out.to(x.dtype)
