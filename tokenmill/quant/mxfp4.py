"""MXFP4 (the OCP Microscaling spec, 2023): blocks of 32 four-bit e2m1 values that share one
e8m0 scale, the format gpt-oss's expert weights ship in (its checkpoints' ``*_blocks`` and
``*_scales`` tensors, and llama.cpp's GGML type 39).

    value = E2M1[code] · 2^(scale − 127),   E2M1 = 0, ½, 1, 1½, 2, 3, 4, 6 and their negatives

Kept as the files hold it, in llama.cpp's block order: per block a scale byte and 16 bytes
whose low nibbles are its first 16 values and high nibbles its last 16. A Hugging Face
checkpoint packs each byte's two nibbles as consecutive values instead; ``from_hf`` reorders
them. ``dequantize`` is the readable reference; it is bit-exact against the ``gguf``
package's (the values and the power of two are exact in float32).

``to_packed`` lays a stack out for the packed C kernels (quant/packed.py's "m4": the 4-bit
indices as the file has them, into the same table of doubled values, lane-ordered), exactly:
each block's 2^(scale − 128) becomes its group scale, float16 where every one is a float16
(4.5 bits a weight, the file's 4.25), else float32 (5).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# E2M1_DOUBLED: e2m1's 16 values, doubled (as llama.cpp keeps them: small integers), halved
# by the scale; the "m4" layout's table.
from tokenmill.quant.packed import E2M1_DOUBLED, PackedWeight, pack_codes

BLOCK = 32
GGML_MXFP4 = 39  # GGMLQuantizationType.MXFP4


@dataclass(slots=True)
class Mxfp4Weight:
    """A stack of MXFP4 matrices: ``scales`` uint8 [*lead, N, K / 32] (e8m0 exponents) and
    ``codes`` uint8 [*lead, N, K / 32, 16] (llama.cpp's nibble order)."""

    scales: torch.Tensor
    codes: torch.Tensor

    @property
    def shape(self) -> tuple[int, ...]:
        return (*self.scales.shape[:-1], self.scales.shape[-1] * BLOCK)

    @property
    def nbytes(self) -> int:
        return self.scales.numel() + self.codes.numel()

    @classmethod
    def from_ggml(cls, raw: torch.Tensor, shape: tuple[int, ...]) -> Mxfp4Weight:
        """From a GGUF tensor's bytes (uint8, 17 a block: the scale, then 16 code bytes)."""
        blocks = raw.reshape(*shape[:-1], shape[-1] // BLOCK, 17)
        return cls(blocks[..., 0].contiguous(), blocks[..., 1:].contiguous())

    @classmethod
    def from_hf(cls, blocks: torch.Tensor, scales: torch.Tensor) -> Mxfp4Weight:
        """From a Hugging Face checkpoint's ``*_blocks`` [*, N, K / 32, 16] and ``*_scales``
        [*, N, K / 32] (each byte: value 2j in its low nibble, 2j + 1 in its high one)."""
        if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != BLOCK // 2:
            raise ValueError(
                f"MXFP4 blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} do not "
                "match (blocks [..., K/32, 16], scales [..., K/32])"
            )
        values = torch.stack((blocks & 0x0F, blocks >> 4), dim=-1).flatten(-2)  # [..., 32]
        codes = values[..., : BLOCK // 2] | (values[..., BLOCK // 2 :] << 4)
        return cls(scales.to(torch.uint8).contiguous(), codes.to(torch.uint8).contiguous())

    def select(self, index: slice | int | torch.Tensor) -> Mxfp4Weight:
        """Some of the leading dimension (an expert, or every other row)."""
        return Mxfp4Weight(self.scales[index], self.codes[index])

    def rows(self, index: slice) -> Mxfp4Weight:
        """Some rows of each matrix (the second to last dimension)."""
        return Mxfp4Weight(self.scales[..., index, :], self.codes[..., index, :, :])

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """[*lead, N, K] in ``dtype``."""
        table = torch.tensor(E2M1_DOUBLED, dtype=torch.float32, device=self.codes.device)
        low, high = (self.codes & 0x0F).long(), (self.codes >> 4).long()
        values = torch.cat((table[low], table[high]), dim=-1)  # [..., K / 32, 32]
        return (values * e8m0_half(self.scales)[..., None]).flatten(-2).to(dtype)


# 2^(e − 128) is a float16 (normal or subnormal) for e in 104..143: 2^-24 .. 2^15.
_FLOAT16_EXPONENTS = (104, 143)


def to_packed(w: Mxfp4Weight) -> PackedWeight:
    """A stack [*lead, N, K] as one "m4" PackedWeight [lead·N, K] (rows in order), exactly;
    K a multiple of 64 (the kernels' lane order)."""
    *_, k = w.shape
    rows = w.scales.numel() // (k // BLOCK)
    scales, codes = w.scales.reshape(rows, k // BLOCK), w.codes.reshape(rows, k // BLOCK, 16)
    lo, hi = _FLOAT16_EXPONENTS
    f16 = bool(((scales >= lo) & (scales <= hi)).all())
    group_scales = e8m0_half(scales)
    stored: torch.Tensor | None = None
    chunk = max(1, (1 << 22) // k)  # ~4M codes of temporaries at a time
    for start in range(0, rows, chunk):
        part = codes[start : start + chunk]
        # The file's nibbles are the table's indices: stored as "q4" stores its codes.
        indices = torch.cat((part & 0x0F, part >> 4), dim=-1).flatten(1)
        packed = pack_codes(indices, "q4")
        if stored is None:  # filled in place: parts and a cat would hold the stack twice
            stored = packed.new_empty((rows, packed.shape[1]))
        stored[start : start + len(packed)] = packed
    assert stored is not None
    scales_out = group_scales.half() if f16 else group_scales.contiguous()
    return PackedWeight("m4", stored, scales_out, None, BLOCK, (rows, k))


def e8m0_half(exponents: torch.Tensor) -> torch.Tensor:
    """2^(e − 128) in float32, exactly (e = 0 and 1 are denormals): the scale of the doubled
    values."""
    e = exponents.to(torch.int32)
    bits = torch.where(e < 2, torch.tensor(0x00200000, dtype=torch.int32) << e, (e - 1) << 23)
    return bits.view(torch.float32)
