"""The attention layer a model calls: writes new K/V into its cache, then attends."""

from __future__ import annotations

import torch
from torch import nn

from tokenmill.attention.backends.base import AttentionBackend
from tokenmill.attention.backends.torch_backend import TorchAttentionBackend
from tokenmill.attention.metadata import ForwardBatch


class Attention(nn.Module):
    def __init__(
        self,
        layer_idx: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scale: float,
        sliding_window: int | None = None,
        softcap: float | None = None,
    ) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.sliding_window = sliding_window
        self.softcap = softcap  # Gemma 2: scores soft-capped before the softmax
        # The torch backend until the loader binds the one chosen (CausalLM.bind_kernels).
        self.backend: AttentionBackend = TorchAttentionBackend()

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        fwd: ForwardBatch,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        # q: [num_tokens, num_heads, head_dim]; k, v: [num_tokens, num_kv_heads, head_dim];
        # sinks: [num_heads] (gpt-oss), the model's parameter
        k_cache, v_cache, *scales = fwd.kv_caches[self.layer_idx]
        if k_cache.shape[2] != k.shape[1]:
            # A cache of longer rows than this layer's (kv_layout.kv_tensors: Gemma 4's window
            # layers beside its global ones) holds each KV head repeated.
            repeats = k_cache.shape[2] // k.shape[1]
            k, v = k.repeat_interleave(repeats, dim=1), v.repeat_interleave(repeats, dim=1)
        kv_scales = (scales[0], scales[1]) if scales else None  # quantized cache
        attn = fwd.layer_attn(self.layer_idx)
        return self.backend.forward(
            q, k, v, k_cache, v_cache, attn, self.scale, self.sliding_window, kv_scales,
            self.softcap, sinks,
        )  # fmt: skip
