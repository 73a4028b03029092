"""CpuAttentionBackend against TorchAttentionBackend on random paged caches: float32, float16,
int8 and fp8 caches; decodes alone and with prefill chunks (fresh, and on computed context);
with and without a sliding window. The C K/V writes store the very bytes torch stores; outputs
agree to float32 rounding (1e-5); what the kernels do not take runs the torch code, exactly."""

from __future__ import annotations

import pytest
import torch

from tokenmill.attention import AttentionMetadata, PrefillSeq
from tokenmill.attention.backends import (
    ATTENTION_BACKENDS,
    TorchAttentionBackend,
    create_attention_backend,
)
from tokenmill.kernels import cpu_library
from tokenmill.kernels.recording import OP_NAMES, recording

NUM_KV_HEADS, HEAD_DIM, BS, NUM_BLOCKS = 2, 16, 4, 24
DECODE_SEQ_LENS = (1, 7, 13)  # one short, one mid-block, one across 4 blocks
PREFILLS = ((0, 9), (13, 6))  # (num_computed, query_len): a fresh prompt, a chunk on context
KV_DTYPES = {"float32": torch.float32, "float16": torch.float16}
KV_DTYPES |= {"int8": torch.int8, "fp8": torch.float8_e4m3fn}

needs_c = pytest.mark.skipif(not cpu_library.available(), reason="C kernels not built here")


def _caches(kv_dtype: str, g: torch.Generator) -> tuple[torch.Tensor, ...]:
    """K, V (and for one-byte caches their scales), every slot holding random context."""
    shape = (NUM_BLOCKS, BS, NUM_KV_HEADS, HEAD_DIM)
    dtype = KV_DTYPES[kv_dtype]
    caches = [torch.zeros(shape, dtype=dtype) for _ in range(2)]
    if dtype in (torch.int8, torch.float8_e4m3fn):
        caches += [torch.zeros(shape[:-1]) for _ in range(2)]
    k, v = torch.randn(2, NUM_BLOCKS * BS, NUM_KV_HEADS, HEAD_DIM, generator=g)
    kv_scales = (caches[2], caches[3]) if len(caches) == 4 else None
    all_slots = torch.arange(NUM_BLOCKS * BS)
    TorchAttentionBackend().store_kv(k, v, all_slots, caches[0], caches[1], kv_scales)
    return tuple(caches)


def _step(with_prefills: bool, g: torch.Generator) -> AttentionMetadata:
    """Decodes (and prefill chunks) on blocks drawn at random, block 0 left as padding."""
    blocks = iter((torch.randperm(NUM_BLOCKS - 1, generator=g) + 1).tolist())
    seqs = [(n - 1, 1) for n in DECODE_SEQ_LENS] + (list(PREFILLS) if with_prefills else [])
    tables, slots, prefills, start = [], [], [], 0
    for num_computed, query_len in seqs:
        seq_len = num_computed + query_len
        table = torch.tensor([next(blocks) for _ in range(-(-seq_len // BS))])
        positions = torch.arange(num_computed, seq_len)
        slots.append(table[positions // BS] * BS + positions % BS)
        tables.append(table)
        if query_len > 1:
            prefills.append(PrefillSeq(start, query_len, num_computed, table))
        start += query_len
    nd = len(DECODE_SEQ_LENS)
    decode_table = torch.zeros(nd, max(len(t) for t in tables[:nd]), dtype=torch.long)
    for i, t in enumerate(tables[:nd]):
        decode_table[i, : len(t)] = t
    return AttentionMetadata(
        block_size=BS,
        slot_mapping=torch.cat(slots),
        num_decodes=nd,
        decode_block_table=decode_table,
        decode_seq_lens=torch.tensor(DECODE_SEQ_LENS),
        prefills=prefills,
    )


def _run(backend, q, k, v, caches, meta, window) -> tuple[torch.Tensor, list[str]]:
    kv_scales = (caches[2], caches[3]) if len(caches) == 4 else None
    with recording() as rec:
        out = backend.forward(q, k, v, caches[0], caches[1], meta, 0.25, window, kv_scales)
    return out, [OP_NAMES[row[0]] for row in rec.ops]


def _inputs(meta: AttentionMetadata, num_heads: int, g: torch.Generator, dtype=torch.float32):
    n = meta.slot_mapping.numel()
    q = torch.randn(n, num_heads, HEAD_DIM, generator=g, dtype=dtype)
    kv = torch.randn(n, 2 * NUM_KV_HEADS * HEAD_DIM, generator=g, dtype=dtype)
    # Views into one projection output, as a fused k/v projection gives them.
    k = kv[:, : NUM_KV_HEADS * HEAD_DIM].view(n, NUM_KV_HEADS, HEAD_DIM)
    v = kv[:, NUM_KV_HEADS * HEAD_DIM :].view(n, NUM_KV_HEADS, HEAD_DIM)
    return q, k, v


def test_registry_creates_by_name_and_rejects_unknown_names() -> None:
    assert ATTENTION_BACKENDS == ("torch", "cpu", "triton")
    assert type(create_attention_backend("torch")) is TorchAttentionBackend
    with pytest.raises(ValueError, match="attention backend must be one of torch, cpu"):
        create_attention_backend("flash")


@needs_c
@pytest.mark.parametrize("kv_dtype", list(KV_DTYPES))
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("with_prefills", [False, True])
def test_cpu_backend_matches_the_torch_backend(kv_dtype, window, with_prefills) -> None:
    g = torch.Generator().manual_seed(len(kv_dtype) + (window or 0) + with_prefills)
    caches = _caches(kv_dtype, g)
    meta = _step(with_prefills, g)
    q, k, v = _inputs(meta, num_heads=8, g=g)
    ours_caches = tuple(c.clone() for c in caches)
    ours, calls = _run(create_attention_backend("cpu"), q, k, v, ours_caches, meta, window)
    ref, ref_calls = _run(TorchAttentionBackend(), q, k, v, caches, meta, window)
    one_byte = kv_dtype in ("int8", "fp8")
    assert calls == ["kv write (int8/fp8)" if one_byte else "kv write", "attention"]
    assert ref_calls == []
    for got, want in zip(ours_caches, caches):  # every byte, scales included
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    # Decodes and prefill chunks (the C prefill kernel where HEAD_DIM allows) both within
    # float32 rounding of the torch backend.
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)


@needs_c
def test_what_the_kernels_do_not_take_runs_the_torch_code() -> None:
    g = torch.Generator().manual_seed(7)
    caches = _caches("float32", g)
    meta = _step(with_prefills=True, g=g)
    backend = create_attention_backend("cpu")
    # float64 K/V: the write kernel does not take them (attention then runs in float32 on the
    # CPU, as it does for every dtype, so the decode kernel still does).
    q, k, v = _inputs(meta, num_heads=4, g=g, dtype=torch.float64)
    ours_caches = tuple(c.clone() for c in caches)
    ours, calls = _run(backend, q, k, v, ours_caches, meta, None)
    ref, _ = _run(TorchAttentionBackend(), q, k, v, caches, meta, None)
    assert calls == ["attention"]
    assert all(torch.equal(a, b) for a, b in zip(ours_caches, caches))
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)
    # 17 query heads per KV head: past the decode kernel's group limit; the write still fits.
    q, k, v = _inputs(meta, num_heads=2 * (cpu_library.MAX_ATTENTION_GROUP + 1), g=g)
    ours, calls = _run(backend, q, k, v, ours_caches, meta, None)
    ref, _ = _run(TorchAttentionBackend(), q, k, v, caches, meta, None)
    assert calls == ["kv write"]  # no decode attention call: torch's; the prefill's is C
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)


@needs_c
def test_equal_length_prompts_attend_through_the_prefill_kernel() -> None:
    # Three fresh prompts of 20 tokens side by side (a batch of new requests): the C kernel
    # runs each, within float32 rounding of torch's one batched SDPA call.
    g = torch.Generator().manual_seed(11)
    q = torch.randn(60, 4, 32, generator=g)
    k, v = torch.randn(2, 60, 2, 32, generator=g)
    ours = create_attention_backend("cpu").attend_prompts(q, k, v, 3, 0.3)
    ref = TorchAttentionBackend().attend_prompts(q, k, v, 3, 0.3)
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)
    # Each prompt sees only itself: the second one alone gives its rows.
    alone = TorchAttentionBackend().attend_prompts(q[20:40], k[20:40], v[20:40], 1, 0.3)
    torch.testing.assert_close(ours[20:40], alone, rtol=1e-5, atol=1e-5)
