"""Rotary position embeddings (Su et al., 2021), half-rotation ("neox") layout as in HF models.

Frequencies follow the checkpoint's scaling: ``linear`` divides positions by a factor; ``llama3``
(Llama 3.1) keeps high frequencies, divides low ones by the factor and blends in between;
``proportional`` (Gemma 4) turns only a head's leading frequency pairs, the others standing still
(cos 1, sin 0), so the rotation spans the whole head unlike ``rotary_dim``'s.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from tokenmill.config import RopeScaling
from tokenmill.kernels.base import KernelBackend
from tokenmill.kernels.torch_backend import TorchKernelBackend
from tokenmill.layers.norm import RMSNorm


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None) -> torch.Tensor:
    """The rotation frequencies of a head's ``head_dim`` rotated dimensions (for ``longrope``
    its short factors': RotaryEmbedding gives positions past the original context the long
    ones)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    if scaling is None:
        return inv_freq
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor
    if scaling.rope_type == "longrope":
        return inv_freq / _factors(scaling.short_factor, head_dim)
    if scaling.rope_type == "yarn":
        return _yarn(inv_freq, head_dim, theta, scaling)
    if scaling.rope_type == "proportional":  # the leading pairs turn, the rest stand still
        inv_freq[int(scaling.partial_rotary_factor * head_dim // 2) :] = 0.0
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
    """Applies RoPE to q and k at given positions, from a cos/sin table built once.

    ``rotary_dim`` (Phi-4-mini's partial rotary): only each head's leading dimensions rotate,
    the rest pass through."""

    def __init__(
        self,
        head_dim: int,
        max_position: int,
        theta: float,
        scaling: RopeScaling | None = None,
        rotary_dim: int | None = None,
    ) -> None:
        super().__init__()
        self.rotary_dim = rotary_dim if rotary_dim is not None and rotary_dim < head_dim else None
        self.scaling = scaling
        dim = self.rotary_dim or head_dim
        inv_freq = rope_inv_freq(dim, theta, scaling).float()
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        long_freq = None
        if scaling is not None and scaling.rope_type == "longrope":
            base = rope_inv_freq(dim, theta, None)
            long_freq = (base / _factors(scaling.long_factor, dim)).float()
        self.register_buffer("long_inv_freq", long_freq, persistent=False)
        self.resize_(max_position)
        self.kernels: KernelBackend = TorchKernelBackend()  # bound at load

    def resize_(self, max_position: int) -> None:
        """The cos/sin table of positions 0 .. max_position - 1, built anew (a model from the
        packed-model cache, saved at another context length, takes this load's): the same
        values a model built at this length has."""
        positions = torch.arange(max_position, dtype=torch.float32, device=self.inv_freq.device)
        freqs = torch.outer(positions, self.inv_freq)  # [max_position, head_dim / 2]
        if self.long_inv_freq is not None:
            # LongRoPE by position, as vLLM has it: the long factors from the original context
            # on. (transformers switches every position to them once a sequence is longer, which
            # would re-rotate keys already cached; within the original context both agree.)
            original = self.scaling.original_max_position_embeddings
            long = torch.outer(positions, self.long_inv_freq)
            freqs = torch.where(positions[:, None] < original, freqs, long)
        cos, sin = freqs.cos(), freqs.sin()
        if self.scaling is not None and self.scaling.rope_type in ("longrope", "yarn"):
            cos, sin = cos * self.scaling.attention_factor, sin * self.scaling.attention_factor
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # q: [num_tokens, num_heads, head_dim], k: [num_tokens, num_kv_heads, head_dim]; q and
        # k may be rotated in place (fresh projections, or views of one, no one else holds).
        if self.rotary_dim is None:
            return self.kernels.rotary(positions, q, k, self.cos, self.sin)
        d = self.rotary_dim
        q_rot, k_rot = self.kernels.rotary(
            positions, q[..., :d].contiguous(), k[..., :d].contiguous(), self.cos, self.sin
        )
        return torch.cat([q_rot, q[..., d:]], -1), torch.cat([k_rot, k[..., d:]], -1)

    def with_qk_norm(
        self,
        positions: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        q_norm: RMSNorm,
        k_norm: RMSNorm,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """RoPE of q and k after their per-head QK-norm (``RMSNorm`` modules of head_dim):
        one backend op, which may fuse them."""
        assert self.rotary_dim is None, "per-head QK-norm with partial rotary: no family has it"
        assert q_norm.weight_offset == k_norm.weight_offset and q_norm.eps == k_norm.eps
        return self.kernels.qk_norm_rotary(
            positions, q, k, q_norm.weight, k_norm.weight, q_norm.weight_offset, q_norm.eps,
            self.cos, self.sin,
        )  # fmt: skip


def _factors(factors: tuple[float, ...], dim: int) -> torch.Tensor:
    """LongRoPE's per-frequency divisors (one per rotated pair)."""
    if len(factors) != dim // 2:
        raise ValueError(
            f"longrope scaling needs {dim // 2} factors (one per rotated pair); got {len(factors)}"
        )
    return torch.tensor(factors, dtype=torch.float64)


def _yarn(inv_freq: torch.Tensor, dim: int, theta: float, scaling: RopeScaling) -> torch.Tensor:
    """YaRN (Peng et al., 2023): high frequencies (many turns in the original context) kept,
    low ones interpolated by the factor, a linear ramp between, over the dimensions whose
    frequencies turn between beta_slow and beta_fast times in the original context."""
    original = scaling.original_max_position_embeddings

    def dim_turning(turns: float) -> float:
        return dim * math.log(original / (turns * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_turning(scaling.beta_fast), dim_turning(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    # 0: the original frequency, 1: the interpolated one
    ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    return inv_freq / scaling.factor * ramp + inv_freq * (1 - ramp)
