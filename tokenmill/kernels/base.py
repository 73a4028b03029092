"""KernelBackend: the ops a model step calls outside attention, one implementation per kind of
kernel library. The backend is chosen once, at load (models/loader.py), and handed to every
module that computes with it (``CausalLM.bind_kernels``); no layer decides which one runs.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from tokenmill.quant.packed import PackedWeight


class KernelBackend(ABC):
    """Base class of kernel backends. Every op takes what the layer holds and returns a fresh
    tensor (``rotary`` may rotate q and k in place: they are fresh projections)."""

    name: str = ""

    @abstractmethod
    def rmsnorm(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        weight_offset: float,
        eps: float,
        residual: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """residual + x / rms(x) · (weight + weight_offset) over the last dim, in x's dtype
        (computed in float32); just the norm without ``residual``."""

    @abstractmethod
    def rotary(
        self,
        positions: torch.Tensor,  # [num_tokens] long
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        cos: torch.Tensor,  # [max_position, head_dim / 2] float32
        sin: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate-half ("neox") RoPE of q and k at ``positions``."""

    def qk_norm_rotary(
        self,
        positions: torch.Tensor,  # [num_tokens] long
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        q_weight: torch.Tensor,  # [head_dim]
        k_weight: torch.Tensor,
        weight_offset: float,
        eps: float,
        cos: torch.Tensor,  # [max_position, head_dim / 2] float32
        sin: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """QK-norm then RoPE: ``rotary`` of each head's ``rmsnorm`` (q's weight for q's heads,
        k's for k's); a backend may fuse it (q and k are fresh projections, free to change)."""
        q = self.rmsnorm(q, q_weight, weight_offset, eps)
        k = self.rmsnorm(k, k_weight, weight_offset, eps)
        return self.rotary(positions, q, k, cos, sin)

    @abstractmethod
    def act_and_mul(self, gate_up: torch.Tensor, act: str) -> torch.Tensor:
        """act(gate) * up for gate_up [..., 2d] = [gate | up]; ``act`` one of
        torch_backend.ACTIVATIONS ("silu", "gelu", "gelu_tanh")."""

    @abstractmethod
    def add(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """x + y (the residual stream's add)."""

    @abstractmethod
    def embedding(
        self, table: torch.Tensor, ids: torch.Tensor, scale: float | None
    ) -> torch.Tensor:
        """Rows ``ids`` of a float table [vocab, dim], times ``scale`` if given."""

    @abstractmethod
    def packed_matmul(
        self,
        x: torch.Tensor,  # [rows, in]
        w: PackedWeight,
        bias: torch.Tensor | None,
        act_int8: bool,
        out: torch.Tensor | None = None,
        q8_unsigned: bool = False,
    ) -> torch.Tensor:
        """y = x Wᵀ + b in float32 [rows, out] for a packed weight, into ``out`` when given and
        used. ``act_int8``: x may be quantized to int8 per 32 elements (a backend without an
        integer kernel computes in float); ``q8_unsigned``: see quant/gguf.py's PackedState."""

    def prepare_packed(self, w: PackedWeight) -> PackedWeight:
        """A linear layer's packed weight as this backend's kernels want it, asked once at load
        (``CausalLM.bind_kernels``): by default the weight itself."""
        return w

    @abstractmethod
    def packed_embedding(
        self, w: PackedWeight, ids: torch.Tensor, scale: float | None
    ) -> torch.Tensor:
        """Rows ``ids`` of a packed table in float32 [*ids.shape, dim], times ``scale``."""

    @abstractmethod
    def moe_route(
        self, x: torch.Tensor, router: torch.Tensor, top_k: int, renormalize: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A mixture-of-experts router: for x [T, H] and a float router weight [E, H], the
        ``top_k`` experts of each token by softmax(x routerᵀ) (ties to the lower index), as
        (weights float32 [T, k], expert ids int64 [T, k]), highest first; ``renormalize``:
        the k weights rescaled to sum to 1."""

    @abstractmethod
    def moe_experts(
        self,
        x: torch.Tensor,
        weights: torch.Tensor,
        ids: torch.Tensor,
        gate_up: PackedWeight,
        down: PackedWeight,
        act: str,
        act_int8: bool,
        counts: torch.Tensor | None = None,
        shared: torch.Tensor | None = None,
        shared_gate: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Σ_j weights[t, j] · down_e(act(gate_e x_t) · up_e x_t), e = ids[t, j], float32 [T, H],
        for experts stacked in packed weights: ``gate_up`` holds E experts' [gate | up] rows
        ([E·2I, H]: expert e's rows e·2I ..), ``down`` their down projections ([E·H, I]). Each
        expert runs once, on the tokens routed to it; an expert no token chose costs nothing.
        ``counts`` (int64 [E]), if given, gains the number of tokens each expert ran (router
        statistics). ``shared`` [T, H] with ``shared_gate`` [H] (Qwen2-MoE's shared expert's
        output and its gate): adds sigmoid(x_t · shared_gate) · shared[t]."""

    @abstractmethod
    def argmax(self, x: torch.Tensor) -> torch.Tensor:
        """torch.argmax(x, dim=-1) (the first index among ties), long."""

    @abstractmethod
    def apply_token_bitmask_(
        self, logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]
    ) -> None:
        """In ``rows`` of logits [num_rows, vocab], set the tokens a grammar disallows to -inf:
        bit t % 32 of ``bitmask[row, t // 32]`` (int32 words) is 0 (structured/bitmask.py)."""
