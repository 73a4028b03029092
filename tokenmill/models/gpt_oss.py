"""gpt-oss (OpenAI, 2025): a mixture-of-experts decoder on Llama's pre-norm block.

    h = x + Attn(RMSNorm(x));  out = h + MoE(RMSNorm(h))
    MoE(h) = Σ_{e ∈ top-k(h Rᵀ + b)} softmax_top-k(h Rᵀ + b)_e · Expert_e(h)
    Expert_e(h) = W_down (GLU(W_gate_up h + b_gate_up)) + b_down
    GLU: gate, up = the even and odd columns; gate ≤ limit, |up| ≤ limit;
         gate · σ(1.702 · gate) · (up + 1)

Attention: q/k/v and output projections with biases; every head has a learned sink logit that
joins its softmax (weight that goes nowhere: the torch backend's explicit attention computes
it); local (128-token window) and global layers alternate; YaRN-scaled RoPE.

The experts run in torch, each chosen expert once on its tokens (as transformers does), from
the checkpoint's float tensors (``mlp.experts.gate_up_proj`` [E, H, 2I] and ``down_proj``
[E, I, H], with their biases); MXFP4 checkpoints and GGUFs are not read yet.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.config import ModelConfig
from tokenmill.models.llama import LlamaForCausalLM

SWIGLU_ALPHA = 1.702


class GptOssRouter(nn.Module):
    """The router: logits h Rᵀ + b, the top k, softmax over them."""

    def __init__(self, num_experts: int, hidden_size: int, top_k: int) -> None:
        super().__init__()
        self.top_k = top_k
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(num_experts), requires_grad=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = F.linear(x, self.weight, self.bias)
        top, ids = torch.topk(logits, self.top_k, dim=-1)
        return torch.softmax(top, dim=-1), ids  # [tokens, k] weights and expert ids


class GptOssExperts(nn.Module):
    """The experts' stacked weights, as the checkpoint names and lays them out."""

    def __init__(self, num_experts: int, hidden: int, width: int, limit: float) -> None:
        super().__init__()
        self.limit = limit
        empty = dict(requires_grad=False)
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, hidden, 2 * width), **empty)
        self.gate_up_proj_bias = nn.Parameter(torch.empty(num_experts, 2 * width), **empty)
        self.down_proj = nn.Parameter(torch.empty(num_experts, width, hidden), **empty)
        self.down_proj_bias = nn.Parameter(torch.empty(num_experts, hidden), **empty)

    def glu(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate = gate_up[..., ::2].clamp(max=self.limit)
        up = gate_up[..., 1::2].clamp(-self.limit, self.limit)
        return gate * torch.sigmoid(gate * SWIGLU_ALPHA) * (up + 1)

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(x)
        for expert in ids.unique().tolist():  # each chosen expert once, on its tokens' rows
            tokens, slot = torch.where(ids == expert)
            h = x[tokens] @ self.gate_up_proj[expert] + self.gate_up_proj_bias[expert]
            y = self.glu(h) @ self.down_proj[expert] + self.down_proj_bias[expert]
            out.index_add_(0, tokens, y * weights[tokens, slot, None])
        return out


class GptOssMoE(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        moe = config.moe
        assert moe is not None and moe.swiglu_limit is not None
        self.router = GptOssRouter(moe.num_experts, config.hidden_size, moe.top_k)
        self.experts = GptOssExperts(
            moe.num_experts, config.hidden_size, moe.intermediate_size, moe.swiglu_limit
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.router(x)
        return self.experts(x, weights, ids)


class GptOssForCausalLM(LlamaForCausalLM):
    def make_mlp(self, layer_idx: int) -> nn.Module | None:
        return GptOssMoE(self.config)
