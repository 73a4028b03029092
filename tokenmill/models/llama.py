"""Llama (Touvron et al., 2023) and the families that share its block: Mistral, Qwen2, Qwen3,
SmolLM3, Phi-3.

    h = x + Attn(RMSNorm(x));  out = h + MLP(RMSNorm(h)),   MLP = down(act(gate(h)) * up(h))

Qwen2 adds biases to q/k/v; Qwen3 drops them and RMS-normalizes each head of q and k before
RoPE; Mistral attends within a sliding window; SmolLM3 leaves RoPE out of every fourth layer
(NoPE); Phi-3 stores q/k/v and gate/up fused (models/phi3.py splits them) and scales RoPE by
LongRoPE, rotating only part of each head in Phi-4-mini. The mixture-of-experts families
(models/moe.py) keep this block and swap its MLP; OLMo 2 (models/olmo2.py) moves its norms.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from tokenmill.attention import Attention, ForwardBatch
from tokenmill.config import ModelConfig
from tokenmill.kernels.base import KernelBackend
from tokenmill.kernels.torch_backend import TorchKernelBackend
from tokenmill.layers import (
    ActAndMul,
    Embedding,
    Linear,
    MergedLinear,
    QKVLinear,
    RMSNorm,
    RotaryEmbedding,
    get_act_fn,
)
from tokenmill.layers.parallel import Shard
from tokenmill.models.base import CausalLM, head_linear


class LlamaAttention(nn.Module):
    """q/k/v projections, optional per-head QK-norm, RoPE, paged attention, output projection.

    ``qk_norm`` is the norm class for QK-norm (Qwen3: RMSNorm, Gemma 3: GemmaRMSNorm), or None.
    OLMoE and OLMo 2 norm q and k over all their heads at once (``config.qk_norm_full``); OLMoE
    may clip q, k and v to ±``config.clip_qkv``. ``rotary`` None: a layer without positions
    (SmolLM3's NoPE layers).
    """

    def __init__(
        self,
        config: ModelConfig,
        layer_idx: int,
        rotary: RotaryEmbedding | None,
        qk_norm: type[RMSNorm] | None = None,
    ) -> None:
        super().__init__()
        c = config
        # This rank's heads (all of them without tensor parallelism).
        self.num_heads, self.num_kv_heads, self.head_dim = (
            c.num_local_heads,
            c.num_local_kv_heads,
            c.head_dim,
        )
        shard = kv_shard = out_shard = None
        if c.tp.size > 1:  # q/k/v column-parallel, o_proj row-parallel (one all-reduce)
            shard = Shard(0, c.tp.rank, c.tp.size)
            kv_shard = Shard(0, *c.kv_shard)
            out_shard = Shard(1, c.tp.rank, c.tp.size, reduce=True)
        self.qkv_proj = QKVLinear(
            c.hidden_size,
            c.head_dim,
            self.num_heads,
            self.num_kv_heads,
            bias=c.attention_bias,
            shard=shard,
            kv_shard=kv_shard,
        )
        self.o_proj = Linear(
            self.num_heads * c.head_dim, c.hidden_size, bias=c.o_proj_bias, shard=out_shard
        )
        # gpt-oss: a learned sink logit per head (this rank's heads).
        self.sinks = (
            nn.Parameter(torch.zeros(self.num_heads), requires_grad=False)
            if c.attention_sinks
            else None
        )
        if qk_norm is None and c.architecture in ("qwen3", "qwen3_moe", "olmoe", "olmo2"):
            qk_norm = RMSNorm
        self.has_qk_norm = qk_norm is not None
        self.qk_norm_full = c.qk_norm_full
        self.clip_qkv = c.clip_qkv
        if qk_norm is not None:
            q_dim, k_dim = c.head_dim, c.head_dim
            if c.qk_norm_full:
                q_dim, k_dim = self.num_heads * c.head_dim, self.num_kv_heads * c.head_dim
            self.q_norm = qk_norm(q_dim, c.rms_norm_eps)
            self.k_norm = qk_norm(k_dim, c.rms_norm_eps)
        self.rotary = rotary
        self.attn = Attention(
            layer_idx,
            self.num_heads,
            self.num_kv_heads,
            c.head_dim,
            c.attention_scale,
            c.layer_sliding_window(layer_idx),
            c.attn_logit_softcapping,
        )

    def forward(self, x: torch.Tensor, positions: torch.Tensor, fwd: ForwardBatch) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv_proj(x)
        if self.has_qk_norm and self.qk_norm_full:  # one [1, heads·dim] row per token
            q, k = self.q_norm(q.view(n, 1, -1)), self.k_norm(k.view(n, 1, -1))
        if self.clip_qkv is not None:
            q, k, v = (t.clamp(-self.clip_qkv, self.clip_qkv) for t in (q, k, v))
        q = q.view(n, self.num_heads, self.head_dim)
        k = k.view(n, self.num_kv_heads, self.head_dim)
        v = v.view(n, self.num_kv_heads, self.head_dim)
        if self.rotary is None:  # a NoPE layer
            if self.has_qk_norm and not self.qk_norm_full:
                q, k = self.q_norm(q), self.k_norm(k)
        elif self.has_qk_norm and not self.qk_norm_full:  # per head: norm and rotate, one op
            q, k = self.rotary.with_qk_norm(positions, q, k, self.q_norm, self.k_norm)
        else:
            q, k = self.rotary(positions, q, k)
        out = self.attn(q, k, v, fwd, self.sinks)  # [num_tokens, num_heads, head_dim]
        return self.o_proj(out.reshape(n, -1))


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig, intermediate_size: int | None = None) -> None:
        super().__init__()
        size = intermediate_size or config.intermediate_size
        tp = config.tp
        shard = out_shard = None
        if tp.size > 1:  # gate/up column-parallel, down row-parallel (one all-reduce)
            size //= tp.size
            shard = Shard(0, tp.rank, tp.size)
            out_shard = Shard(1, tp.rank, tp.size, reduce=True)
        self.gate_up_proj = MergedLinear(
            config.hidden_size, {"gate": size, "up": size}, shard=shard
        )
        self.down_proj = Linear(size, config.hidden_size, shard=out_shard)
        self.act = get_act_fn(config.hidden_act)
        self.act_and_mul = ActAndMul(config.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_proj.is_fused:  # [gate | up] from one matmul: one pass for act · mul
            return self.down_proj(self.act_and_mul(self.gate_up_proj.forward_fused(x)))
        gate, up = self.gate_up_proj(x)
        return self.down_proj(self.act(gate) * up)


class LlamaDecoderLayer(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        layer_idx: int,
        rotary: RotaryEmbedding | None,
        mlp: nn.Module | None = None,
    ) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config, layer_idx, rotary)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = mlp if mlp is not None else LlamaMLP(config)
        self.kernels: KernelBackend = TorchKernelBackend()  # the residual adds'; bound at load

    def forward(self, x: torch.Tensor, positions: torch.Tensor, fwd: ForwardBatch) -> torch.Tensor:
        h = self.kernels.add(x, self.self_attn(self.input_layernorm(x), positions, fwd))
        return self.kernels.add(h, self.mlp(self.post_attention_layernorm(h)))


class LlamaBackbone(nn.Module):
    """Embedding, decoder layers, final norm. ``make_mlp(layer_idx)``, if given, builds each
    layer's MLP (a mixture of experts, models/moe.py); None keeps LlamaMLP. ``layer``: the
    decoder layer's class (OLMo 2 moves its norms)."""

    def __init__(
        self,
        config: ModelConfig,
        max_position: int,
        make_mlp: Callable[[int], nn.Module | None] | None = None,
        layer: type[nn.Module] = LlamaDecoderLayer,
    ) -> None:
        super().__init__()
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size, config.tp)
        rotary = RotaryEmbedding(
            config.head_dim, max_position, config.rope_theta, config.rope_scaling,
            config.rotary_dim,
        )  # fmt: skip
        self.layers = nn.ModuleList(
            layer(
                config,
                i,
                rotary if config.layer_uses_rope(i) else None,
                make_mlp(i) if make_mlp else None,
            )  # fmt: skip
            for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


# The checkpoint's projections, as the fused layers hold them: (layer, checkpoint layer, part).
STACKED_PARAMS = (
    ("qkv_proj", "q_proj", "q"),
    ("qkv_proj", "k_proj", "k"),
    ("qkv_proj", "v_proj", "v"),
    ("gate_up_proj", "gate_proj", "gate"),
    ("gate_up_proj", "up_proj", "up"),
)


class LlamaForCausalLM(CausalLM):
    stacked_params = STACKED_PARAMS
    decoder_layer: type[nn.Module] = LlamaDecoderLayer

    def __init__(self, config: ModelConfig, max_position: int) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaBackbone(config, max_position, self.make_mlp, self.decoder_layer)
        if not config.tie_word_embeddings:
            self.lm_head = head_linear(config)

    def make_mlp(self, layer_idx: int) -> nn.Module | None:
        """Layer ``layer_idx``'s MLP; None: LlamaMLP (a family with other MLPs overrides it)."""
        return None

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, fwd: ForwardBatch
    ) -> torch.Tensor:
        h = self.model.embed_tokens(input_ids)  # [num_tokens, hidden]
        for layer in self.model.layers:
            h = layer(h, positions, fwd)
        return self.model.norm(h)
