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
    if window is not None:
        # As a window group's table: blocks wholly behind the first query's window were given
        # back and read as the null block 0, poisoned here so that any read of them shows.
        behind = max(0, num_computed - window + 1) // BS
        blocks[:behind] = 0
        k_cache[0], v_cache[0] = float("nan"), float("nan")
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


@pytest.mark.parametrize("window", [None, 8, 64])
def test_mixed_prefills_in_one_step_match_each_alone(window) -> None:
    # Three fresh prompts of one length (attended in one batched call when the window allows),
    # one of another length, then a chunk on cached context.
    g = torch.Generator().manual_seed(5)
    specs = [(0, 12), (0, 12), (0, 12), (0, 7), (9, 6)]  # (num_computed, query_len)
    scale = HEAD_DIM**-0.5
    blocks_per_seq = 3  # 24 slots each, enough for every sequence here
    shape = (1 + blocks_per_seq * len(specs), BS, NUM_KV_HEADS, HEAD_DIM)
    k_cache, v_cache = torch.zeros(shape), torch.zeros(shape)
    flat_k = k_cache.view(-1, NUM_KV_HEADS, HEAD_DIM)
    flat_v = v_cache.view(-1, NUM_KV_HEADS, HEAD_DIM)
    qs, ks, vs, slots, prefills, contexts = [], [], [], [], [], []
    start = 0
    for i, (computed, length) in enumerate(specs):
        blocks = torch.arange(1 + i * blocks_per_seq, 1 + (i + 1) * blocks_per_seq)
        base = int(blocks[0]) * BS
        k_all = torch.randn(computed + length, NUM_KV_HEADS, HEAD_DIM, generator=g)
        v_all = torch.randn(computed + length, NUM_KV_HEADS, HEAD_DIM, generator=g)
        flat_k[base : base + computed] = k_all[:computed]
        flat_v[base : base + computed] = v_all[:computed]
        qs.append(torch.randn(length, NUM_HEADS, HEAD_DIM, generator=g))
        ks.append(k_all[computed:])
        vs.append(v_all[computed:])
        slots += range(base + computed, base + computed + length)
        prefills.append(PrefillSeq(start, length, computed, blocks))
        contexts.append((k_all, v_all))
        start += length
    meta = AttentionMetadata(
        block_size=BS,
        slot_mapping=torch.tensor(slots),
        num_decodes=0,
        decode_block_table=torch.zeros((0, 1), dtype=torch.long),
        decode_seq_lens=torch.zeros(0, dtype=torch.long),
        prefills=prefills,
    )
    out = TorchAttentionBackend().forward(
        torch.cat(qs), torch.cat(ks), torch.cat(vs), k_cache, v_cache, meta, scale, window
    )
    for seq, q, (k_all, v_all) in zip(prefills, qs, contexts):
        got = out[seq.token_start : seq.token_start + seq.query_len]
        expected = _reference(q, k_all, v_all, seq.num_computed, window, scale)
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
