"""TritonAttentionBackend (attention/triton/) against TorchAttentionBackend, in Triton's
interpreter on CPU tensors (tests/conftest.py sets TRITON_INTERPRET=1 without a GPU).

K/V writes store the very bytes torch stores (float, int8 and fp8 payloads and their scales),
except float32 -> bfloat16, which the interpreter truncates. Attention on the same cache agrees
to float32 rounding (2e-5) for float32 q, whatever the cache dtype: both read dequantized K/V
from it, except a fresh prompt under a float16 cache, which torch attends with its unrounded
K/V (2e-3 there). bfloat16 q: 1.6e-2 relative (one bf16 ulp: the interpreter truncates the
float32 -> bf16 output store, torch rounds). Decodes are checked with one partition and split
over many (PagedAttention v2's reduce), padding rows included; prefills alone, several in one
launch, on computed context, windowed, GQA 1/2/4, head_dim 16 and 256.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from tokenmill.attention import AttentionMetadata, PrefillSeq  # noqa: E402
from tokenmill.attention.backends import (  # noqa: E402
    TorchAttentionBackend,
    create_attention_backend,
)
from tokenmill.attention.backends.triton_backend import TritonAttentionBackend  # noqa: E402
from tokenmill.attention.triton import store_kv  # noqa: E402

KV_DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "int8": torch.int8,
    "fp8": torch.float8_e4m3fn,
}
QUANTIZED = (torch.int8, torch.float8_e4m3fn)
HEAD_DIM, BS = 16, 8
F32_TOL = dict(atol=2e-5, rtol=2e-5)
FRESH_F16_CACHE_TOL = dict(atol=2e-3, rtol=2e-3)
BF16_TOL = dict(atol=1e-3, rtol=1.6e-2)


def _caches(
    kv_dtype: torch.dtype, num_blocks: int, num_kv_heads: int, head_dim: int, g: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
    """K, V caches (and scales) with random context in every slot, stored by torch."""
    shape = (num_blocks, BS, num_kv_heads, head_dim)
    k_cache, v_cache = torch.zeros(shape, dtype=kv_dtype), torch.zeros(shape, dtype=kv_dtype)
    scales = (torch.zeros(shape[:-1]), torch.zeros(shape[:-1])) if kv_dtype in QUANTIZED else None
    k, v = torch.randn(2, num_blocks * BS, num_kv_heads, head_dim, generator=g)
    slots = torch.arange(num_blocks * BS)
    TorchAttentionBackend().store_kv(k, v, slots, k_cache, v_cache, scales)
    return k_cache, v_cache, scales


def _step(
    decode_seq_lens: list[int],
    prefills: list[tuple[int, int]],  # (num_computed, query_len)
    num_blocks: int,
    g: torch.Generator,
    padding_rows: tuple[int, ...] = (),  # seq_len of each padding decode row
) -> AttentionMetadata:
    """A step of decodes then prefill chunks, on blocks drawn at random (block 0 is padding).
    Padding decode rows point at block 0 and write to slot 0, as a padded graph batch does."""
    blocks = iter((torch.randperm(num_blocks - 1, generator=g) + 1).tolist())
    seqs = [(n - 1, 1) for n in decode_seq_lens] + prefills
    tables, slots, chunks, start = [], [], [], 0
    for i, (num_computed, query_len) in enumerate(seqs):
        seq_len = num_computed + query_len
        table = torch.tensor([next(blocks) for _ in range(-(-seq_len // BS))])
        positions = torch.arange(num_computed, seq_len)
        slots.append(table[positions // BS] * BS + positions % BS)
        tables.append(table)
        if i >= len(decode_seq_lens):
            chunks.append(PrefillSeq(start + len(padding_rows), query_len, num_computed, table))
        start += query_len
    nd = len(decode_seq_lens)
    width = max([len(t) for t in tables[:nd]] + [1])
    table = torch.zeros(nd + len(padding_rows), width, dtype=torch.long)
    for i, t in enumerate(tables[:nd]):
        table[i, : len(t)] = t
    slots = slots[:nd] + [torch.zeros(len(padding_rows), dtype=torch.long)] + slots[nd:]
    return AttentionMetadata(
        block_size=BS,
        slot_mapping=torch.cat(slots),
        num_decodes=nd + len(padding_rows),
        decode_block_table=table,
        decode_seq_lens=torch.tensor([*decode_seq_lens, *padding_rows], dtype=torch.long),
        prefills=chunks,
    )


def _compare(
    meta: AttentionMetadata,
    kv_dtype: torch.dtype = torch.float32,
    q_dtype: torch.dtype = torch.float32,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = HEAD_DIM,
    window: int | None = None,
    partition_size: int = 512,
    seed: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Both backends' outputs for one step on the same random caches and q/k/v; the caches
    they leave must agree too."""
    g = torch.Generator().manual_seed(seed)
    tables = [meta.decode_block_table.reshape(-1)] + [seq.block_ids for seq in meta.prefills]
    num_blocks = int(torch.cat(tables).max()) + 1
    k_cache, v_cache, scales = _caches(kv_dtype, num_blocks, num_kv_heads, head_dim, g)
    num_tokens = meta.slot_mapping.numel()
    q = torch.randn(num_tokens, num_heads, head_dim, generator=g).to(q_dtype)
    k, v = torch.randn(2, num_tokens, num_kv_heads, head_dim, generator=g).to(q_dtype)
    results = []
    for backend in (TritonAttentionBackend(partition_size), TorchAttentionBackend()):
        caches = [t.clone() for t in (k_cache, v_cache)]
        kv_scales = None if scales is None else (scales[0].clone(), scales[1].clone())
        out = backend.forward(q, k, v, *caches, meta, head_dim**-0.5, window, kv_scales)
        assert out.dtype == q_dtype and out.shape == q.shape
        results.append((out, caches, kv_scales))
    (ours, our_caches, our_scales), (ref, ref_caches, ref_scales) = results
    for got, want in zip(our_caches, ref_caches):
        if not (kv_dtype == torch.bfloat16 and q_dtype == torch.float32):
            assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    if our_scales is not None:
        assert torch.equal(our_scales[0], ref_scales[0])
        assert torch.equal(our_scales[1], ref_scales[1])
    assert not ours.isnan().any()
    return ours.float(), ref.float()


def _tol(q_dtype: torch.dtype) -> dict[str, float]:
    return BF16_TOL if q_dtype == torch.bfloat16 else F32_TOL


def test_registry_creates_the_triton_backend() -> None:
    backend = create_attention_backend("triton")
    assert type(backend) is TritonAttentionBackend and backend.name == "triton"


@pytest.mark.parametrize("kv_dtype", list(KV_DTYPES))
def test_store_kv_writes_torchs_bytes_and_scales(kv_dtype) -> None:
    g = torch.Generator().manual_seed(1)
    dtype = KV_DTYPES[kv_dtype]
    # A model's K/V come in the cache's dtype unless the cache is float16 or quantized; a
    # zero row (scale 0), rows of mixed magnitudes, and half-way int8 ties are included.
    x_dtype = torch.bfloat16 if dtype == torch.bfloat16 else torch.float32
    k, v = torch.randn(2, 12, 2, HEAD_DIM, generator=g) * torch.logspace(-3, 2, HEAD_DIM)
    k[0, 1] = 0.0
    k[1, 0] = torch.arange(HEAD_DIM) - 7.5  # scale 7.5 / 127: y = 127 / 7.5 * (i - 7.5)
    k, v = k.to(x_dtype), v.to(x_dtype)
    slots = torch.randperm(6 * BS, generator=g)[:12]
    slots[3] = -1  # a padding row: skipped
    caches = []
    for _ in range(2):
        c = [torch.zeros(6, BS, 2, HEAD_DIM, dtype=dtype) for _ in range(2)]
        s = (torch.full((6, BS, 2), -1.0), torch.full((6, BS, 2), -1.0))
        caches.append((c, s if dtype in QUANTIZED else None))
    (ours, our_scales), (ref, ref_scales) = caches
    store_kv(k, v, slots, *ours, our_scales)
    keep = slots >= 0
    TorchAttentionBackend().store_kv(k[keep], v[keep], slots[keep], *ref, ref_scales)
    for got, want in zip(ours, ref):
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    if our_scales is not None:
        assert torch.equal(our_scales[0], ref_scales[0])
        assert torch.equal(our_scales[1], ref_scales[1])
        assert (our_scales[0] >= 0).sum() == 2 * keep.sum()  # only the kept rows' scales


def test_store_kv_float32_into_bfloat16_is_within_an_ulp() -> None:
    # NOTE: the interpreter's float32 -> bf16 conversion truncates; a GPU rounds to nearest.
    k, v = torch.randn(2, 5, 2, HEAD_DIM, generator=torch.Generator().manual_seed(2))
    slots = torch.arange(5)
    ours = [torch.zeros(1, BS, 2, HEAD_DIM, dtype=torch.bfloat16) for _ in range(2)]
    store_kv(k, v, slots, *ours, None)
    for got, want in zip(ours, (k, v)):
        got = got.view(-1, 2, HEAD_DIM)[:5].float()
        torch.testing.assert_close(got, want, atol=0, rtol=2**-7)


@pytest.mark.parametrize("window", [None, 5, 40])
@pytest.mark.parametrize("num_heads, num_kv_heads", [(2, 2), (4, 2), (8, 2)])
def test_prefills_match_torch(num_heads, num_kv_heads, window) -> None:
    # One launch: a fresh prompt, a chunk on computed context, and a long fresh prompt with
    # two query blocks (BLOCK_M 64) and several key tiles.
    g = torch.Generator().manual_seed(3)
    meta = _step([], [(0, 13), (11, 9), (0, 70), (29, 2)], 40, g)
    ours, ref = _compare(meta, num_heads=num_heads, num_kv_heads=num_kv_heads, window=window)
    torch.testing.assert_close(ours, ref, **F32_TOL)


@pytest.mark.parametrize("window", [None, 20])
@pytest.mark.parametrize("partition_size", [512, 32])
@pytest.mark.parametrize("num_heads", [2, 8])
def test_decodes_match_torch(num_heads, partition_size, window) -> None:
    # 150 keys: five partitions of 32 (split-K), one of 512; 64 exactly two of 32.
    g = torch.Generator().manual_seed(4)
    meta = _step([1, 7, 13, 64, 150], [], 40, g)
    ours, ref = _compare(meta, num_heads=num_heads, window=window, partition_size=partition_size)
    torch.testing.assert_close(ours, ref, **F32_TOL)


@pytest.mark.parametrize("partition_size", [512, 16])
def test_padded_decode_rows_give_zeros_or_finite_rows(partition_size) -> None:
    # Rows a padded batch adds: seq_len 0 (nothing to attend: zeros, no NaN) and seq_len 1
    # on block 0; real rows are unaffected by them. One partition, and three (split-K).
    g = torch.Generator().manual_seed(5)
    meta = _step([9, 40], [], 12, g, padding_rows=(0, 1, 0))
    ours, ref = _compare(meta, partition_size=partition_size)
    assert torch.equal(ours[2], torch.zeros_like(ours[2]))
    assert torch.equal(ours[4], torch.zeros_like(ours[4]))
    torch.testing.assert_close(ours[[0, 1, 3]], ref[[0, 1, 3]], **F32_TOL)


def test_decodes_read_no_host_value(monkeypatch) -> None:
    # The decode path must be capturable by a CUDA graph: no .item() / .tolist() on tensors.
    g = torch.Generator().manual_seed(6)
    meta = _step([5, 70], [], 14, g)

    def host_read(*args, **kwargs):
        raise AssertionError("the decode path read a tensor on the host")

    k_cache, v_cache, _ = _caches(torch.float32, 14, 2, HEAD_DIM, g)
    q = torch.randn(2, 4, HEAD_DIM, generator=g)
    k, v = torch.randn(2, 2, 2, HEAD_DIM, generator=g)
    with monkeypatch.context() as m:
        m.setattr(torch.Tensor, "item", host_read)
        m.setattr(torch.Tensor, "tolist", host_read)
        ours = TritonAttentionBackend(32).forward(
            q, k, v, k_cache.clone(), v_cache.clone(), meta, 0.25, None
        )
    ref = TorchAttentionBackend().forward(q, k, v, k_cache, v_cache, meta, 0.25, None)
    torch.testing.assert_close(ours, ref, **F32_TOL)


MIXED_CASES = [
    ("float32", torch.float32),
    ("float16", torch.float32),
    ("int8", torch.float32),
    ("fp8", torch.float32),
    ("bfloat16", torch.bfloat16),
    ("int8", torch.bfloat16),
]


@pytest.mark.parametrize("window", [None, 7])
@pytest.mark.parametrize("kv_dtype, q_dtype", MIXED_CASES)
def test_mixed_steps_match_torch(kv_dtype, q_dtype, window) -> None:
    # Decodes (one split over partitions of 16) and prefill chunks in one call.
    g = torch.Generator().manual_seed(7)
    meta = _step([3, 37], [(0, 10), (12, 6)], 24, g)
    ours, ref = _compare(
        meta, KV_DTYPES[kv_dtype], q_dtype, window=window, partition_size=16, seed=1
    )
    tol = _tol(q_dtype)
    if kv_dtype == "float16":  # torch attends the fresh prompt with its unrounded K/V
        fresh = slice(2, 12)
        torch.testing.assert_close(ours[fresh], ref[fresh], **FRESH_F16_CACHE_TOL)
        ours, ref = torch.cat([ours[:2], ours[12:]]), torch.cat([ref[:2], ref[12:]])
    torch.testing.assert_close(ours, ref, **tol)


@pytest.mark.parametrize("kv_dtype", ["float32", "int8"])
def test_head_dim_256_like_gemma_3_270m(kv_dtype) -> None:
    # 4 heads on 1 KV head, head_dim 256 (32 x 32 tiles), a window, decodes and prefills.
    g = torch.Generator().manual_seed(8)
    meta = _step([5, 45], [(0, 9), (20, 5)], 20, g)
    ours, ref = _compare(
        meta, KV_DTYPES[kv_dtype], num_heads=4, num_kv_heads=1, head_dim=256, window=12,
        partition_size=32,
    )  # fmt: skip
    torch.testing.assert_close(ours, ref, **F32_TOL)
