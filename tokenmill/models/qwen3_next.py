"""Qwen3-Next and Qwen3.5 (Qwen Team, 2025-26): hybrid models whose layers mix Gated DeltaNet
linear attention (Yang et al., 2025) with gated full attention, three of the first to one of
the second.

    h = x + Mixer(RMSNorm(x));  out = h + MLP(RMSNorm(h))      (RMSNorm scales by 1 + w)

Gated DeltaNet (``config.linear_attention``), per token:
    [q | k | v] = SiLU(causal depthwise conv(x W_qkv))           (kernel 4, over the last tokens)
    z = x W_z;  β = σ(x W_b);  g = −exp(A) · softplus(x W_a + dt_bias)   (per value head)
    q, k L2-normalized per head (q also scaled by 1/√d_k); key heads shared by groups of value
    heads; the gated delta rule (attention/recurrent.py) updates each value head's state S
    and reads o = Sᵀq;  out = W_o (RMSNorm(o) · SiLU(z))
Gated attention: q_proj also gives a gate per head: out = W_o (Attn(q, k, v) · σ(gate)), with
per-head QK-norm and RoPE over the first quarter of each head (``rotary_dim``).

The MLP is dense (Qwen3.5) or a mixture of experts with a gated shared expert (Qwen3-Next,
Qwen3.5-MoE: models/moe.py's block). Qwen3-Next's checkpoints store [q|k|v|z] and [b|a] as
two projections interleaved per key head; they are laid out here as Qwen3.5's four.

Linear-attention layers keep no K/V: the KV cache holds the attention layers alone
(``ModelConfig.kv_layers``), and each request carries its recurrent state
(``ForwardBatch.states``).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.attention import Attention, ForwardBatch
from tokenmill.attention.recurrent import (
    causal_conv,
    causal_conv_step,
    chunked_gated_delta_rule,
    gated_delta_rule,
)
from tokenmill.config import LINEAR_ATTENTION, LinearAttentionConfig, ModelConfig
from tokenmill.kernels.base import KernelBackend
from tokenmill.kernels.torch_backend import TorchKernelBackend
from tokenmill.layers import Embedding, GemmaRMSNorm, Linear, QKVLinear, RotaryEmbedding
from tokenmill.models.base import CausalLM, head_linear
from tokenmill.models.llama import STACKED_PARAMS, LlamaMLP
from tokenmill.models.moe import SparseMoeBlock
from tokenmill.quant.packed import GGUFBlocks, PackedWeight

Weight = torch.Tensor | PackedWeight | GGUFBlocks


class GatedDeltaNet(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        lin = config.linear_attention
        assert lin is not None
        self.lin = lin
        self.state_idx = config.linear_layers.index(layer_idx)
        hidden = config.hidden_size
        self.in_proj_qkv = Linear(hidden, lin.conv_dim)
        self.in_proj_z = Linear(hidden, lin.value_dim)
        self.in_proj_b = Linear(hidden, lin.num_v_heads)
        self.in_proj_a = Linear(hidden, lin.num_v_heads)
        # The depthwise convolution's taps, one row per channel (checkpoints: [C, 1, K]).
        self.conv1d = DepthwiseConv(lin.conv_dim, lin.conv_kernel)
        self.dt_bias = nn.Parameter(torch.empty(lin.num_v_heads), requires_grad=False)
        self.A_log = nn.Parameter(torch.empty(lin.num_v_heads), requires_grad=False)
        self.norm = GatedRMSNorm(lin.v_head_dim, config.rms_norm_eps)
        self.out_proj = Linear(lin.value_dim, hidden)

    def forward(self, x: torch.Tensor, fwd: ForwardBatch) -> torch.Tensor:
        lin, n = self.lin, x.shape[0]
        rec = fwd.recurrent
        assert rec is not None, "a linear-attention layer needs the step's recurrent slots"
        conv_state, ssm_state = fwd.states[self.state_idx]
        mixed = self.in_proj_qkv(x)  # [n, conv_dim]
        z = self.in_proj_z(x).view(n, lin.num_v_heads, lin.v_head_dim)
        beta = torch.sigmoid(self.in_proj_b(x)).float()  # [n, Hv]
        g = -self.A_log.float().exp() * F.softplus(self.in_proj_a(x).float() + self.dt_bias)
        out = torch.empty(n, lin.num_v_heads, lin.v_head_dim, dtype=torch.float32, device=x.device)
        weight = self.conv1d.weight
        nd = rec.num_decodes
        if nd:  # one token each: the whole batch in one step
            slots = rec.decode_slots
            conv_out, conv_state[slots] = causal_conv_step(mixed[:nd], conv_state[slots], weight)
            q, k, v = self._heads(conv_out)
            o, ssm_state[slots] = gated_delta_rule(
                q[:, None], k[:, None], v[:, None], g[:nd, None], beta[:nd, None], ssm_state[slots]
            )
            out[:nd] = o[:, 0]
        start = nd
        for slot, length in zip(rec.slots[nd:], rec.query_lens[nd:]):
            rows = slice(start, start + length)
            conv_out, conv_state[slot] = causal_conv(mixed[rows], conv_state[slot], weight)
            q, k, v = self._heads(conv_out)
            out[rows], ssm_state[slot] = chunked_gated_delta_rule(
                q, k, v, g[rows], beta[rows], ssm_state[slot]
            )
            start += length
        o = self.norm(out.to(x.dtype), z)
        return self.out_proj(o.reshape(n, lin.value_dim))

    def _heads(self, mixed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """[n, conv_dim] -> q, k [n, Hv, dk] (normalized, q scaled; each key head repeated for
        its group of value heads), v [n, Hv, dv]."""
        lin, n = self.lin, mixed.shape[0]
        q, k, v = mixed.split([lin.key_dim, lin.key_dim, lin.value_dim], dim=-1)
        group = lin.num_v_heads // lin.num_k_heads
        q, k = (
            F.normalize(t.float().view(n, lin.num_k_heads, lin.k_head_dim), dim=-1, eps=1e-6)
            for t in (q, k)
        )
        if group > 1:  # value head h reads key head h // group (tiled: h % num_k_heads)
            q, k = (t.repeat(1, group, 1) if lin.v_heads_tiled else t.repeat_interleave(group, 1)
                    for t in (q, k))  # fmt: skip
        return q * lin.k_head_dim**-0.5, k, v.view(n, lin.num_v_heads, lin.v_head_dim)


class DepthwiseConv(nn.Module):
    def __init__(self, channels: int, kernel: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(channels, kernel), requires_grad=False)

    def weight_loader(self, param_name: str, tensor: Weight, packed_method: object = None) -> None:
        if not isinstance(tensor, torch.Tensor):  # a GGUF's F16 taps, kept packed
            tensor = tensor.dequantize()
        self.weight.data.copy_(tensor.reshape(self.weight.shape))


class GatedRMSNorm(nn.Module):
    """RMSNorm of each head's output, then times SiLU of its gate z (weights as stored)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim), requires_grad=False)

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)
        return (self.weight * normed * F.silu(z.float())).to(x.dtype)


class GatedAttention(nn.Module):
    """Full attention whose q_proj also yields a gate per head (rows [q_h | gate_h] per head):
    the attention output is scaled by σ(gate) before o_proj (``config.attn_output_gate``;
    without it, q_proj gives q alone)."""

    def __init__(self, config: ModelConfig, layer_idx: int, rotary: RotaryEmbedding) -> None:
        super().__init__()
        c = config
        self.num_heads, self.num_kv_heads, self.head_dim = (
            c.num_attention_heads,
            c.num_key_value_heads,
            c.head_dim,
        )
        self.gated = c.attn_output_gate
        # Gated, q_proj's rows are twice the heads': QKVLinear's q part takes them whole.
        q_heads = 2 * self.num_heads if self.gated else self.num_heads
        self.qkv_proj = QKVLinear(
            c.hidden_size, c.head_dim, q_heads, self.num_kv_heads, c.attention_bias
        )
        self.o_proj = Linear(self.num_heads * c.head_dim, c.hidden_size)
        self.q_norm = GemmaRMSNorm(c.head_dim, c.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(c.head_dim, c.rms_norm_eps)
        self.rotary = rotary
        self.attn = Attention(
            c.kv_layer_index(layer_idx),  # its K/V cache among the attention layers'
            self.num_heads,
            self.num_kv_heads,
            c.head_dim,
            c.attention_scale,
            c.layer_sliding_window(layer_idx),
        )

    def forward(self, x: torch.Tensor, positions: torch.Tensor, fwd: ForwardBatch) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv_proj(x)
        gate = None
        if self.gated:
            q, gate = q.view(n, self.num_heads, 2 * self.head_dim).chunk(2, dim=-1)
        q = self.q_norm(q.reshape(n, self.num_heads, self.head_dim))
        k = self.k_norm(k.reshape(n, self.num_kv_heads, self.head_dim))
        q, k = self.rotary(positions, q, k)
        out = self.attn(q, k, v.reshape(n, self.num_kv_heads, self.head_dim), fwd)
        if gate is not None:
            out = out * torch.sigmoid(gate)
        return self.o_proj(out.reshape(n, -1))


class HybridDecoderLayer(nn.Module):
    def __init__(
        self, config: ModelConfig, layer_idx: int, rotary: RotaryEmbedding, mlp: nn.Module
    ) -> None:
        super().__init__()
        dim, eps = config.hidden_size, config.rms_norm_eps
        self.is_linear = config.layer_types[layer_idx] == LINEAR_ATTENTION
        self.input_layernorm = GemmaRMSNorm(dim, eps)
        if self.is_linear:
            self.linear_attn = GatedDeltaNet(config, layer_idx)
        else:
            self.self_attn = GatedAttention(config, layer_idx, rotary)
        self.post_attention_layernorm = GemmaRMSNorm(dim, eps)
        self.mlp = mlp
        self.kernels: KernelBackend = TorchKernelBackend()  # the residual adds'; bound at load

    def forward(self, x: torch.Tensor, positions: torch.Tensor, fwd: ForwardBatch) -> torch.Tensor:
        h = self.input_layernorm(x)
        mixed = self.linear_attn(h, fwd) if self.is_linear else self.self_attn(h, positions, fwd)
        h = self.kernels.add(x, mixed)
        return self.kernels.add(h, self.mlp(self.post_attention_layernorm(h)))


class HybridBackbone(nn.Module):
    def __init__(self, config: ModelConfig, max_position: int) -> None:
        super().__init__()
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size, config.tp)
        rotary = RotaryEmbedding(
            config.head_dim, max_position, config.rope_theta, config.rope_scaling,
            config.rotary_dim,
        )  # fmt: skip
        moe = config.moe
        self.layers = nn.ModuleList(
            HybridDecoderLayer(
                config,
                i,
                rotary,
                SparseMoeBlock(config) if moe and moe.sparse_layers[i] else LlamaMLP(config),
            )
            for i in range(config.num_hidden_layers)
        )
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)


class Qwen3NextForCausalLM(CausalLM):
    stacked_params = STACKED_PARAMS

    def __init__(self, config: ModelConfig, max_position: int) -> None:
        super().__init__()
        self.config = config
        self.model = HybridBackbone(config, max_position)
        if not config.tie_word_embeddings:
            self.lm_head = head_linear(config)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, fwd: ForwardBatch
    ) -> torch.Tensor:
        h = self.model.embed_tokens(input_ids)
        for layer in self.model.layers:
            h = layer(h, positions, fwd)
        return self.model.norm(h)

    def checkpoint_tensors(
        self, weights: Iterable[tuple[str, Weight]]
    ) -> Iterator[tuple[str, Weight]]:
        """Qwen3-Next's fused in_proj_qkvz / in_proj_ba, laid out as Qwen3.5's four
        projections; Qwen3.5's ``model.language_model.`` prefix is the loader's."""
        lin = self.config.linear_attention
        for name, weight in weights:
            if lin is not None and name.endswith(("in_proj_qkvz.weight", "in_proj_ba.weight")):
                base = name.rpartition("in_proj_")[0]
                yield from _unfuse(base, name, weight, lin)
            elif name.startswith(("mtp.", "model.visual.", "visual.")):
                continue  # the multi-token-prediction head and the vision tower: not run
            else:
                yield name, weight


def _unfuse(
    base: str, name: str, weight: Weight, lin: LinearAttentionConfig
) -> Iterator[tuple[str, Weight]]:
    """Per key head, Qwen3-Next stores [q | k | v | z] (v, z: its group of value heads) and
    [b | a]; Qwen3.5's layout is every head's q, then k, then v (and z, b, a apart). Rows are
    picked by index, so a GGUF's packed rows stay packed."""
    group = lin.num_v_heads // lin.num_k_heads
    dk, dv = lin.k_head_dim, lin.v_head_dim
    if name.endswith("in_proj_ba.weight"):
        parts = {"b": group, "a": group}
    else:
        parts = {"q": dk, "k": dk, "v": group * dv, "z": group * dv}
    per_head = sum(parts.values())
    if weight.shape[0] != lin.num_k_heads * per_head:
        raise ValueError(f"checkpoint tensor {name!r} has {weight.shape[0]} rows; the config "
                         f"makes {lin.num_k_heads * per_head}")  # fmt: skip
    rows: dict[str, list[int]] = {p: [] for p in parts}
    for head in range(lin.num_k_heads):
        start = head * per_head
        for part, size in parts.items():
            rows[part] += range(start, start + size)
            start += size
    if "q" in rows:  # the convolution's channels: q, k and v of every head, in that order
        rows = {"qkv": rows["q"] + rows["k"] + rows["v"], "z": rows["z"]}
    for part, index in rows.items():
        yield f"{base}in_proj_{part}.weight", _rows(weight, index)


def _rows(weight: Weight, index: list[int]) -> Weight:
    order = torch.tensor(index)
    return weight[order] if isinstance(weight, torch.Tensor) else weight.select_rows(order)
