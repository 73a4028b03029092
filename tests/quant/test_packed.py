"""Packed weights: repacking GGUF blocks is exact, the C kernel equals its torch reference, and
packed / int4 models track float ones."""

from __future__ import annotations

import random

import pytest
import torch
from conftest import assert_all_blocks_free

from tokenmill.engine import LLMEngine
from tokenmill.kernels import cpu_library as kernels
from tokenmill.kernels.cpu_backend import CpuKernelBackend
from tokenmill.kernels.torch_backend import TorchKernelBackend
from tokenmill.quant import Int4QuantMethod, PackedQuantMethod
from tokenmill.quant.gguf_blocks import BLOCK_CODES, IQ4_KVALUES
from tokenmill.quant.packed import (
    E2M1_DOUBLED,
    K_QUANT_KINDS,
    PackedWeight,
    activation_levels,
    concat_rows,
    lane_blocks,
    lane_order,
    pack_codes,
    pack_gguf,
    pack_k_quant,
    quantize_activations,
    quantize_int4,
    reference_matmul,
    unpack_codes,
    unpack_k_quant,
)
from tokenmill.sampling_params import SamplingParams

GGML_TYPES = {
    "Q4_0": 2, "Q4_1": 3, "Q5_0": 6, "Q5_1": 7, "Q8_0": 8, "Q2_K": 10, "Q3_K": 11, "Q4_K": 12,
    "Q5_K": 13, "Q6_K": 14, "IQ4_NL": 20, "IQ4_XS": 23,
}  # fmt: skip
# Where a block's float16 scales lie: d (and a second, dmin or m) first but for these.
SCALE_AT = {10: [80, 82], 11: [108], 14: [208]}
needs_kernel = pytest.mark.skipif(not kernels.available(), reason="packed kernel not built here")


def _random_blocks(ggml_type: int, rows: int, cols: int, seed: int) -> torch.Tensor:
    """Random block bytes of a [rows, cols] tensor with finite, modest f16 scales."""
    elems, nbytes, _ = BLOCK_CODES[ggml_type]
    n = rows * cols // elems
    g = torch.Generator().manual_seed(seed)
    data = torch.randint(0, 256, (n, nbytes), dtype=torch.uint8, generator=g)
    scale_at = SCALE_AT.get(ggml_type, [0, 2] if ggml_type in (3, 7, 12, 13) else [0])
    for off in scale_at:
        d = (torch.rand(n, generator=g) * 0.02).half()
        data[:, off : off + 2] = d.view(torch.uint8).reshape(n, 2)
    return data


@pytest.mark.parametrize("name", GGML_TYPES)
def test_repacking_is_exact(name: str) -> None:
    t = GGML_TYPES[name]
    raw = _random_blocks(t, 24, 512, seed=t)
    w = pack_gguf(raw.reshape(-1), t, (24, 512))
    ref = BLOCK_CODES[t][2](raw).dequantize().reshape(24, 512)
    assert torch.equal(w.dequantize(), ref)
    # 4-bit formats keep half a byte a weight (IQ4: the table's indices); 5-bit ones 4 bits and
    # a bit plane, Q8_0 int8; the k-quants their super-blocks, the file's bytes.
    kinds = {"Q4_0": "q4", "Q4_1": "q4", "Q8_0": "q8", "IQ4_NL": "n4", "IQ4_XS": "n4k"}
    kinds |= {"Q2_K": "q2", "Q3_K": "q3", "Q4_K": "q4k", "Q5_K": "q5k", "Q6_K": "q6k"}
    kinds |= {"Q5_0": "q5", "Q5_1": "q5"}
    assert w.kind == kinds[name]
    if w.kind in K_QUANT_KINDS or name in ("Q4_0", "Q5_0", "Q8_0"):
        assert w.nbytes == raw.numel()  # as many bytes as the file's: Q5_0 22 a 32
        assert w.offsets is None  # Q4_0's signed codes: a zero point 8, no offsets
    else:
        per_row = {"q4": 256, "n4": 256, "q5": 256 + 2 * 32}.get(w.kind, 512)
        assert w.codes.numel() == 24 * per_row
    # Scales stay float16 where the file's are (half the bytes); the k-quants and IQ4_XS keep
    # the file's float16 d (and dmin) and form the products with their sub-blocks' as they
    # compute.
    assert w.scales.dtype == torch.float16
    rows = torch.tensor([5, 0, 23])
    assert torch.equal(w.select_rows(rows).dequantize(), ref[rows])
    assert torch.equal(w.dequantize(rows), ref[rows])


# Rows of 16 chunks (two blocks of 8 in the kernel's lane order), and for the 32-element
# formats 20 (8 + 8 + 4) and 6 (4 + 2); the k-quants' 256-element blocks always fill blocks of 8.
KERNEL_SHAPES = [
    (name, k)
    for name, t in GGML_TYPES.items()
    for k in (512, 640, 192)
    if k % BLOCK_CODES[t][0] == 0
]


@needs_kernel
@pytest.mark.parametrize(("name", "k"), KERNEL_SHAPES)
@pytest.mark.parametrize("m", [1, 3, 6, 40])
def test_kernel_matches_reference(name: str, k: int, m: int) -> None:
    t = GGML_TYPES[name]
    n = 48
    w = pack_gguf(_random_blocks(t, n, k, seed=t).reshape(-1), t, (n, k))
    torch.manual_seed(m)
    x, bias = torch.randn(m, k), torch.randn(n)
    exact = x @ w.dequantize().T + bias
    scale = exact.abs().max()
    # Float activations: the dequantize-then-matmul result up to float32 rounding.
    y = kernels.qgemm(x, w, bias, act_int8=False)
    torch.testing.assert_close(y, exact, rtol=0, atol=1e-5 * scale)
    # int8 activations: equal to the emulated reference up to rounding, close to exact.
    y8 = kernels.qgemm(x, w, bias, act_int8=True)
    torch.testing.assert_close(y8, reference_matmul(x, w, bias, True), rtol=0, atol=1e-5 * scale)
    assert (y8 - exact).abs().max() < 0.03 * scale
    # "q8" codes run unsigned against 7-bit activations (the output head): the same check.
    y7 = kernels.qgemm(x, w, bias, act_int8=True, q8_unsigned=True)
    ref7 = reference_matmul(x, w, bias, True, q8_unsigned=True)
    torch.testing.assert_close(y7, ref7, rtol=0, atol=1e-5 * scale)
    assert (y7 - exact).abs().max() < 0.03 * scale
    assert torch.equal(kernels.dequantize_rows(w, 7, 30), w.dequantize(slice(7, 30)))


@needs_kernel
# Q4_0, Q5_0, Q8_0 rows of 14 chunks end in blocks of 4 and 2 chunks (the lane order's tail),
# Q5_0's of 10 in one of 2
@pytest.mark.parametrize(
    ("name", "cols"),
    [("Q4_0", 768), ("Q4_0", 448), ("Q5_0", 768), ("Q5_0", 448), ("Q5_0", 320)]
    + [("Q8_0", 768), ("Q8_0", 448)]
    + [("Q4_K", 768), ("Q5_K", 768), ("Q6_K", 768), ("IQ4_XS", 768)],
)
def test_c_relay_of_gguf_blocks_equals_the_torch_twin(name: str, cols: int) -> None:
    """At load the C kernels re-lay Q4_0 / Q8_0 blocks and Q4_K / Q5_K / Q6_K / IQ4_XS
    super-blocks
    (csrc/relay.c) into the bytes the torch twin (pack_gguf) builds, bit for bit."""
    t = GGML_TYPES[name]
    raw = _random_blocks(t, 24, cols, seed=t + 1)
    ours = kernels.relay_gguf(raw.reshape(-1), t, (24, cols))
    twin = pack_gguf(raw.reshape(-1), t, (24, cols))
    assert ours is not None
    for field in ("kind", "group", "shape", "zero"):
        assert getattr(ours, field) == getattr(twin, field)
    assert ours.codes.dtype == twin.codes.dtype
    assert torch.equal(ours.codes, twin.codes) and torch.equal(ours.scales, twin.scales)
    assert ours.scales.dtype == torch.float16 and ours.offsets is None


@needs_kernel
@pytest.mark.parametrize("name", ["Q4_0", "Q5_0", "Q8_0"])
def test_rows_not_in_lane_order_are_left_to_the_torch_code(name: str) -> None:
    """Rows of 96 elements (3 chunks) are not in the kernel's lane order: the C re-lay leaves
    them to pack_gguf."""
    t = GGML_TYPES[name]
    raw = _random_blocks(t, 4, 96, seed=t).reshape(-1)
    assert kernels.relay_gguf(raw, t, (4, 96)) is None
    assert not kernels.relays(t, (4, 96)) and kernels.relays(t, (4, 128))


# K-quant kind -> (codes' range, sub-block scale bytes a super-block)
K_QUANT_RANGES = {"q2": (4, 16), "q3": (8, 12), "q4k": (16, 12), "q5k": (32, 12), "q6k": (64, 16)}
K_QUANT_RANGES["n4k"] = (16, 6)  # IQ4's table indices


@pytest.mark.parametrize("kind", sorted(K_QUANT_RANGES))
def test_k_quant_codes_and_scale_bytes_round_trip(kind: str) -> None:
    """K-quant codes go into their super-blocks in lane order and come back in element order
    with the sub-block scale bytes, which stay as they were."""
    levels, sub_bytes = K_QUANT_RANGES[kind]
    g = torch.Generator().manual_seed(len(kind))
    codes = torch.randint(0, levels, (5, 768), generator=g)
    sub = torch.randint(0, 256, (5, 3, sub_bytes), generator=g).to(torch.uint8)
    stored = pack_k_quant(codes, sub, kind)
    assert stored.shape == (5, 3 * K_QUANT_KINDS[kind][0])
    back, back_sub = unpack_k_quant(stored, kind, 768)
    assert torch.equal(back, codes.to(torch.int16)) and torch.equal(back_sub, sub)
    # Byte 5 of the first 32 holds lane 1 (chunk 1 of 8) of vectors 0..3, elements 4u + 1 of
    # chunk 1: "q2" / "q3" their low 2-bit pairs; "q4k" / "q5k" / "q6k" / "n4k" vectors 0 and 1 in its
    # nibbles.
    first = codes[0, [32 + 4 * u + 1 for u in range(4)]]
    if kind in ("q2", "q3"):
        expected = sum(int(c & 3) << 2 * u for u, c in enumerate(first))
    else:
        expected = int(first[0] & 15) | int(first[1] & 15) << 4
    assert stored[0, 5].item() == expected


@pytest.mark.parametrize("k", [64, 192, 640, 96])
@pytest.mark.parametrize("kind", ["q8", "q4", "n4", "m4"])
def test_stored_codes_round_trip(k: int, kind: str) -> None:
    """Codes go into the kernel's lane order (or stay in element order for rows not in 64s)
    and come back in element order ("n4", "m4": stored as indices, given back as the table's
    codes)."""
    codes = torch.randint(-127 if kind == "q8" else 0, 128 if kind == "q8" else 16, (5, k))
    if kind == "n4":
        codes = torch.tensor(IQ4_KVALUES)[codes]
    elif kind == "m4":
        codes = torch.tensor(E2M1_DOUBLED)[codes]
    stored = pack_codes(codes, kind)
    assert stored.shape == (5, k if kind == "q8" else k // 2)
    assert torch.equal(unpack_codes(stored, kind, k), codes.to(torch.int16))
    order = lane_order(k)
    if order is not None:  # a permutation; lane 1 of the first vector holds chunk 1's start
        assert torch.equal(order.sort().values, torch.arange(k))
        assert order[4:8].tolist() == [32, 33, 34, 35]


@pytest.mark.parametrize("k", [64, 192, 640, 768])
def test_five_bit_codes_round_trip_through_their_planes(k: int) -> None:
    """ "q5" codes (0..31 with the zero point) keep their low 4 bits as "q4" does and their
    fifth bits in one 32-byte plane a block (vector u's in bit u): 0.625 bytes a code, whatever
    the row's tail blocks (4 and 2 chunks)."""
    g = torch.Generator().manual_seed(k)
    codes = torch.randint(-16, 16, (5, k), generator=g)
    stored = pack_codes(codes, "q5", zero=16)
    blocks = len(lane_blocks(k))
    assert stored.shape == (5, k // 2 + 32 * blocks)
    assert torch.equal(unpack_codes(stored, "q5", k, zero=16), codes.to(torch.int16))
    # The first block's plane: byte j's bit u is the fifth bit of vector u's byte j.
    lanes = (codes + 16)[:, lane_order(k)]
    t = lane_blocks(k)[0][1]
    for u in range(t):
        assert torch.equal((stored[:, :32] >> u) & 1, ((lanes[:, 32 * u : 32 * u + 32] >> 4) & 1))
    with pytest.raises(ValueError, match="multiple of 64"):
        pack_codes(torch.zeros(5, 96, dtype=torch.int64), "q5", zero=16)
    with pytest.raises(ValueError, match="0..31"):  # a sixth bit would be lost
        pack_codes(codes + 16, "q5", zero=16)


@needs_kernel
@pytest.mark.parametrize("act_int8", [True, False])
@pytest.mark.parametrize(
    ("ggml_type", "k"),
    [(8, 640), (6, 640), (12, 768), (14, 512), (10, 512), (11, 512), (23, 768)],
)
@pytest.mark.parametrize("batch", [13, 37, 77])
def test_a_rows_result_does_not_depend_on_its_batch(
    act_int8: bool, ggml_type: int, k: int, batch: int
) -> None:
    """Rows computed alone or among 13 (tiles of 8, 4 and 1 rows; G = 16: 4, 4, 4, 1), 37 (on
    AMX, tiles of 16 rows: kernels.isa() == "amx") or 77 (more than a work tile's 64 rows:
    "q5" weights then run unpacked to "u8" bytes) are bit-equal: greedy decoding gives one
    answer whatever else is batched with a request."""
    w = pack_gguf(_random_blocks(ggml_type, 40, k, seed=5).reshape(-1), ggml_type, (40, k))
    x = torch.randn(batch, k)
    together = kernels.qgemm(x, w, None, act_int8)
    for i in (0, 8, 12, batch - 1):
        assert torch.equal(kernels.qgemm(x[i : i + 1], w, None, act_int8)[0], together[i])


@needs_kernel
@pytest.mark.parametrize(
    ("kind", "code"),
    [("q8", 127), ("q8", -128), ("n4", -127), ("n4", 113), ("m4", 12), ("m4", -12)],
)
@pytest.mark.parametrize("unsigned", [True, False])
def test_int8_codes_at_their_extremes_sum_exactly(kind: str, code: int, unsigned: bool) -> None:
    """The kernel multiplies "q8" codes (and "n4" codes, looked up) as bytes code + 128 with
    maddubs, whose pair sums saturate at 2^15: against activations quantized to [-64, 64]
    (activation_levels) even the largest codes times the largest activations, 2 · 255 · 64,
    stay exact; with 8-bit activations they run with sign flips (AVX2) or in int32 (VNNI)."""
    k = 640
    codes = torch.full((3, k), code)
    w = PackedWeight(kind, pack_codes(codes, kind), torch.ones(3, k // 32), None, 32, (3, k))
    x = torch.full((2, k), 1.0)
    x[1] = -1.0
    y = kernels.qgemm(x, w, None, act_int8=True, q8_unsigned=unsigned)
    torch.testing.assert_close(y, x @ w.dequantize().T, rtol=0, atol=0)
    _, d = quantize_activations(x, activation_levels(w, q8_unsigned=unsigned))
    assert torch.equal(d, torch.full_like(d, 1 / 64 if unsigned else 1 / 127))


@needs_kernel
@pytest.mark.parametrize("group", [32, 128])
def test_kernel_matches_reference_for_int4_groups(group: int) -> None:
    """int4 groups of 128 share one scale across 4 chunks of a block."""
    torch.manual_seed(group)
    w = quantize_int4(torch.randn(24, 640), group)
    x = torch.randn(9, 640)
    exact = x @ w.dequantize().T
    scale = exact.abs().max()
    torch.testing.assert_close(kernels.qgemm(x, w, None, False), exact, rtol=0, atol=1e-5 * scale)
    y8 = kernels.qgemm(x, w, None, True)
    torch.testing.assert_close(y8, reference_matmul(x, w, None, True), rtol=0, atol=1e-5 * scale)


@needs_kernel
@pytest.mark.parametrize("k", [192, 640])
def test_unsigned_byte_codes_with_16_element_groups(k: int) -> None:
    """ "u8" codes (code + zero) with Q6_K's 16-element groups in blocks of 4 and 2 chunks (a
    GGUF row of 256s never has them): the kernel removes the zero point exactly."""
    g = torch.Generator().manual_seed(k)
    codes = torch.randint(-32, 32, (24, k), generator=g)
    scales = torch.rand(24, k // 16, generator=g) * 0.01
    w = PackedWeight("u8", pack_codes(codes, "u8", 32), scales, None, 16, (24, k), zero=32)
    assert torch.equal(w.codes_int(), codes.to(torch.int16))
    assert torch.equal(kernels.dequantize_rows(w, 0, 24), w.dequantize())
    x = torch.randn(5, k, generator=g)
    exact = x @ w.dequantize().T
    atol = 1e-5 * exact.abs().max()
    torch.testing.assert_close(kernels.qgemm(x, w, None, False), exact, rtol=0, atol=atol)
    for m in (1, 5):
        y8 = kernels.qgemm(x[:m], w, None, True)
        torch.testing.assert_close(y8, reference_matmul(x[:m], w, None, True), rtol=0, atol=atol)


@pytest.mark.parametrize("cols", [256, 96])
def test_unsigned_codes_beside_int8_ones_join_as_signed(cols: int) -> None:
    """Q5_0 q/k ("q5"; "u8" in rows not of 64s) beside a Q8_0 v ("q8") fuse into one "q8"
    weight of the same values."""
    q5 = pack_gguf(_random_blocks(6, 8, cols, seed=1).reshape(-1), 6, (8, cols))
    assert q5.kind == ("q5" if cols % 64 == 0 else "u8")
    q8 = pack_gguf(_random_blocks(8, 4, cols, seed=2).reshape(-1), 8, (4, cols))
    joined = concat_rows([q5, q8])
    assert joined is not None and joined.kind == "q8"
    assert torch.equal(joined.dequantize(), torch.cat([q5.dequantize(), q8.dequantize()]))


def test_activation_quantization_rounds_to_nearest() -> None:
    x = torch.tensor([[127.0, 63.5, -0.49, 0.5] + [0.0] * 28])
    q, d = quantize_activations(x)
    assert d.tolist() == [[1.0]]
    assert q[0, :4].tolist() == [127.0, 64.0, -0.0, 0.0]  # round half to even, like the kernel


@needs_kernel
@pytest.mark.parametrize("m", [1, 5, 64])
def test_packed_method_paths_agree(m: int, monkeypatch) -> None:
    """Kernel (small batch), float tiles (large batch) and torch fallback give one answer."""
    w = pack_gguf(_random_blocks(12, 96, 256, seed=3).reshape(-1), 12, (96, 256))
    method = PackedQuantMethod(act_int8=False)
    state = method.wrap(w)
    x = torch.randn(m, 256)
    cpu = CpuKernelBackend()
    ours = method.apply(state, x, cpu)
    fallback = method.apply(state, x, TorchKernelBackend())
    atol = 1e-5 * fallback.abs().max().item()
    torch.testing.assert_close(ours, fallback, rtol=0, atol=atol)
    monkeypatch.setattr("tokenmill.kernels.cpu_backend.TILE_ELEMENTS", 256 * 10)  # several tiles
    torch.testing.assert_close(method.apply(state, x, cpu), fallback, rtol=0, atol=atol)


@pytest.mark.parametrize("group", [32, 128])
def test_int4_error_is_bounded(group: int) -> None:
    torch.manual_seed(0)
    w = torch.randn(16, 256) * torch.logspace(-2, 1, 16)[:, None]
    p = quantize_int4(w, group)
    assert p.kind == "q4" and p.codes.numel() == 16 * 128  # two codes a byte
    # No worse than plain min/max rounding (error <= step / 2 there), group by group.
    g = w.reshape(16, -1, group)
    step = (g.amax(-1) - g.amin(-1)) / 15
    err = (p.dequantize() - w).reshape(16, -1, group)
    plain = (
        torch.round((g - g.amin(-1, keepdim=True)) / step[..., None]) * step[..., None]
        + g.amin(-1, keepdim=True)
        - g
    )
    assert torch.all(err.square().sum(-1) <= plain.square().sum(-1) * (1 + 1e-4) + 1e-12)
    assert torch.all(plain.abs() <= step[..., None] / 2 + 1e-6)


@pytest.mark.parametrize("group", [32, 128])
def test_int4_recovers_a_weight_already_on_a_4_bit_grid(group: int) -> None:
    """A dequantized Q4_K / Q4_1 tensor (each group s·q + lo) comes back exactly, also where a
    group's codes leave one end of 0..15 unused (Q4_K rounds against its 6-bit scales, so
    many do): re-quantizing a 4-bit GGUF loses nothing more."""
    torch.manual_seed(1)
    codes = torch.randint(0, 16, (8, 512 // group, group)).float()
    codes = codes.clamp(1, 15)
    codes[..., 0], codes[..., 1] = 1, 15  # 15 of 16 levels used
    codes[::2, :, 0] = 0  # half the rows use all 16
    s = torch.rand(8, 512 // group, 1) * 0.1 + 1e-3
    lo = torch.randn(8, 512 // group, 1) * 0.1
    w = (codes * s + lo).reshape(8, 512)
    back = quantize_int4(w, group).dequantize()
    torch.testing.assert_close(back, w, rtol=0, atol=1e-6)


def test_int4_importance_fits_the_grid_where_inputs_are_large() -> None:
    """With a weight per input (its activations' mean square), the squared errors weighted so
    are lower than those of the unweighted fit, most on the heavy inputs."""
    torch.manual_seed(2)
    w = torch.randn(64, 256)
    importance = torch.ones(256)
    importance[::4] = 50.0  # every group holds heavy inputs
    plain = quantize_int4(w, 32).dequantize() - w
    weighted = quantize_int4(w, 32, importance).dequantize() - w
    cost = lambda e: (e.square() * importance).sum().item()  # noqa: E731
    assert cost(weighted) < 0.8 * cost(plain)
    assert weighted[:, ::4].square().sum() < 0.7 * plain[:, ::4].square().sum()


def test_int4_rejects_bad_group() -> None:
    with pytest.raises(ValueError, match="group size"):
        Int4QuantMethod(group_size=64)


def _greedy(path, **kwargs) -> tuple[list[list[int]], LLMEngine]:
    from tokenmill.config import EngineArgs

    engine = LLMEngine(
        EngineArgs(model=str(path), max_model_len=256, kv_cache_memory="4MiB", **kwargs)
    )
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    prompts = [[1, 5, 9, 2, 7, 3, 11, 4], list(range(3, 40))]
    for i, p in enumerate(prompts):
        engine.add_request(p, params, request_id=str(i))
    done: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    return [done[str(i)] for i in range(len(prompts))], engine


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_int4_model_tracks_float(tiny_model_dir, arch: str) -> None:
    from tokenmill.config import EngineArgs

    path = str(tiny_model_dir(arch))
    common = dict(model=path, max_model_len=256, kv_cache_memory="8MiB")
    fp = LLMEngine(EngineArgs(**common))
    # float32 activations: this measures the int4 weights alone.
    q4 = LLMEngine(EngineArgs(**common, quantization="int4", packed_activations="float32"))
    # (embedding and head stay int8: they dominate a tiny model)
    assert q4.info.weight_nbytes < fp.info.weight_nbytes / 2
    rng = random.Random(0)
    prompts = [[1] + [rng.randrange(3, 259) for _ in range(20)] for _ in range(8)]
    params = SamplingParams(temperature=0.0, max_tokens=1, logprobs=5)
    agree, gaps = 0, []
    for prompt in prompts:
        (ref,), (ours,) = _outputs(fp, prompt, params), _outputs(q4, prompt, params)
        agree += ref.token_ids[0] == ours.token_ids[0]
        # Where they differ, float's pick is a near tie under int4 (random tiny models have
        # flat logits): its log-prob trails int4's pick by little.
        alternatives = {lp.token_id: lp.logprob for lp in ours.logprobs[0].top}
        gaps.append(ours.logprobs[0].sampled.logprob - alternatives.get(ref.token_ids[0], -99.0))
    assert agree >= 5, gaps
    assert max(gaps) < 1.0, gaps
    assert_all_blocks_free(q4)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_int4_keeps_key_and_value_projections_int8(tiny_model_dir, arch: str) -> None:
    """k_proj and v_proj stay int8 (quant/int4.py), computed in one fused matmul (with Qwen2's
    biases); q/o and the MLP are int4; the model still answers."""
    tokens, engine = _greedy(tiny_model_dir(arch), quantization="int4")
    for layer in engine.executor.worker.model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        q, kv = attn.qkv_proj.groups
        assert q.parts == ("q",) and kv.parts == ("k", "v")
        assert kv.state.weight.kind == "q8"
        assert mlp.gate_up_proj.is_fused
        assert mlp.gate_up_proj.groups[0].state.weight.kind == "q4"
        for linear in (attn.qkv_proj.part("q"), attn.o_proj, mlp.down_proj):
            assert linear.quant_state.weight.kind == "q4"
    assert all(len(t) == 8 for t in tokens)
    assert_all_blocks_free(engine)


@pytest.mark.parametrize(("arch", "tied"), [("llama", False), ("qwen2", True)])
def test_only_the_output_head_runs_int8_codes_unsigned(tiny_model_dir, arch, tied) -> None:
    """The head's int8 matmul takes 7-bit activations (PackedState.q8_unsigned), tied or not;
    the layers keep 8 bits."""
    _, engine = _greedy(tiny_model_dir(arch), quantization="int8")
    model = engine.executor.worker.model
    head = model.output_head()
    assert head is (model.model.embed_tokens if tied else model.lm_head)
    assert head.quant_state.q8_unsigned
    for layer in model.model.layers:
        assert not layer.mlp.down_proj.quant_state.q8_unsigned
    assert_all_blocks_free(engine)


def _outputs(engine: LLMEngine, prompt: list[int], params: SamplingParams) -> list:
    rid = engine.add_request(prompt, params)
    outs = []
    while engine.has_unfinished_requests():
        outs += [o.outputs[0] for o in engine.step() if o.request_id == rid and o.finished]
    return outs


def test_int4_group_that_does_not_divide_rows_is_refused(tiny_model_dir) -> None:
    with pytest.raises(ValueError, match="int4_group_size 128"):
        _greedy(tiny_model_dir("llama"), quantization="int4", int4_group_size=128)


def test_gguf_quantization_needs_a_gguf(tiny_model_dir) -> None:
    with pytest.raises(ValueError, match="needs a .gguf model"):
        _greedy(tiny_model_dir("llama"), quantization="gguf")


def test_packed_weight_takes_its_bias_into_the_kernel() -> None:
    """A GGUF layer's float bias is folded into its packed state after loading (Qwen2's q/k/v):
    the same result, with nothing left for torch to add."""
    from tokenmill.layers import Linear
    from tokenmill.quant.gguf import PackedQuantMethod

    torch.manual_seed(3)
    layer = Linear(64, 24, bias=True)
    layer.bias.data.normal_()
    layer.load_packed_(PackedQuantMethod(), quantize_int4(torch.randn(24, 64), 32))
    x = torch.randn(3, 64)
    before = layer(x)
    layer.fold_bias_()
    assert layer.bias is None and layer.quant_state.bias is not None
    torch.testing.assert_close(layer(x), before, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("kind", ["f16", "bf16"])
def test_half_weights_stay_halves_and_compute_exactly(kind: str) -> None:
    """GGUF F16 / BF16 tensors are kept as their halves (2 bytes a weight) and computed
    widened: the kernel equals the float32 matmul of the widened weight up to summation order,
    at decode sizes and, in tiles through the float GEMM, at prefill sizes; embedding rows are
    the widened rows exactly."""
    from tokenmill.kernels.cpu_backend import CpuKernelBackend
    from tokenmill.kernels.torch_backend import TorchKernelBackend
    from tokenmill.quant.packed import HALF_KINDS, pack_half

    dtype = HALF_KINDS[kind]
    n, k = 48, 200  # not a multiple of 8: the kernel's tail too
    halves = torch.randn(n, k).to(dtype)
    ggml_type = {"f16": 1, "bf16": 30}[kind]
    w = pack_half(halves.view(torch.int16).view(torch.uint8).reshape(-1), ggml_type, (n, k))
    assert w.kind == kind and w.nbytes == n * k * 2
    assert torch.equal(w.dequantize(), halves.float())
    backends = [TorchKernelBackend()] + ([CpuKernelBackend()] if kernels.available() else [])
    bias = torch.randn(n)
    for m in (1, 3, 9, 130):
        x = torch.randn(m, k)
        exact = x @ halves.float().T + bias
        for backend in backends:
            y = backend.packed_matmul(x, w, bias, act_int8=True)  # halves ignore act_int8
            torch.testing.assert_close(y, exact, rtol=1e-5, atol=1e-4)
    ids = torch.tensor([3, 0, 47, 3])
    for backend in backends:
        rows = backend.packed_embedding(w, ids, 2.0)
        assert torch.equal(rows, halves.float()[ids] * 2.0)


@needs_kernel
def test_a_half_weight_row_does_not_depend_on_its_batch() -> None:
    from tokenmill.quant.packed import pack_half

    halves = torch.randn(67, 200).half()  # 8 blocks of 8 rows and 3 more
    w = pack_half(halves.view(torch.int16).view(torch.uint8).reshape(-1), 1, (67, 200))
    x = torch.randn(9, 200)
    together = kernels.half_gemm(x, w, None)
    for i in (0, 4, 8):
        assert torch.equal(kernels.half_gemm(x[i : i + 1], w, None), together[i : i + 1])


# A tiny Llama GGUF whose projections, embedding and output head are Q2_K and Q3_K (rows of 256
# and 512: whole super-blocks): random block bytes with d (and dmin) set so that weights are
# of order 0.05 (the ``gguf`` package cannot quantize to these types). Layer 0's q/k/v and
# gate/up fuse ("q2", "q3"); layer 1's q/k/v mix formats (each part alone), its gate/up share
# one, so every op of a decode step has a C kernel (a graph records it).
K_QUANT_LAYERS = [
    {"attn_q": 10, "attn_k": 10, "attn_v": 10, "attn_output": 11, "ffn_gate": 11, "ffn_up": 11,
     "ffn_down": 10},
    {"attn_q": 11, "attn_k": 10, "attn_v": 8, "attn_output": 10, "ffn_gate": 10, "ffn_up": 10,
     "ffn_down": 11},
]  # fmt: skip


def _random_k_quant(rng, ggml_type: int, rows: int, cols: int):
    import numpy as np

    elems, nbytes, _ = BLOCK_CODES[ggml_type]
    blocks = rng.integers(0, 256, size=(rows * cols // elems, nbytes), dtype=np.uint8)
    if ggml_type == 10:  # dmin = 1.5 d centres d · scale · code - dmin · min on 0
        d = rng.uniform(3e-3, 5e-3, size=len(blocks))
        blocks[:, 80:84] = np.stack([d, 1.5 * d], 1).astype(np.float16).view(np.uint8)
    elif ggml_type == 11:
        blocks[:, 108:110] = (
            rng.uniform(1e-3, 1.5e-3, size=(len(blocks), 1)).astype(np.float16).view(np.uint8)
        )
    else:  # the others: every float16 scale of the block small (SCALE_AT)
        scale_at = SCALE_AT.get(ggml_type, [0, 2] if ggml_type in (3, 7, 12, 13) else [0])
        for at in scale_at:
            d = rng.uniform(1e-4, 2e-4, size=(len(blocks), 1)).astype(np.float16)
            blocks[:, at : at + 2] = d.view(np.uint8)
    return blocks.reshape(rows, -1)


def _write_k_quant_gguf(path, layers=K_QUANT_LAYERS, embd: int = 10, head: int = 11) -> None:
    """The tiny Llama GGUF above, or one whose layers, embedding and head have the types
    given (ggml type ids)."""
    import gguf
    import numpy as np

    hidden, inter, heads, kv_heads, head_dim, vocab = 256, 512, 4, 2, 64, 320
    rng = np.random.default_rng(0)
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(len(layers))
    writer.add_context_length(256)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(inter)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(5e5)
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256))]
    tokens += [chr(0x4E00 + i) for i in range(vocab - len(tokens))]
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_types([2, 3, 3, *[6] * 256, *[1] * (vocab - 259)])
    writer.add_token_scores([0.0] * vocab)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    shapes = {
        "attn_q": (heads * head_dim, hidden), "attn_k": (kv_heads * head_dim, hidden),
        "attn_v": (kv_heads * head_dim, hidden), "attn_output": (hidden, heads * head_dim),
        "ffn_gate": (inter, hidden), "ffn_up": (inter, hidden), "ffn_down": (hidden, inter),
    }  # fmt: skip
    tensors = {
        "token_embd.weight": (embd, (vocab, hidden)),
        "output.weight": (head, (vocab, hidden)),
    }
    for layer, types in enumerate(layers):
        for part, shape in shapes.items():
            tensors[f"blk.{layer}.{part}.weight"] = (types[part], shape)
        for norm in ("attn_norm", "ffn_norm"):
            tensors[f"blk.{layer}.{norm}.weight"] = (0, (hidden,))
    tensors["output_norm.weight"] = (0, (hidden,))
    for name, (ggml_type, shape) in tensors.items():
        if ggml_type == 0:  # F32 norms near 1
            writer.add_tensor(name, rng.normal(1.0, 0.1, size=shape).astype(np.float32))
        elif ggml_type == 8:
            w = rng.normal(0.0, 0.05, size=shape).astype(np.float32)
            qtype = gguf.GGMLQuantizationType.Q8_0
            writer.add_tensor(name, gguf.quants.quantize(w, qtype), raw_dtype=qtype)
        else:
            data = _random_k_quant(rng, ggml_type, *shape)
            writer.add_tensor(name, data, raw_dtype=gguf.GGMLQuantizationType(ggml_type))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


# The types a model holds at the file's bytes (the weights' bytes equal the GGUF tensors').
FILE_BYTES_TYPES = ["Q4_0", "Q5_0", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL"]
FILE_BYTES_TYPES += ["IQ4_XS"]


@needs_kernel
@pytest.mark.parametrize("name", FILE_BYTES_TYPES)
def test_a_gguf_model_holds_its_weights_at_the_files_bytes(tmp_path, caplog, name) -> None:
    """Every projection, the embedding and the head of one type: the loaded model holds as
    many bytes as the file's tensors (within 2%), the load log says so, and it decodes."""
    import logging

    from tokenmill.models.loader import gguf_weight_bytes, load_model, load_model_config
    from tokenmill.resolve import resolve_model

    t = GGML_TYPES[name]
    parts = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
    path = tmp_path / f"{name}.gguf"
    _write_k_quant_gguf(path, [dict.fromkeys(parts, t)] * 2, embd=t, head=t)
    with caplog.at_level(logging.INFO, logger="tokenmill.models.loader"):
        config = load_model_config(resolve_model(str(path)))
        model = load_model(config, torch.float32, torch.device("cpu"), 64, PackedQuantMethod())
    stored = gguf_weight_bytes(config)
    assert abs(model.weight_nbytes() / stored - 1) < 0.02
    assert f"the file's tensors {stored / 1e6:.1f} MB" in caplog.text
    kinds = {layer.mlp.down_proj.quant_state.weight.kind for layer in model.model.layers}
    assert kinds == {pack_gguf(_random_blocks(t, 1, 512, 0).reshape(-1), t, (1, 512)).kind}
    engine = LLMEngine.from_args(model=str(path), max_model_len=64, kv_cache_memory="4MiB")
    rid = engine.add_request([1, 5, 9], SamplingParams(max_tokens=4, ignore_eos=True))
    done = {}
    while engine.has_unfinished_requests():
        done |= {out.request_id: out for out in engine.step() if out.finished}
    assert len(done[rid].outputs[0].token_ids) == 4
    assert_all_blocks_free(engine)


def _prompt_logprobs(engine: LLMEngine, prompt: list[int]) -> tuple[torch.Tensor, list[int]]:
    """Log-probs of each prompt token after the first, and 6 greedy tokens."""
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, prompt_logprobs=0)
    rid = engine.add_request(prompt, params)
    done = {}
    while engine.has_unfinished_requests():
        done |= {out.request_id: out for out in engine.step() if out.finished}
    out = done[rid]
    logprobs = [entry.sampled.logprob for entry in out.prompt_logprobs[1:]]
    return torch.tensor(logprobs), out.outputs[0].token_ids


@needs_kernel
def test_q2_k_and_q3_k_models_stay_packed_and_match_their_dequantized_weights(
    tmp_path, caplog
) -> None:
    """A Q2_K / Q3_K GGUF loads with those weights packed ("q2" / "q3", no warning that they
    are not), and computes what its weights dequantized by the torch unpackers (equal to the
    ``gguf`` package's) compute: within 1e-4 in log-prob with float activations on the C kernel
    and on the torch twin, within the int8 activations' error otherwise; decode-step graphs
    replay those steps exactly."""
    import logging

    from tokenmill.models.loader import load_model, load_model_config
    from tokenmill.resolve import resolve_model

    path = tmp_path / "k-quants.gguf"
    _write_k_quant_gguf(path)
    with caplog.at_level(logging.INFO):
        config = load_model_config(resolve_model(str(path)))
        model = load_model(config, torch.float32, torch.device("cpu"), 64, PackedQuantMethod())
    assert "not kept packed" not in caplog.text
    first, second = model.model.layers
    assert first.self_attn.qkv_proj.is_fused and first.mlp.gate_up_proj.is_fused
    assert first.self_attn.qkv_proj.groups[0].state.weight.kind == "q2"
    assert first.mlp.gate_up_proj.groups[0].state.weight.kind == "q3"
    assert second.mlp.down_proj.quant_state.weight.kind == "q3"

    rng = random.Random(3)
    prompt = [1] + [rng.randrange(3, 320) for _ in range(23)]
    common = dict(model=str(path), max_model_len=64, kv_cache_memory="4MiB")
    ref, ref_tokens = _prompt_logprobs(LLMEngine.from_args(**common, quantization="none"), prompt)
    assert ref.std() > 0.5  # random weights spread the log-probs
    for backend in ("cpu", "torch"):
        engine = LLMEngine.from_args(
            **common, packed_activations="float32", kernel_backend=backend, enforce_eager=True
        )
        ours, tokens = _prompt_logprobs(engine, prompt)
        torch.testing.assert_close(ours, ref, rtol=0, atol=1e-4)
        assert tokens == ref_tokens
    graphed = LLMEngine.from_args(**common)
    int8, graphed_tokens = _prompt_logprobs(graphed, prompt)
    assert (int8 - ref).abs().max() < 0.4 and (int8 - ref).abs().mean() < 0.1
    eager, eager_tokens = _prompt_logprobs(
        LLMEngine.from_args(**common, enforce_eager=True), prompt
    )
    assert torch.equal(eager, int8) and eager_tokens == graphed_tokens
    assert graphed.executor.worker.runner.decode_graphs.captured_sizes() == [1]
