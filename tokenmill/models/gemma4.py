"""Gemma 4 text model (Gemma Team, 2026), as transformers' Gemma4ForCausalLM computes it.

Gemma 3's block (models/gemma3.py: sandwich norms, per-head QK-norm, window layers beside global
ones, GeGLU, sqrt(hidden)-scaled tied embeddings, final logit soft-cap) with these differences:
- RMSNorm weights are gains, not offsets from 1;
- values are RMS-normalized per head too, without a gain (v_norm), and queries are not scaled
  (attention scale 1: QK-norm already bounds the scores);
- global layers have their own head width (``global_head_dim``) and may have fewer KV heads
  (``num_global_key_value_heads``); with ``attention_k_eq_v`` their values are their keys'
  projection (no v_proj), before k_norm and RoPE. So K/V caches differ in shape by layer;
- global layers rotate by "proportional" RoPE: only the first ``partial_rotary_factor`` of a
  head's frequency pairs turn, at the frequencies they have in the whole head;
- each layer's output is multiplied by a learned scalar (``layer_scalar``);
- per-layer embeddings (PLE, the E2B/E4B models): a second table gives every token a
  [num_layers, hidden_size_per_layer_input] input, mixed with a projection of its embedding;
  after its MLP each layer adds ``norm(proj(act(gate(h)) · ple_i))``;
- KV sharing: the last ``num_kv_shared_layers`` layers compute no K/V; each attends with the
  K/V of the last earlier layer of its kind (``ModelConfig.kv_source``), whose cache it reads
  and which holds none of its own; with ``use_double_wide_mlp`` their MLPs are twice as wide;
- a mixture of experts beside the dense MLP (26B-A4B): the router reads the block's input
  (RMS-normalized, scaled per channel and by hidden^-1/2), its top-k weights renormalized then
  scaled per expert; the experts' and the MLP's outputs are each normalized, then summed.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from tokenmill.attention import Attention, ForwardBatch
from tokenmill.config import FULL_ATTENTION, SLIDING_ATTENTION, ModelConfig
from tokenmill.layers import (
    Embedding,
    Linear,
    MergedLinear,
    QKVLinear,
    RMSNorm,
    RotaryEmbedding,
    get_act_fn,
)
from tokenmill.models.base import CausalLM, head_linear
from tokenmill.models.llama import STACKED_PARAMS, LlamaMLP
from tokenmill.moe import FusedMoE, Router

# Parts of the multimodal checkpoint ("gemma4" config.json) the text model has no place for.
_OTHER_TOWERS = ("model.vision_tower.", "model.audio_tower.", "model.embed_vision.",
                 "model.embed_audio.")  # fmt: skip


class UnitRMSNorm(RMSNorm):
    """RMSNorm without a learned gain (Gemma 4's v_norm and router norm): the weight is ones,
    a buffer, so no checkpoint tensor is expected for it."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__(dim, eps)
        del self.weight
        self.register_buffer("weight", torch.ones(dim), persistent=False)


class Gemma4Attention(nn.Module):
    """Gemma 4's attention: this layer's head shape, k = v on global layers, q/k/v norms, and
    for a KV-sharing layer only q (its K/V are the source layer's, handed in)."""

    def __init__(self, config: ModelConfig, layer_idx: int, rotary: RotaryEmbedding) -> None:
        super().__init__()
        c = config
        self.num_heads = c.num_local_heads
        self.num_kv_heads = c.layer_num_kv_heads(layer_idx)
        self.head_dim = c.layer_head_dim(layer_idx)
        q_size = self.num_heads * self.head_dim
        kv_size = self.num_kv_heads * self.head_dim
        self.shares_kv = c.kv_source(layer_idx) != layer_idx
        self.k_eq_v = c.attention_k_eq_v and c.layer_types[layer_idx] == FULL_ATTENTION
        if self.shares_kv:
            self.q_proj = Linear(c.hidden_size, q_size, bias=c.attention_bias)
        elif self.k_eq_v:  # the checkpoint has no v_proj: v is k's projection
            self.qkv_proj = MergedLinear(
                c.hidden_size, {"q": q_size, "k": kv_size}, c.attention_bias
            )
        else:
            self.qkv_proj = QKVLinear(
                c.hidden_size, self.head_dim, self.num_heads, self.num_kv_heads, c.attention_bias
            )
        self.q_norm = RMSNorm(self.head_dim, c.rms_norm_eps)
        if not self.shares_kv:
            self.k_norm = RMSNorm(self.head_dim, c.rms_norm_eps)
            self.v_norm = UnitRMSNorm(self.head_dim, c.rms_norm_eps)
        self.o_proj = Linear(q_size, c.hidden_size, bias=c.attention_bias)
        self.rotary = rotary
        # A KV-sharing layer reads (and rewrites, with the same values) its source's cache.
        kv_idx = c.kv_layer_index(c.kv_source(layer_idx))
        self.attn = Attention(
            kv_idx, self.num_heads, self.num_kv_heads, self.head_dim, c.attention_scale,
            c.layer_sliding_window(layer_idx),
        )  # fmt: skip

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        fwd: ForwardBatch,
        shared_kv: tuple[torch.Tensor, torch.Tensor] | None,
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """Returns the output and this step's (k, v) it attended with (a later layer may share
        them)."""
        n = x.shape[0]
        if self.shares_kv:
            assert shared_kv is not None, "a KV-sharing layer runs after its source"
            q = self.q_norm(self.q_proj(x).view(n, self.num_heads, self.head_dim))
            # RoPE of q alone: a one-head stand-in for k, rotated and dropped.
            q, _ = self.rotary(positions, q, q[:, :1].clone())
            k, v = shared_kv
        else:
            if self.k_eq_v:
                q, k = self.qkv_proj(x)
                raw_v = k
            else:
                q, k, raw_v = self.qkv_proj(x)
            q = q.view(n, self.num_heads, self.head_dim)
            k = k.view(n, self.num_kv_heads, self.head_dim)
            # Before k's norm and rotation, which may work in place on k.
            v = self.v_norm(raw_v.reshape(n, self.num_kv_heads, self.head_dim))
            q, k = self.rotary.with_qk_norm(positions, q, k, self.q_norm, self.k_norm)
        out = self.attn(q, k, v, fwd)  # [num_tokens, num_heads, head_dim]
        return self.o_proj(out.reshape(n, -1)), (k, v)


class Gemma4Router(nn.Module):
    """Picks each token's experts from the block's input: RMS-normalized without a gain,
    scaled per channel and by hidden^-1/2, softmax, top-k renormalized, then a scale per
    expert."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        moe = config.moe
        assert moe is not None
        self.norm = UnitRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.proj = Router(moe.num_experts, config.hidden_size, moe.top_k, renormalize=True)
        self.scale = nn.Parameter(torch.empty(config.hidden_size), requires_grad=False)
        self.per_expert_scale = nn.Parameter(torch.empty(moe.num_experts), requires_grad=False)
        self.root_scale = config.hidden_size**-0.5

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        weights, ids = self.proj(self.norm(x) * self.scale * self.root_scale)  # [T, k] each
        return weights * self.per_expert_scale[ids].to(weights.dtype), ids


class Gemma4DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int, rotary: RotaryEmbedding) -> None:
        super().__init__()
        dim, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = RMSNorm(dim, eps)
        self.self_attn = Gemma4Attention(config, layer_idx, rotary)
        self.post_attention_layernorm = RMSNorm(dim, eps)
        self.pre_feedforward_layernorm = RMSNorm(dim, eps)
        width = config.intermediate_size
        if config.double_wide_mlp and config.kv_source(layer_idx) != layer_idx:
            width *= 2
        self.mlp = LlamaMLP(config, width)
        self.post_feedforward_layernorm = RMSNorm(dim, eps)
        self.has_moe = config.moe is not None
        if self.has_moe:
            moe = config.moe
            self.router = Gemma4Router(config)
            self.experts = FusedMoE(moe.num_experts, dim, moe.intermediate_size, config.hidden_act)
            self.post_feedforward_layernorm_1 = RMSNorm(dim, eps)
            self.pre_feedforward_layernorm_2 = RMSNorm(dim, eps)
            self.post_feedforward_layernorm_2 = RMSNorm(dim, eps)
        self.ple_dim = config.hidden_size_per_layer_input
        if self.ple_dim:
            self.act = get_act_fn(config.hidden_act)
            self.per_layer_input_gate = Linear(dim, self.ple_dim)
            self.per_layer_projection = Linear(self.ple_dim, dim)
            self.post_per_layer_input_norm = RMSNorm(dim, eps)
        self.layer_scalar = nn.Parameter(torch.ones(1), requires_grad=False)

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        fwd: ForwardBatch,
        shared_kv: tuple[torch.Tensor, torch.Tensor] | None,
        per_layer_input: torch.Tensor | None,  # [num_tokens, ple_dim]
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        attn_out, kv = self.self_attn(self.input_layernorm(x), positions, fwd, shared_kv)
        h = self.post_attention_layernorm(attn_out, residual=x)  # x + norm(attn_out)
        mlp_out = self.mlp(self.pre_feedforward_layernorm(h))
        if self.has_moe:  # the experts read h itself, beside the MLP
            weights, ids = self.router(h)
            experts_out = self.experts(self.pre_feedforward_layernorm_2(h), weights, ids)
            mlp_out = self.post_feedforward_layernorm_2(
                experts_out, residual=self.post_feedforward_layernorm_1(mlp_out)
            )
        h = self.post_feedforward_layernorm(mlp_out, residual=h)
        if self.ple_dim:
            gated = self.act(self.per_layer_input_gate(h)) * per_layer_input
            h = self.post_per_layer_input_norm(self.per_layer_projection(gated), residual=h)
        return h * self.layer_scalar, kv


class Gemma4Backbone(nn.Module):
    def __init__(self, config: ModelConfig, max_position: int) -> None:
        super().__init__()
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size, config.tp)
        global_rope = RotaryEmbedding(
            config.global_head_dim or config.head_dim, max_position, config.rope_theta,
            config.rope_scaling,
        )  # fmt: skip
        local_rope = RotaryEmbedding(
            config.head_dim, max_position, config.rope_local_theta or 10000.0
        )
        self.layers = nn.ModuleList(
            Gemma4DecoderLayer(
                config, i, local_rope if config.layer_types[i] == SLIDING_ATTENTION else global_rope
            )
            for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        ple, n = config.hidden_size_per_layer_input, config.num_hidden_layers
        if ple:  # every layer's slice side by side: [.., num_layers * ple]
            self.embed_tokens_per_layer = Embedding(config.vocab_size_per_layer_input, n * ple)
            self.per_layer_model_projection = Linear(config.hidden_size, n * ple)
            self.per_layer_projection_norm = RMSNorm(ple, config.rms_norm_eps)


class Gemma4ForCausalLM(CausalLM):
    stacked_params = STACKED_PARAMS

    def __init__(self, config: ModelConfig, max_position: int) -> None:
        super().__init__()
        if config.tp.size > 1:
            raise ValueError("Gemma 4 with tensor parallelism is not supported yet")
        self.config = config
        self.model = Gemma4Backbone(config, max_position)
        if not config.tie_word_embeddings:
            self.lm_head = head_linear(config)
        self.embed_scale = config.hidden_size**0.5
        self.ple_dim = config.hidden_size_per_layer_input
        # The layers whose step K/V a later layer shares.
        self.kv_sources = {config.kv_source(i) for i in range(config.num_hidden_layers)}

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, fwd: ForwardBatch
    ) -> torch.Tensor:
        h = self.model.embed_tokens(input_ids, scale=self.embed_scale)  # [num_tokens, hidden]
        per_layer = self._per_layer_inputs(input_ids, h) if self.ple_dim else None
        step_kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        for i, layer in enumerate(self.model.layers):
            source = self.config.kv_source(i)
            ple_i = per_layer[:, i] if per_layer is not None else None
            h, kv = layer(h, positions, fwd, step_kv.get(source), ple_i)
            if source == i and i in self.kv_sources:
                step_kv[i] = kv
        return self.model.norm(h)

    def _per_layer_inputs(self, input_ids: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        """[num_tokens, num_layers, ple]: the token's own per-layer embedding, and a projection
        of its (scaled) embedding, normalized, averaged by 1/sqrt(2)."""
        n, num_layers = input_ids.shape[0], self.config.num_hidden_layers
        m = self.model
        token = m.embed_tokens_per_layer(input_ids, scale=self.ple_dim**0.5)
        token = token.view(n, num_layers, self.ple_dim)
        projected = m.per_layer_model_projection(h) * self.config.hidden_size**-0.5
        projected = m.per_layer_projection_norm(projected.view(n, num_layers, self.ple_dim))
        return (projected + token) * 2.0**-0.5

    def checkpoint_tensors(self, weights: Iterable[tuple[str, Any]]) -> Iterable[tuple[str, Any]]:
        """Leave out the vision and audio towers and a KV-sharing layer's unused k/v tensors;
        lay transformers' stacked experts out as FusedMoE loads them (gate and up apart)."""
        sharing = {i for i in range(self.config.num_hidden_layers) if self.config.kv_source(i) != i}
        for name, tensor in weights:
            if name.startswith(_OTHER_TOWERS):
                continue
            parts = name.removeprefix("model.language_model.").removeprefix("model.").split(".")
            if (
                len(parts) > 4
                and parts[0] == "layers"
                and int(parts[1]) in sharing
                and parts[2] == "self_attn"
                and parts[3] in ("k_proj", "v_proj", "k_norm", "v_norm")
            ):
                continue  # transformers ignores them too
            if name.endswith(".experts.gate_up_proj"):
                if not isinstance(tensor, torch.Tensor):
                    raise ValueError(f"checkpoint tensor {name!r}: packed experts not supported")
                gate, up = tensor.chunk(2, dim=1)  # [E, 2I, H] -> [E, I, H] each
                yield name.removesuffix("gate_up_proj") + "gate_proj.weight", gate
                yield name.removesuffix("gate_up_proj") + "up_proj.weight", up
            elif name.endswith(".experts.down_proj"):
                yield name + ".weight", tensor
            else:
                yield name, tensor
