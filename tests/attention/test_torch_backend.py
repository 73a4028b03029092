"""The torch backend's prefill attention equals plain masked softmax attention, for whole
prompts and for chunks on top of cached context, with and without a sliding window (windowed
prefills attend block by block to the keys the window reaches)."""

from __future__ import annotations

import pytest
import torch

from tokenmill.attention import AttentionMetadata, PrefillSeq
from tokenmill.attention.backends import TorchAttentionBackend

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BS = 4, 2, 16, 8


def _reference(q, k, v, num_computed: int, window: int | None, scale: float) -> torch.Tensor:
    """Queries at positions num_computed.., keys at 0..: causal, within the window."""
    group = NUM_HEADS // NUM_KV_HEADS
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k.double()) * scale
    q_pos = torch.arange(num_computed, num_computed + q.shape[0])[:, None]
    k_pos = torch.arange(k.shape[0])[None, :]
    mask = k_pos <= q_pos
    if window is not None:
        mask &= k_pos > q_pos - window
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v.double()).float()


@pytest.mark.parametrize("window", [None, 4, 7, 16, 64])
@pytest.mark.parametrize("num_computed, query_len", [(0, 37), (13, 24), (29, 1 + 8)])
def test_prefill_matches_masked_softmax(window, num_computed, query_len) -> None:
    g = torch.Generator().manual_seed(window or 0)
    seq_len = num_computed + query_len
    q = torch.randn(query_len, NUM_HEADS, HEAD_DIM, generator=g)
    k_all = torch.randn(seq_len, NUM_KV_HEADS, HEAD_DIM, generator=g)
    v_all = torch.randn(seq_len, NUM_KV_HEADS, HEAD_DIM, generator=g)
    num_blocks = -(-seq_len // BS)
    shape = (num_blocks + 1, BS, NUM_KV_HEADS, HEAD_DIM)
    k_cache, v_cache = torch.zeros(shape), torch.zeros(shape)
    blocks = torch.arange(1, num_blocks + 1)  # block 0 unused
    flat_k, flat_v = (
        k_cache.view(-1, NUM_KV_HEADS, HEAD_DIM),
        v_cache.view(-1, NUM_KV_HEADS, HEAD_DIM),
    )
    flat_k[BS : BS + num_computed] = k_all[:num_computed]  # the context already cached
    flat_v[BS : BS + num_computed] = v_all[:num_computed]
    meta = AttentionMetadata(
        block_size=BS,
        slot_mapping=torch.arange(BS + num_computed, BS + seq_len),
        num_decodes=0,
        decode_block_table=torch.zeros((0, 1), dtype=torch.long),
        decode_seq_lens=torch.zeros(0, dtype=torch.long),
        prefills=[PrefillSeq(0, query_len, num_computed, blocks)],
    )
    scale = HEAD_DIM**-0.5
    out = TorchAttentionBackend().forward(
        q, k_all[num_computed:], v_all[num_computed:], k_cache, v_cache, meta, scale, window
    )
    expected = _reference(q, k_all, v_all, num_computed, window, scale)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
