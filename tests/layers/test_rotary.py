"""RoPE's tables against transformers' rotary embeddings: Phi-3's LongRoPE (short factors within
the original context, long ones beyond it, both scaled by the attention factor) on part of each
head (Phi-4-mini's partial rotary)."""

from __future__ import annotations

import pytest
import torch
from conftest import PHI3_LONGROPE, TINY_COMMON

from tokenmill.config.checkpoint import _longrope
from tokenmill.layers.rotary import RotaryEmbedding


def _hf_cos_sin(position: int) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' cos and sin at one position, alone in its batch (so a position past the
    original context switches it to the long factors, as it does then for every position)."""
    import transformers as tf
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

    config = tf.Phi3Config(**TINY_COMMON, num_hidden_layers=1, original_max_position_embeddings=256,
                           rope_parameters=PHI3_LONGROPE)  # fmt: skip
    rotary = Phi3RotaryEmbedding(config)
    x = torch.zeros(1, 1, 16)
    cos, sin = rotary(x, torch.tensor([[position]]))
    return cos[0, 0], sin[0, 0]  # [rotary_dim], halves repeated


@pytest.mark.parametrize("position", [0, 17, 255, 256, 300, 511])
def test_longrope_matches_transformers_by_position(position: int) -> None:
    scaling = _longrope(
        {"max_position_embeddings": 512, "original_max_position_embeddings": 256},
        {**PHI3_LONGROPE, "original_max_position_embeddings": 256},
    )
    rotary = RotaryEmbedding(16, 512, 10000.0, scaling, rotary_dim=8)
    cos, sin = _hf_cos_sin(position)
    torch.testing.assert_close(rotary.cos[position], cos[:4], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(rotary.sin[position], sin[:4], rtol=1e-6, atol=1e-6)


def test_partial_rotary_leaves_the_rest_of_each_head() -> None:
    rotary = RotaryEmbedding(16, 64, 10000.0, rotary_dim=8)
    q, k = torch.randn(5, 4, 16), torch.randn(5, 2, 16)
    q_out, k_out = rotary(torch.arange(5), q.clone(), k.clone())
    assert torch.equal(q_out[..., 8:], q[..., 8:]) and torch.equal(k_out[..., 8:], k[..., 8:])
    whole = RotaryEmbedding(8, 64, 10000.0)  # the rotated part: RoPE of an 8-dim head
    q_ref, k_ref = whole(torch.arange(5), q[..., :8].clone(), k[..., :8].clone())
    torch.testing.assert_close(q_out[..., :8], q_ref)
    torch.testing.assert_close(k_out[..., :8], k_ref)
