"""Tensor-parallel shard arithmetic (layers/parallel.py) and ModelConfig's per-rank heads; the
collectives themselves run in tests/executor/test_multiproc.py, over two real processes."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tokenmill.config import ModelConfig, TensorParallel
from tokenmill.layers import Linear
from tokenmill.layers.parallel import Shard, load_shard_, vocab_range
from tokenmill.quant.packed import GGUFBlocks


def test_rows_split_and_the_last_shard_is_zero_padded() -> None:
    loaded = torch.arange(5 * 2, dtype=torch.float32).view(5, 2)  # 5 rows over 2 shards of 3
    shards = [torch.full((3, 2), -1.0) for _ in range(2)]
    for idx, param in enumerate(shards):
        load_shard_(param, loaded, Shard(0, idx, 2))
    assert torch.equal(shards[0], loaded[:3])
    assert torch.equal(shards[1][:2], loaded[3:])
    assert torch.equal(shards[1][2], torch.zeros(2))
    assert torch.equal(torch.cat(shards)[:5], loaded)


def test_columns_split_and_a_row_parallel_bias_loads_on_shard_0_only() -> None:
    weight = torch.randn(3, 8)
    halves = [torch.empty(3, 4), torch.empty(3, 4)]
    for idx, param in enumerate(halves):
        load_shard_(param, weight, Shard(1, idx, 2, reduce=True))
    assert torch.equal(torch.cat(halves, dim=1), weight)
    bias = torch.randn(3)
    biases = [torch.empty(3), torch.empty(3)]
    for idx, param in enumerate(biases):
        load_shard_(param, bias, Shard(1, idx, 2, reduce=True))
    assert torch.equal(biases[0], bias) and torch.equal(biases[1], torch.zeros(3))


def test_columns_that_do_not_split_are_a_value_error() -> None:
    with pytest.raises(ValueError, match="does not split into 2"):
        load_shard_(torch.empty(3, 4), torch.randn(3, 7), Shard(1, 0, 2))


def test_sharded_linears_compute_the_whole_projection() -> None:
    """Column shards side by side, and row shards summed, equal the unsplit layer."""
    torch.manual_seed(0)
    x, w = torch.randn(5, 8), torch.randn(6, 8)
    cols = []
    for idx in range(2):
        lin = Linear(8, 3, shard=Shard(0, idx, 2))
        lin.weight_loader("weight", w)
        cols.append(lin(x))
    torch.testing.assert_close(torch.cat(cols, dim=1), x @ w.T)
    partial = []
    for idx in range(2):
        lin = Linear(4, 6, shard=Shard(1, idx, 2))  # reduce=False: summed here
        lin.weight_loader("weight", w)
        partial.append(lin(x[:, idx * 4 : (idx + 1) * 4]))
    torch.testing.assert_close(partial[0] + partial[1], x @ w.T)


def test_vocab_range_covers_the_vocabulary() -> None:
    ranges = [vocab_range(387, TensorParallel(r, 2)) for r in range(2)]
    assert ranges == [(0, 194), (194, 388)]


def _config(num_heads: int, num_kv_heads: int, rank: int, size: int) -> ModelConfig:
    config = ModelConfig(
        architecture="llama",
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=16,
        max_position_embeddings=64,
    )
    return dataclasses.replace(config, tp=TensorParallel(rank, size))


@pytest.mark.parametrize(
    ("kv", "size", "local_kv", "shards"),
    [
        (4, 2, 2, [(0, 2), (1, 2)]),  # split
        (1, 2, 1, [(0, 1), (0, 1)]),  # gemma-3-270m: one KV head on both ranks
        (2, 4, 1, [(0, 2), (0, 2), (1, 2), (1, 2)]),  # each KV head on two ranks
    ],
)
def test_kv_heads_split_or_replicate(kv: int, size: int, local_kv: int, shards: list) -> None:
    configs = [_config(4, kv, r, size) for r in range(size)]
    assert all(c.num_local_heads == 4 // size for c in configs)
    assert all(c.num_local_kv_heads == local_kv for c in configs)
    assert [c.kv_shard for c in configs] == shards


def test_heads_that_do_not_divide_are_refused() -> None:
    with pytest.raises(ValueError, match="must divide the model's 4 attention heads"):
        _config(4, 2, 0, 1).check_tensor_parallel(3)
    with pytest.raises(ValueError, match="6 KV heads must divide one another"):
        _config(12, 6, 0, 1).check_tensor_parallel(4)


def _q8_0_blocks(w: torch.Tensor) -> GGUFBlocks:
    """A float [N, K] matrix as GGUF Q8_0 bytes (per 32 elements: an f16 scale, 32 int8)."""
    n, k = w.shape
    groups = w.view(n, k // 32, 32)
    scale = (groups.abs().amax(-1, keepdim=True) / 127).clamp(min=1e-8).half()
    codes = (groups / scale.float()).round().clamp(-127, 127).to(torch.int8)
    raw = torch.cat([scale.view(torch.uint8), codes.view(torch.uint8)], dim=-1)  # [n, k/32, 34]
    return GGUFBlocks(raw.reshape(n, -1), 8, (n, k))


@pytest.mark.parametrize("dim", [0, 1])
def test_gguf_blocks_shards_pack_to_the_whole_weights_slices(dim: int) -> None:
    torch.manual_seed(0)
    blocks = _q8_0_blocks(torch.randn(8, 256))
    whole = blocks.pack().dequantize()
    shards = [blocks.shard(dim, idx, 2).pack().dequantize() for idx in range(2)]
    assert torch.equal(torch.cat(shards, dim=dim), whole)


def test_gguf_blocks_refuse_a_column_split_inside_a_block() -> None:
    blocks = _q8_0_blocks(torch.randn(4, 64))  # two 32-element blocks a row: 4 shards cut them
    with pytest.raises(ValueError, match="do not split into 4 shards on block boundaries"):
        blocks.shard(1, 0, 4)
