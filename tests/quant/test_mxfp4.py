"""MXFP4 (quant/mxfp4.py) against the ``gguf`` package's dequantization, bit for bit: every
code under every one of the 256 e8m0 exponents, and a Hugging Face checkpoint's nibble order."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T

from tokenmill.kernels import cpu_library
from tokenmill.kernels.cpu_backend import CpuKernelBackend
from tokenmill.quant.mxfp4 import Mxfp4Weight, to_packed


def test_every_code_under_every_exponent_is_bit_exact() -> None:
    rng = np.random.default_rng(0)
    blocks = np.zeros((256, 17), np.uint8)
    blocks[:, 0] = np.arange(256)  # e8m0: 0 and 1 give denormal scales, 255 overflows
    blocks[:, 1:] = rng.integers(0, 256, (256, 16))
    blocks[0, 1:] = np.arange(16) | (np.arange(16)[::-1] << 4)  # every code, both nibbles
    raw = blocks.reshape(4, -1)  # 4 rows of 64 blocks
    with np.errstate(over="ignore"):
        ref = gguf.quants.dequantize(raw, T.MXFP4)
    out = Mxfp4Weight.from_ggml(torch.from_numpy(raw), (4, 64 * 32)).dequantize().numpy()
    assert out.shape == ref.shape == (4, 2048)
    assert np.array_equal(out.view(np.uint32), ref.view(np.uint32))


def test_quantized_weights_round_trip_exactly() -> None:
    rng = np.random.default_rng(1)
    w = (rng.normal(0, 1, (8, 256)) * np.exp(rng.uniform(-30, 30, (8, 1)))).astype(np.float32)
    data = gguf.quants.quantize(w, T.MXFP4)
    ref = gguf.quants.dequantize(data, T.MXFP4)
    out = Mxfp4Weight.from_ggml(torch.from_numpy(data), (8, 256)).dequantize().numpy()
    assert np.array_equal(out.view(np.uint32), ref.view(np.uint32))


def test_a_hugging_face_checkpoints_nibble_order() -> None:
    """Hugging Face packs values 2j and 2j + 1 in byte j (low nibble first); llama.cpp puts
    value j in byte j's low nibble and value j + 16 in its high one."""
    codes = torch.arange(32, dtype=torch.uint8) % 16  # value i has code i mod 16
    hf_blocks = (codes[0::2] | (codes[1::2] << 4)).view(1, 1, 16)
    scales = torch.full((1, 1), 127, dtype=torch.uint8)  # 2^0
    weight = Mxfp4Weight.from_hf(hf_blocks, scales)
    e2m1 = [0, 0.5, 1, 1.5, 2, 3, 4, 6, 0, -0.5, -1, -1.5, -2, -3, -4, -6]
    assert weight.dequantize()[0].tolist() == [e2m1[c] for c in codes.tolist()]
    assert weight.codes[0, 0].tolist() == (codes[:16] | (codes[16:] << 4)).tolist()


@pytest.mark.parametrize("exponents", [(110, 135), (0, 255)], ids=["float16", "float32"])
def test_the_packed_relayout_is_exact_and_the_c_kernel_computes_it(exponents) -> None:
    """``to_packed``: the same values (float16 group scales where every 2^(e − 128) is one,
    float32 otherwise: the denormal and overflowing exponents included), and the packed C
    kernel's matmul over them equals the float matmul of the MXFP4 values."""
    gen = torch.Generator().manual_seed(2)
    lo, hi = exponents
    scales = torch.randint(lo, hi + 1, (3, 8, 4), dtype=torch.uint8, generator=gen)
    codes = torch.randint(0, 256, (3, 8, 4, 16), dtype=torch.uint8, generator=gen)
    w = Mxfp4Weight(scales, codes)
    packed = to_packed(w)
    want = w.dequantize().reshape(24, 128)
    assert packed.kind == "m4" and packed.shape == (24, 128)
    assert packed.scales.dtype == (torch.float16 if hi < 255 else torch.float32)
    assert torch.equal(packed.dequantize(), want)
    if hi == 255 or not cpu_library.available():
        return  # 2^127 overflows any matmul; without the C library there is no kernel
    x = torch.randn(5, 128, generator=gen)
    got = CpuKernelBackend().packed_matmul(x, packed, None, act_int8=False)
    torch.testing.assert_close(got, x @ want.t(), rtol=1e-4, atol=1e-4)
