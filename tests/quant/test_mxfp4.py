"""MXFP4 (quant/mxfp4.py) against the ``gguf`` package's dequantization, bit for bit: every
code under every one of the 256 e8m0 exponents, and a Hugging Face checkpoint's nibble order."""

from __future__ import annotations

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as T

from tokenmill.quant.mxfp4 import Mxfp4Weight


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
