"""OLMo 2 (Team OLMo, 2024): Llama's attention and MLP with the norms moved after them.

    h = x + RMSNorm(Attn(x));  out = h + RMSNorm(MLP(h))

No norm before either sub-layer: each output is normalized before the residual add ("reordered
norm"). q and k are RMS-normalized over all their heads at once before RoPE (QK-norm), as
OLMoE's. Checkpoints name the two norms ``post_attention_layernorm`` and
``post_feedforward_layernorm``; llama.cpp's GGUFs ``post_attention_norm`` and ``post_ffw_norm``.
"""

from __future__ import annotations

import torch
from torch import nn

from tokenmill.attention import ForwardBatch
from tokenmill.config import ModelConfig
from tokenmill.layers import RMSNorm, RotaryEmbedding
from tokenmill.models.llama import LlamaAttention, LlamaForCausalLM, LlamaMLP


class Olmo2DecoderLayer(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        layer_idx: int,
        rotary: RotaryEmbedding | None,
        mlp: nn.Module | None = None,
    ) -> None:
        super().__init__()
        dim, eps = config.hidden_size, config.rms_norm_eps
        self.self_attn = LlamaAttention(config, layer_idx, rotary, qk_norm=RMSNorm)
        self.post_attention_layernorm = RMSNorm(dim, eps)
        self.mlp = mlp if mlp is not None else LlamaMLP(config)
        self.post_feedforward_layernorm = RMSNorm(dim, eps)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, fwd: ForwardBatch) -> torch.Tensor:
        h = self.post_attention_layernorm(self.self_attn(x, positions, fwd), residual=x)
        return self.post_feedforward_layernorm(self.mlp(h), residual=h)


class Olmo2ForCausalLM(LlamaForCausalLM):
    decoder_layer = Olmo2DecoderLayer
