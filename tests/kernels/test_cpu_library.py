"""The C decode-step kernels equal their torch twins (RMSNorm, RoPE, paged decode attention)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tokenmill.attention.backends.torch_backend import TorchAttentionBackend, _attend_masked
from tokenmill.attention.metadata import AttentionMetadata
from tokenmill.kernels import cpu_library as kernels
from tokenmill.kernels.cpu_backend import CpuKernelBackend
from tokenmill.kernels.graph import Graph, plan_scratch
from tokenmill.kernels.recording import Recording, recording
from tokenmill.layers import GemmaRMSNorm, RMSNorm, RotaryEmbedding

pytestmark = pytest.mark.skipif(not kernels.available(), reason="C kernels not built here")


@pytest.mark.parametrize("norm_cls", [RMSNorm, GemmaRMSNorm])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rmsnorm_matches_torch(norm_cls, with_residual) -> None:
    torch.manual_seed(0)
    norm = norm_cls(64, eps=1e-6)
    norm.kernels = CpuKernelBackend()
    norm.weight.data.normal_()
    x, res = torch.randn(5, 64) * 3, torch.randn(5, 64)
    residual = res if with_residual else None
    ours = norm(x, residual)
    gain = norm.weight + norm.weight_offset
    ref = F.rms_norm(x, (64,), gain, 1e-6) + (res if with_residual else 0)
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)
    # The torch path (taken for other dtypes) agrees too.
    torch.testing.assert_close(
        norm(x.double(), None if residual is None else res.double()).float(), ref
    )


def _decode_meta(bs: int, table: torch.Tensor, seq_lens: torch.Tensor) -> AttentionMetadata:
    """Metadata of a decodes-only step (what the torch reference path reads)."""
    n = seq_lens.numel()
    return AttentionMetadata(
        block_size=bs,
        slot_mapping=torch.zeros(n, dtype=torch.long),
        num_decodes=n,
        decode_block_table=table,
        decode_seq_lens=seq_lens,
        prefills=[],
    )


def test_rope_matches_torch() -> None:
    torch.manual_seed(1)
    rope = RotaryEmbedding(head_dim=32, max_position=64, theta=10000.0)
    rope.kernels = CpuKernelBackend()
    positions = torch.tensor([0, 5, 63, 17])
    q, k = torch.randn(4, 3, 32), torch.randn(4, 1, 32)
    ref_q, ref_k = rope(positions, q.double(), k.double())  # torch path (not float32)
    ours_q, ours_k = rope(positions, q.clone(), k.clone())
    torch.testing.assert_close(ours_q, ref_q.float(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ours_k, ref_k.float(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("window", [None, 5])
def test_decode_attention_matches_sdpa(window) -> None:
    torch.manual_seed(2)
    num_blocks, bs, kv_heads, heads, dim = 12, 4, 2, 6, 16
    k_cache, v_cache = torch.randn(2, num_blocks, bs, kv_heads, dim)
    seq_lens = torch.tensor([1, 7, 13])  # one short, one mid-block, one across 4 blocks
    table = torch.zeros(3, 4, dtype=torch.long)
    table[0, :1] = torch.tensor([9])
    table[1, :2] = torch.tensor([3, 0])
    table[2, :4] = torch.tensor([5, 11, 2, 7])
    q = torch.randn(3, heads, dim)
    meta = _decode_meta(bs, table, seq_lens)
    ours = kernels.decode_attention(q, k_cache, v_cache, table, seq_lens, window, 0.3)
    # The torch path: float64 inputs do not fit the kernel, so SDPA runs.
    ref = TorchAttentionBackend().attend_decodes(
        q.double(), k_cache.double(), v_cache.double(), meta, 0.3, window, None
    )
    torch.testing.assert_close(ours, ref.float(), rtol=1e-5, atol=1e-5)


# (queries, keys, heads, kv heads, head_dim, window): one query; a tail of a 16-row job; GQA
# 4:1 at Gemma's head_dim; a chunk on cached keys past one block of 64; a window narrower than
# the chunk; a window block as the torch path cuts it; groups of 1 and of 2 with padded rows;
# more than 1,024 keys (jobs of 256 rows).
PREFILL_SHAPES = [
    (1, 1, 4, 1, 256, None),
    (37, 37, 4, 1, 256, None),
    (100, 300, 8, 2, 64, None),
    (70, 70, 4, 1, 256, 16),
    (64, 576, 4, 1, 256, 512),
    (130, 130, 2, 2, 32, None),
    (33, 97, 6, 3, 48, 40),
    (300, 1100, 4, 1, 32, None),
]


@pytest.mark.parametrize("shape", PREFILL_SHAPES)
def test_prefill_attention_matches_masked_sdpa(shape) -> None:
    n, nk, heads, kv_heads, dim, window = shape
    g = torch.Generator().manual_seed(n + nk)
    q = torch.randn(n, heads, dim, generator=g)
    keys, values = torch.randn(2, nk, kv_heads, dim, generator=g)
    k0 = 10  # keys from position 10; the queries are the last n of them
    q0 = k0 + nk - n
    ours = kernels.prefill_attention(q, keys, values, q0, k0, window, 0.1)
    ref = _attend_masked(q.double(), keys.double(), values.double(), q0, k0, 0.1, window)
    torch.testing.assert_close(ours, ref.float(), rtol=1e-5, atol=1e-5)


def test_prefill_attention_reads_q_k_v_inside_a_fused_projection() -> None:
    g = torch.Generator().manual_seed(3)
    qkv = torch.randn(40, 6 * 32, generator=g)
    q, k, v = (qkv[:, a : a + 2 * 32].view(40, 2, 32) for a in (0, 64, 128))
    ours = kernels.prefill_attention(q, k, v, 0, 0, None, 0.2)
    torch.testing.assert_close(ours, _attend_masked(q, k, v, 0, 0, 0.2, None))


def test_prefill_attention_rejects_keys_that_do_not_end_at_the_last_query() -> None:
    q, keys = torch.randn(4, 2, 16), torch.randn(6, 1, 16)
    with pytest.raises(ValueError, match="keys must end at the last query"):
        kernels.prefill_attention(q, keys, keys, 0, 0, None, 1.0)


@pytest.mark.parametrize("dtype", [torch.int8, torch.float8_e4m3fn])
def test_decode_attention_reads_a_quantized_cache(dtype) -> None:
    """An int8 / fp8 cache with per-token-per-head scales equals attending its dequantized
    values."""
    from tokenmill.attention.kv_cache import dequantize_kv, quantize_kv

    torch.manual_seed(3)
    k_f, v_f = torch.randn(2, 6, 4, 2, 16)
    (k_q, k_s), (v_q, v_s) = quantize_kv(k_f, dtype), quantize_kv(v_f, dtype)
    table = torch.tensor([[4, 1, 0], [2, 5, 3]])
    seq_lens = torch.tensor([6, 11])
    q = torch.randn(2, 4, 16)
    ours = kernels.decode_attention(q, k_q, v_q, table, seq_lens, None, 0.25, (k_s, v_s))
    k_d, v_d = dequantize_kv(k_q, k_s, torch.float32), dequantize_kv(v_q, v_s, torch.float32)
    ref = kernels.decode_attention(
        q, k_d.contiguous(), v_d.contiguous(), table, seq_lens, None, 0.25
    )
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)


def test_decode_attention_and_kv_write_on_a_float16_cache() -> None:
    """--kv-cache-dtype float16: rows go in as torch's .half() gives them and attention equals
    attending their float32 values."""
    torch.manual_seed(4)
    k, v = torch.randn(2, 11, 2, 16)
    k_cache, v_cache = torch.zeros(2, 6, 4, 2, 16, dtype=torch.float16)
    slots = torch.tensor([16, 17, 18, 19, 4, 5, 6, 7, 0, 1, 2])  # blocks 4, 1, 0 of 4 slots
    kernels.kv_write(k, v, slots, (k_cache, v_cache))
    assert torch.equal(k_cache.view(-1, 2, 16)[slots], k.half())
    assert torch.equal(v_cache.view(-1, 2, 16)[slots], v.half())
    table = torch.tensor([[4, 1, 0], [4, 1, 0]])
    seq_lens = torch.tensor([6, 11])
    q = torch.randn(2, 4, 16)
    ours = kernels.decode_attention(q, k_cache, v_cache, table, seq_lens, None, 0.25)
    ref = kernels.decode_attention(q, k_cache.float(), v_cache.float(), table, seq_lens, None, 0.25)
    torch.testing.assert_close(ours, ref, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("act", ["gelu_pytorch_tanh", "silu"])
def test_act_and_mul_matches_torch(act) -> None:
    from tokenmill.layers import ActAndMul, get_act_fn

    torch.manual_seed(4)
    gate_up = torch.randn(3, 2 * 48) * 4  # wide enough to reach both tails
    act_and_mul = ActAndMul(act)
    act_and_mul.kernels = CpuKernelBackend()
    ours = act_and_mul(gate_up)
    gate, up = gate_up.double().chunk(2, dim=-1)
    ref = get_act_fn(act)(gate) * up
    torch.testing.assert_close(ours, ref.float(), rtol=1e-5, atol=1e-5)


def test_embedding_rows_match_the_dequantized_table() -> None:
    from tokenmill.quant.int4 import Int4QuantMethod

    torch.manual_seed(5)
    table = torch.randn(50, 64)
    w = Int4QuantMethod(group_size=32).quantize(table, None).weight
    ids = torch.tensor([[7, 0], [49, 7]])
    ours = kernels.embed_rows(w, ids, 2.5)
    ref = w.dequantize()[ids] * 2.5
    torch.testing.assert_close(ours, ref, rtol=1e-6, atol=1e-6)


def test_kv_write_stores_rows_of_a_fused_projection() -> None:
    torch.manual_seed(6)
    qkv = torch.randn(3, 4 * 16 + 2 * 2 * 16)  # q | k | v of 3 tokens, 2 KV heads of 16
    k = qkv[:, 64:96].view(3, 2, 16)  # strided views, as the fused projection gives them
    v = qkv[:, 96:].view(3, 2, 16)
    k_cache, v_cache = torch.zeros(2, 5, 4, 2, 16)
    slots = torch.tensor([13, 2, 7])
    kernels.kv_write(k, v, slots, (k_cache, v_cache))
    torch.testing.assert_close(k_cache.view(-1, 2, 16)[slots], k, rtol=0, atol=0)
    torch.testing.assert_close(v_cache.view(-1, 2, 16)[slots], v, rtol=0, atol=0)
    untouched = torch.ones(20, dtype=torch.bool)
    untouched[slots] = False
    assert not k_cache.view(-1, 32)[untouched].any() and not v_cache.view(-1, 32)[untouched].any()


def test_recorded_calls_replay_on_new_inputs() -> None:
    """A graph reads its inputs where the recording read them: new values in, new results out."""
    from tokenmill.quant.int4 import Int4QuantMethod

    torch.manual_seed(7)
    norm = GemmaRMSNorm(64)
    norm.kernels = CpuKernelBackend()
    norm.weight.data.normal_()
    w = Int4QuantMethod(group_size=32).quantize(torch.randn(40, 64), None).weight
    x = torch.randn(2, 64)
    with recording() as rec:
        y = kernels.qgemm(norm(x), w, None, act_int8=True)
    graph = Graph(rec)
    assert len(graph) == 2
    x.copy_(torch.randn(2, 64))
    expected = kernels.qgemm(norm(x), w, None, act_int8=True)
    graph.replay()
    assert torch.equal(y, expected)


def test_rmsnorm_reads_heads_inside_a_fused_projection() -> None:
    torch.manual_seed(8)
    norm = GemmaRMSNorm(16)
    norm.kernels = CpuKernelBackend()
    norm.weight.data.normal_()
    qkv = torch.randn(3, 4 * 16 + 2 * 16)
    q = qkv[:, :64].view(3, 4, 16)  # rows 16 apart within a token, 96 apart between tokens
    assert not q.is_contiguous()
    torch.testing.assert_close(norm(q), norm(q.contiguous()), rtol=0, atol=0)


def test_argmax_matches_torch_with_ties_and_nans() -> None:
    torch.manual_seed(9)
    x = torch.randn(4, 1003)  # a tail past the last 8-wide step
    x[1, 5] = x[1, 900] = 50.0  # a tie: the first index wins, as in torch
    x[2, 1001] = 60.0  # the maximum in the tail
    assert torch.equal(kernels.argmax_rows(x), x.argmax(dim=-1))
    x[3, 7] = float("nan")
    assert kernels.argmax_rows(x) is None  # left to torch


@pytest.mark.parametrize("window", [None, 200])
def test_decode_attention_over_a_long_context_split_across_threads(window) -> None:
    """One sequence, one KV head: the context is split into spans whose softmax states merge."""
    torch.manual_seed(10)
    bs, heads, dim, seq_len = 16, 4, 32, 300
    k_cache, v_cache = torch.randn(2, 24, bs, 1, dim)
    table = torch.randperm(24)[:19].reshape(1, -1)
    seq_lens = torch.tensor([seq_len])
    q = torch.randn(1, heads, dim)
    meta = _decode_meta(bs, table, seq_lens)
    with _threads(2):
        ours = kernels.decode_attention(q, k_cache, v_cache, table, seq_lens, window, 0.2)
    ref = TorchAttentionBackend().attend_decodes(
        q.double(), k_cache.double(), v_cache.double(), meta, 0.2, window, None
    )
    torch.testing.assert_close(ours, ref.float(), rtol=1e-5, atol=1e-5)


class _threads:
    def __init__(self, n: int) -> None:
        self.n, self.saved = n, torch.get_num_threads()

    def __enter__(self) -> None:
        torch.set_num_threads(self.n)

    def __exit__(self, *exc: object) -> None:
        torch.set_num_threads(self.saved)


@pytest.mark.parametrize("dtype", [torch.int8, torch.float8_e4m3fn])
def test_quantized_kv_write_gives_the_bytes_of_the_torch_quantizer(dtype) -> None:
    from tokenmill.attention.kv_cache import write_kv

    torch.manual_seed(11)
    qkv = torch.randn(3, 4 * 16 + 2 * 2 * 16) * 3
    qkv[1, 64:80] = 0.0  # an all-zero head: scale 0, codes 0
    qkv[2, 100] = 1e-30  # fp8 subnormals next to a large value
    k, v = qkv[:, 64:96].view(3, 2, 16), qkv[:, 96:].view(3, 2, 16)
    slots = torch.tensor([13, 2, 7])
    ours = [torch.zeros(5, 4, 2, 16, dtype=dtype) for _ in range(2)]
    our_scales = [torch.zeros(5, 4, 2) for _ in range(2)]
    kernels.kv_write(k, v, slots, (ours[0], ours[1]), (our_scales[0], our_scales[1]))
    for x, cache, scales in ((k, ours[0], our_scales[0]), (v, ours[1], our_scales[1])):
        ref, ref_scales = torch.zeros_like(cache), torch.zeros_like(scales)
        write_kv(ref, ref_scales, slots, x.contiguous())
        assert torch.equal(cache.view(torch.uint8), ref.view(torch.uint8))
        assert torch.equal(scales, ref_scales)


def test_scratch_plan_shares_bytes_between_intermediates_that_never_live_together() -> None:
    rec = Recording()
    a, b, c = torch.empty(100), torch.empty(100), torch.empty(50)
    keep = torch.empty(10)  # not allocated during the recording: stays where it is
    rec.add(1, (a, keep))  # call 0: a
    rec.add(1, (a, b))  # call 1: a's last use, b's first
    rec.add(1, (b, c[10:]))  # call 2: a is dead, c may reuse its bytes but not b's
    allocated = {t.untyped_storage().data_ptr() for t in (a, b, c)}
    offsets, total = plan_scratch(rec, allocated)
    at = {name: offsets[t.data_ptr()] for name, t in (("a", a), ("b", b), ("c", c))}
    assert keep.data_ptr() not in offsets
    assert at["a"] != at["b"] and at["c"] == at["a"]  # c takes a's bytes once a is dead
    assert total == 2 * 448  # 400 bytes each, 64-aligned
