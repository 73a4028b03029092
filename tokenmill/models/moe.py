"""Sparse mixture-of-experts decoders: Mixtral (Jiang et al., 2024), Qwen2-MoE, Qwen3-MoE and
OLMoE (Muennighoff et al., 2024). Each is its dense sibling's block with the MLP swapped:

    h = x + Attn(RMSNorm(x));  out = h + MoE(RMSNorm(h))
    MoE(h) = Σ_{e ∈ top-k(softmax(h Rᵀ))} p_e · Expert_e(h)   (+ σ(h · g) · SharedExpert(h))

- Mixtral: Mistral's attention; top-2 of 8, weights renormalized over the two.
- Qwen2-MoE: Qwen2's attention (q/k/v biases); a shared expert every token runs, scaled by a
  sigmoid gate; weights not renormalized (``norm_topk_prob``).
- Qwen3-MoE: Qwen3's attention (per-head QK-norm); renormalized.
- OLMoE: QK-norm over all heads at once; not renormalized.
Qwen's ``decoder_sparse_step`` / ``mlp_only_layers`` keep some layers dense
(``MoEConfig.sparse_layers``). The router and experts are in tokenmill/moe.
"""

from __future__ import annotations

import torch
from torch import nn

from tokenmill.config import ModelConfig
from tokenmill.models.llama import LlamaForCausalLM, LlamaMLP
from tokenmill.moe import FusedMoE, Router


class SharedExpertGate(nn.Module):
    """Qwen2-MoE's gate of the shared expert: one float row [1, H] (a Linear to one output)."""

    def __init__(self, hidden_size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(1, hidden_size), requires_grad=False)


class SparseMoeBlock(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        moe = config.moe
        assert moe is not None
        self.gate = Router(moe.num_experts, config.hidden_size, moe.top_k, moe.renormalize)
        self.experts = FusedMoE(
            moe.num_experts, config.hidden_size, moe.intermediate_size, config.hidden_act
        )
        self.has_shared = moe.shared_intermediate_size > 0
        if self.has_shared:
            self.shared_expert = LlamaMLP(config, moe.shared_intermediate_size)
            self.shared_expert_gate = SharedExpertGate(config.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x)
        if not self.has_shared:
            return self.experts(x, weights, ids)
        shared = self.shared_expert(x)
        return self.experts(x, weights, ids, shared, self.shared_expert_gate.weight[0])


# Mixtral's checkpoint names -> the Qwen names the modules here carry.
_MIXTRAL_NAMES = {
    ".block_sparse_moe.": ".mlp.",
    ".w1.": ".gate_proj.",
    ".w3.": ".up_proj.",
    ".w2.": ".down_proj.",
}


class MoeForCausalLM(LlamaForCausalLM):
    def make_mlp(self, layer_idx: int) -> nn.Module | None:
        """The sparse layers' MLP is a mixture of experts; the others keep LlamaMLP."""
        moe = self.config.moe
        assert moe is not None
        return SparseMoeBlock(self.config) if moe.sparse_layers[layer_idx] else None

    def checkpoint_name(self, name: str) -> str:
        """Mixtral's expert tensors by the names used here (``mlp.experts.3.gate_proj``)."""
        if self.config.architecture == "mixtral" and ".block_sparse_moe." in name:
            for old, new in _MIXTRAL_NAMES.items():
                name = name.replace(old, new)
        return name
