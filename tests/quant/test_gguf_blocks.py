"""Torch GGUF block unpackers equal the gguf package's numpy reference, bit for bit."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize as np_dequantize

from tokenmill.quant.gguf_blocks import BLOCK_FORMATS

TYPES = [
    "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL",
    "IQ4_XS",
]  # fmt: skip


def _random_blocks(qtype: GGMLQuantizationType, num_blocks: int, seed: int) -> np.ndarray:
    block, nbytes = GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    data = rng.integers(0, 256, size=(num_blocks, nbytes), dtype=np.uint8)
    # Keep the f16 scale fields finite and modest (random bytes can be inf/nan).
    two = qtype.name.endswith(("_K", "_1"))  # d and dmin / d and m (IQ4_XS: d only)
    at_end = {"Q6_K": [208], "Q2_K": [80, 82], "Q3_K": [108]}  # d (and dmin) after the codes
    scale_offsets = at_end.get(qtype.name, [0, 2] if two else [0])
    for off in scale_offsets:
        vals = rng.uniform(-0.1, 0.1, size=num_blocks).astype(np.float16)
        data[:, off : off + 2] = vals.view(np.uint8).reshape(num_blocks, 2)
    return data


@pytest.mark.parametrize("name", TYPES)
def test_matches_numpy_reference(name: str) -> None:
    qtype = GGMLQuantizationType[name]
    block, nbytes, fn = BLOCK_FORMATS[int(qtype)]
    assert (block, nbytes) == GGML_QUANT_SIZES[qtype]
    data = _random_blocks(qtype, 64, seed=int(qtype))
    ours = fn(torch.from_numpy(data.copy()))
    ref = np_dequantize(data.reshape(-1), qtype).reshape(64, block)
    assert ours.shape == (64, block)
    torch.testing.assert_close(ours, torch.from_numpy(ref.astype(np.float32)), rtol=0, atol=0)


def test_real_gguf_tensors_match(tmp_path) -> None:
    """Round-trip real values through gguf's own quantizers for the 32-element formats."""
    from gguf.quants import quantize as np_quantize

    rng = np.random.default_rng(0)
    weights = rng.normal(0, 0.05, size=(8, 256)).astype(np.float32)
    for name in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"):
        qtype = GGMLQuantizationType[name]
        packed = np_quantize(weights, qtype)
        block, nbytes, fn = BLOCK_FORMATS[int(qtype)]
        ours = fn(torch.from_numpy(packed.reshape(-1, nbytes).copy())).reshape(8, 256)
        ref = np_dequantize(packed, qtype).reshape(8, 256)
        torch.testing.assert_close(ours, torch.from_numpy(ref), rtol=0, atol=0)
