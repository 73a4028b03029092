"""Phi-3 and Phi-4-mini (Abdin et al., 2024): Llama's block, with checkpoints that store q/k/v as
one ``qkv_proj`` and gate/up as one ``gate_up_proj``; the long-context models scale RoPE by
LongRoPE (config/checkpoint.py reads it, layers/rotary.py applies it) and Phi-4-mini rotates
only 3/4 of each head (``ModelConfig.rotary_dim``).

The fused checkpoint tensors are split here into the parts the Llama layers load (the layers
join them again where their formats allow one matmul): float tensors by rows, and GGUF block
formats by rows too (each row is its own run of blocks), so a packed tensor stays packed.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from tokenmill.models.llama import LlamaForCausalLM
from tokenmill.quant.packed import GGUFBlocks, PackedWeight

Weight = torch.Tensor | PackedWeight | GGUFBlocks


class Phi3ForCausalLM(LlamaForCausalLM):
    def checkpoint_tensors(
        self, weights: Iterable[tuple[str, Weight]]
    ) -> Iterator[tuple[str, Weight]]:
        """The fused q/k/v and gate/up split into the parts Llama's layers load."""
        c = self.config
        q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
        for name, weight in weights:
            prefix, _, kind = name.rpartition(".")
            if prefix.endswith("self_attn.qkv_proj"):
                base = prefix.removesuffix("qkv_proj")
                parts = _split_rows(weight, [q, kv, kv], name)
                yield from ((f"{base}{p}_proj.{kind}", w) for p, w in zip("qkv", parts))
            elif prefix.endswith("mlp.gate_up_proj"):
                base = prefix.removesuffix("gate_up_proj")
                gate, up = _split_rows(weight, [c.intermediate_size] * 2, name)
                yield f"{base}gate_proj.{kind}", gate
                yield f"{base}up_proj.{kind}", up
            else:
                yield name, weight


def _split_rows(weight: Weight, sizes: list[int], name: str) -> list[Weight]:
    if weight.shape[0] != sum(sizes):
        raise ValueError(
            f"checkpoint tensor {name!r} has {weight.shape[0]} rows; the config makes "
            f"{' + '.join(map(str, sizes))}"
        )
    if isinstance(weight, torch.Tensor):
        return list(weight.split(sizes))
    return weight.split_rows(sizes)
