"""Gemma 3 text model (Gemma Team, 2025), and Gemma 2 (Gemma Team, 2024) by its flags.

Differences from Llama, all in this file:
- embeddings scaled by sqrt(hidden_size); RMSNorm weights are offsets from 1;
- four norms per block ("sandwich"): the attention and MLP outputs are normalized again before
  the residual add;
- q and k are RMS-normalized per head (QK-norm) and scaled by query_pre_attn_scalar^-0.5;
- local layers attend within a sliding window and use RoPE base 10k; every 6th layer is global
  with its own base (1M) and scaling;
- GeGLU MLP (tanh-approximated GELU); tied output embedding.

Gemma 2 has the same block without QK-norm, with its attention scores and its logits soft-capped
(``cap · tanh(x / cap)``), local and global layers alternating, and one RoPE base for both.
"""

from __future__ import annotations

import torch
from torch import nn

from tokenmill.attention import ForwardBatch
from tokenmill.config import SLIDING_ATTENTION, ModelConfig
from tokenmill.layers import Embedding, GemmaRMSNorm, RotaryEmbedding
from tokenmill.models.base import CausalLM, head_linear
from tokenmill.models.llama import STACKED_PARAMS, LlamaAttention, LlamaMLP


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int, rotary: RotaryEmbedding) -> None:
        super().__init__()
        dim, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(dim, eps)
        qk_norm = None if config.architecture == "gemma2" else GemmaRMSNorm
        self.self_attn = LlamaAttention(config, layer_idx, rotary, qk_norm=qk_norm)
        self.post_attention_layernorm = GemmaRMSNorm(dim, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(dim, eps)
        self.mlp = LlamaMLP(config)
        self.post_feedforward_layernorm = GemmaRMSNorm(dim, eps)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, fwd: ForwardBatch) -> torch.Tensor:
        attn_out = self.self_attn(self.input_layernorm(x), positions, fwd)
        h = self.post_attention_layernorm(attn_out, residual=x)  # x + norm(attn_out)
        mlp_out = self.mlp(self.pre_feedforward_layernorm(h))
        return self.post_feedforward_layernorm(mlp_out, residual=h)


class Gemma3Backbone(nn.Module):
    def __init__(self, config: ModelConfig, max_position: int) -> None:
        super().__init__()
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size, config.tp)
        global_rope = RotaryEmbedding(
            config.head_dim, max_position, config.rope_theta, config.rope_scaling
        )
        local_rope = RotaryEmbedding(
            config.head_dim, max_position, config.rope_local_theta or 10000.0
        )
        self.layers = nn.ModuleList(
            Gemma3DecoderLayer(
                config, i, local_rope if config.layer_types[i] == SLIDING_ATTENTION else global_rope
            )
            for i in range(config.num_hidden_layers)
        )
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)


class Gemma3ForCausalLM(CausalLM):
    stacked_params = STACKED_PARAMS

    def __init__(self, config: ModelConfig, max_position: int) -> None:
        super().__init__()
        self.config = config
        self.model = Gemma3Backbone(config, max_position)
        if not config.tie_word_embeddings:
            self.lm_head = head_linear(config)
        self.embed_scale = config.hidden_size**0.5

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, fwd: ForwardBatch
    ) -> torch.Tensor:
        h = self.model.embed_tokens(input_ids, scale=self.embed_scale)
        for layer in self.model.layers:
            h = layer(h, positions, fwd)
        return self.model.norm(h)
