"""TritonAttentionBackend (attention/triton/) against TorchAttentionBackend. The kernels run
on tests/conftest.py's ``triton_device``: compiled, on CUDA tensors, where a GPU is present;
else in Triton's interpreter on CPU tensors (conftest.py sets TRITON_INTERPRET=1 without a
GPU). Inputs are drawn on the CPU and copied there; the torch oracle runs on the CPU copies
and results are compared on the CPU. NOTE: not torch on CUDA as the oracle: CUDA's division by
a Python scalar multiplies by its reciprocal, so torch's int8 / fp8 scales there can differ by
an ulp from quantize_kv's IEEE quotient, which the kernels compute (div_rn) as torch on the CPU.

K/V writes store the very bytes torch stores (float, int8 and fp8 payloads and their scales),
except float32 -> bfloat16, which the interpreter truncates (a GPU rounds to nearest as torch
does, and there those bytes are equal too). Attention on the same cache agrees to float32
rounding (2e-5) for float32 q, whatever the cache dtype (the kernels' float32 dot products are
IEEE, not TF32, on a GPU too): both read dequantized K/V from it, except a fresh prompt under a
float16 cache, which torch attends with its unrounded K/V (2e-3 there). bfloat16 q: 1.6e-2
relative in the interpreter (one bf16 ulp: it truncates the float32 -> bf16 output store,
torch rounds); on a GPU see BF16_GPU_TOL. Decodes are checked with one partition and split
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
from tokenmill.attention.triton.decode import (  # noqa: E402
    MIN_PARTITION_SIZE,
    PARTITION_SIZE,
    decode_partition_size,
)

KV_DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "int8": torch.int8,
    "fp8": torch.float8_e4m3fn,
}
QUANTIZED = (torch.int8, torch.float8_e4m3fn)
HEAD_DIM, BS = 16, 8
CPU = torch.device("cpu")
F32_TOL = dict(atol=2e-5, rtol=2e-5)
FRESH_F16_CACHE_TOL = dict(atol=2e-3, rtol=2e-3)
BF16_TOL = dict(atol=1e-3, rtol=1.6e-2)
# NOTE: on a GPU, bfloat16 q's dot products take bf16 operands (paged.dot_dtype: the
# dequantized K/V and the probabilities rounded to bf16 for the tensor cores, as CUDA's SDPA
# computes), where the oracle computes in float32: each weight and value carries up to 2^-8
# relative error, so an output near 0 moves by up to ~2^-8 times its weighted |v|. Those
# roundings emulated on the CPU (1-40 keys, 48k outputs) reached 0.57 of this tolerance and
# 3.8 times BF16_TOL. A wrong key, mask or scale moves an output by a key's weight times |v|
# (~3e-2 and more with the <= 37 keys here), and a stale or missing row by ~1.
BF16_GPU_TOL = dict(atol=1e-2, rtol=1.6e-2)


def _caches(
    kv_dtype: torch.dtype, num_blocks: int, num_kv_heads: int, head_dim: int, g: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
    """K, V caches (and scales) with random context in every slot, stored by torch (CPU)."""
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
    """A step of decodes then prefill chunks, on blocks drawn at random (block 0 is padding),
    its tensors on the CPU (``_to`` moves them). Padding decode rows point at block 0 and write
    to slot 0, as a padded graph batch does."""
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


def _to(meta: AttentionMetadata, device: torch.device) -> AttentionMetadata:
    """``meta`` with its tensors on ``device`` (the Triton kernels' copy of a CPU step)."""
    return AttentionMetadata(
        block_size=meta.block_size,
        slot_mapping=meta.slot_mapping.to(device),
        num_decodes=meta.num_decodes,
        decode_block_table=meta.decode_block_table.to(device),
        decode_seq_lens=meta.decode_seq_lens.to(device),
        prefills=[
            PrefillSeq(s.token_start, s.query_len, s.num_computed, s.block_ids.to(device))
            for s in meta.prefills
        ],
    )


def _on(device: torch.device, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Copies of CPU tensors on ``device`` (copies on the CPU too: each backend writes its own
    caches)."""
    return tuple(t.to(device, copy=True) for t in tensors)


def _compare(
    meta: AttentionMetadata,
    device: torch.device,
    kv_dtype: torch.dtype = torch.float32,
    q_dtype: torch.dtype = torch.float32,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = HEAD_DIM,
    window: int | None = None,
    partition_size: int | None = 512,
    seed: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Both backends' outputs (on the CPU, float32) for one step on the same random caches and
    q/k/v, Triton's on ``device``, torch's on the CPU; the caches they leave must agree too."""
    g = torch.Generator().manual_seed(seed)
    tables = [meta.decode_block_table.reshape(-1)] + [seq.block_ids for seq in meta.prefills]
    num_blocks = int(torch.cat(tables).max()) + 1
    k_cache, v_cache, scales = _caches(kv_dtype, num_blocks, num_kv_heads, head_dim, g)
    num_tokens = meta.slot_mapping.numel()
    q = torch.randn(num_tokens, num_heads, head_dim, generator=g).to(q_dtype)
    k, v = torch.randn(2, num_tokens, num_kv_heads, head_dim, generator=g).to(q_dtype)
    scale = head_dim**-0.5
    ref_caches = _on(CPU, k_cache, v_cache)
    ref_scales = None if scales is None else _on(CPU, *scales)
    ref = TorchAttentionBackend().forward(q, k, v, *ref_caches, meta, scale, window, ref_scales)
    our_caches = _on(device, k_cache, v_cache)
    our_scales = None if scales is None else _on(device, *scales)
    ours = TritonAttentionBackend(partition_size).forward(
        *_on(device, q, k, v), *our_caches, _to(meta, device), scale, window, our_scales
    )
    for out in (ours, ref):
        assert out.dtype == q_dtype and out.shape == q.shape
    # The interpreter truncates float32 -> bfloat16 stores; a GPU rounds to nearest, as torch.
    if not (kv_dtype == torch.bfloat16 and q_dtype == torch.float32 and device.type == "cpu"):
        for got, want in zip(our_caches, ref_caches):
            got = got.cpu()
            # Block 0's first slot is the pad slot: several padding rows write it, and on a GPU
            # in any order (an engine's padding rows all write the same token's K/V).
            got[0, 0], want[0, 0] = 0, 0
            assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    if our_scales is not None:
        assert torch.equal(our_scales[0].cpu(), ref_scales[0])
        assert torch.equal(our_scales[1].cpu(), ref_scales[1])
    assert not ours.isnan().any()
    return ours.float().cpu(), ref.float()


def _tol(q_dtype: torch.dtype, device: torch.device) -> dict[str, float]:
    if q_dtype != torch.bfloat16:
        return F32_TOL
    return BF16_GPU_TOL if device.type == "cuda" else BF16_TOL


def test_registry_creates_the_triton_backend() -> None:
    backend = create_attention_backend("triton")
    assert type(backend) is TritonAttentionBackend and backend.name == "triton"


@pytest.mark.parametrize("kv_dtype", list(KV_DTYPES))
def test_store_kv_writes_torchs_bytes_and_scales(triton_device, kv_dtype) -> None:
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
    (ref, ref_scales), (ours, our_scales) = caches
    ours = _on(triton_device, *ours)
    our_scales = None if our_scales is None else _on(triton_device, *our_scales)
    store_kv(*_on(triton_device, k, v, slots), *ours, our_scales)
    keep = slots >= 0
    TorchAttentionBackend().store_kv(k[keep], v[keep], slots[keep], *ref, ref_scales)
    for got, want in zip(ours, ref):
        assert torch.equal(got.cpu().view(torch.uint8), want.view(torch.uint8))
    if dtype == torch.float8_e4m3fn:  # covered: negative values that round to -0.0 (0x80)
        assert (ref[1].view(torch.uint8) == 0x80).any()
    if our_scales is not None:
        assert torch.equal(our_scales[0].cpu(), ref_scales[0])
        assert torch.equal(our_scales[1].cpu(), ref_scales[1])
        # Only the kept rows' scales were written.
        assert (our_scales[0] >= 0).sum().item() == 2 * keep.sum().item()


def test_store_kv_float32_into_bfloat16_is_within_an_ulp(triton_device) -> None:
    # NOTE: the interpreter's float32 -> bf16 conversion truncates; a GPU rounds to nearest,
    # as torch's conversion does, so there the bytes are torch's.
    k, v = torch.randn(2, 5, 2, HEAD_DIM, generator=torch.Generator().manual_seed(2))
    slots = torch.arange(5)
    blank = torch.zeros(1, BS, 2, HEAD_DIM, dtype=torch.bfloat16)
    ours = _on(triton_device, blank, blank)
    store_kv(*_on(triton_device, k, v, slots), *ours, None)
    for got, want in zip(ours, (k, v)):
        got = got.view(-1, 2, HEAD_DIM)[:5].cpu()
        torch.testing.assert_close(got.float(), want, atol=0, rtol=2**-7)
        if triton_device.type == "cuda":
            assert torch.equal(got, want.to(torch.bfloat16))


@pytest.mark.parametrize("window", [None, 5, 40])
@pytest.mark.parametrize("num_heads, num_kv_heads", [(2, 2), (4, 2), (8, 2)])
def test_prefills_match_torch(triton_device, num_heads, num_kv_heads, window) -> None:
    # One launch: a fresh prompt, a chunk on computed context, and a long fresh prompt with
    # two query blocks (BLOCK_M 64) and several key tiles.
    g = torch.Generator().manual_seed(3)
    meta = _step([], [(0, 13), (11, 9), (0, 70), (29, 2)], 40, g)
    ours, ref = _compare(
        meta, triton_device, num_heads=num_heads, num_kv_heads=num_kv_heads, window=window
    )
    torch.testing.assert_close(ours, ref, **F32_TOL)


def test_a_small_batch_splits_its_context_and_a_full_one_does_not() -> None:
    assert decode_partition_size(1, 1, 4096) == MIN_PARTITION_SIZE
    assert decode_partition_size(4, 2, 32768) == 256  # at most MAX_PARTITIONS of the context
    assert decode_partition_size(1, 1, 10**6) == PARTITION_SIZE
    assert decode_partition_size(128, 1, 4096) == PARTITION_SIZE


@pytest.mark.parametrize("window", [None, 20])
@pytest.mark.parametrize("partition_size", [512, 32, None])
@pytest.mark.parametrize("num_heads", [2, 8])
def test_decodes_match_torch(triton_device, num_heads, partition_size, window) -> None:
    # 150 keys: five partitions of 32 (split-K), one of 512, three of the default's 64 for
    # this small batch; 64 exactly two of 32.
    g = torch.Generator().manual_seed(4)
    meta = _step([1, 7, 13, 64, 150], [], 40, g)
    ours, ref = _compare(
        meta, triton_device, num_heads=num_heads, window=window, partition_size=partition_size
    )
    torch.testing.assert_close(ours, ref, **F32_TOL)


@pytest.mark.parametrize("partition_size", [512, 16])
def test_padded_decode_rows_give_zeros_or_finite_rows(triton_device, partition_size) -> None:
    # Rows a padded batch adds: seq_len 0 (nothing to attend: zeros, no NaN) and seq_len 1
    # on block 0; real rows are unaffected by them. One partition, and three (split-K).
    g = torch.Generator().manual_seed(5)
    meta = _step([9, 40], [], 12, g, padding_rows=(0, 1, 0))
    ours, ref = _compare(meta, triton_device, partition_size=partition_size)
    assert torch.equal(ours[2], torch.zeros_like(ours[2]))
    assert torch.equal(ours[4], torch.zeros_like(ours[4]))
    torch.testing.assert_close(ours[[0, 1]], ref[[0, 1]], **F32_TOL)
    # Row 3 attends to the pad slot alone, which the three padding rows write with different
    # K/V here: on a GPU any of them may land last, so its output is one of their V rows.
    assert ours[3].isfinite().all()
    if triton_device.type == "cpu":  # the interpreter writes in order, as torch does
        torch.testing.assert_close(ours[3], ref[3], **F32_TOL)


def test_decodes_read_no_host_value(triton_device, monkeypatch) -> None:
    # The decode path must be capturable by a CUDA graph: no .item() / .tolist() on tensors.
    g = torch.Generator().manual_seed(6)
    meta = _step([5, 70], [], 14, g)

    def host_read(*args, **kwargs):
        raise AssertionError("the decode path read a tensor on the host")

    k_cache, v_cache, _ = _caches(torch.float32, 14, 2, HEAD_DIM, g)
    q = torch.randn(2, 4, HEAD_DIM, generator=g)
    k, v = torch.randn(2, 2, 2, HEAD_DIM, generator=g)
    args = _on(triton_device, q, k, v, k_cache, v_cache)
    step = _to(meta, triton_device)
    with monkeypatch.context() as m:
        m.setattr(torch.Tensor, "item", host_read)
        m.setattr(torch.Tensor, "tolist", host_read)
        ours = TritonAttentionBackend(32).forward(*args, step, 0.25, None)
    ref = TorchAttentionBackend().forward(q, k, v, k_cache, v_cache, meta, 0.25, None)
    torch.testing.assert_close(ours.cpu(), ref, **F32_TOL)


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
def test_mixed_steps_match_torch(triton_device, kv_dtype, q_dtype, window) -> None:
    # Decodes (one split over partitions of 16) and prefill chunks in one call.
    g = torch.Generator().manual_seed(7)
    meta = _step([3, 37], [(0, 10), (12, 6)], 24, g)
    ours, ref = _compare(
        meta, triton_device, KV_DTYPES[kv_dtype], q_dtype, window=window, partition_size=16, seed=1
    )
    tol = _tol(q_dtype, triton_device)
    if kv_dtype == "float16":  # torch attends the fresh prompt with its unrounded K/V
        fresh = slice(2, 12)
        torch.testing.assert_close(ours[fresh], ref[fresh], **FRESH_F16_CACHE_TOL)
        ours, ref = torch.cat([ours[:2], ours[12:]]), torch.cat([ref[:2], ref[12:]])
    torch.testing.assert_close(ours, ref, **tol)


@pytest.mark.parametrize("kv_dtype", ["float32", "int8"])
def test_head_dim_256_like_gemma_3_270m(triton_device, kv_dtype) -> None:
    # 4 heads on 1 KV head, head_dim 256 (32 x 32 tiles), a window, decodes and prefills.
    g = torch.Generator().manual_seed(8)
    meta = _step([5, 45], [(0, 9), (20, 5)], 20, g)
    ours, ref = _compare(
        meta, triton_device, KV_DTYPES[kv_dtype], num_heads=4, num_kv_heads=1, head_dim=256,
        window=12, partition_size=32,
    )  # fmt: skip
    torch.testing.assert_close(ours, ref, **F32_TOL)
