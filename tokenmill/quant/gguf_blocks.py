"""GGUF (ggml) block formats unpacked in torch: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K,
Q5_K, Q6_K, IQ4_NL, IQ4_XS.

Every format is, per group of 16 or 32 elements, ``w = scale · code - offset`` with small
integer codes. ``unpack_codes`` returns exactly that triple for whole blocks (raw bytes as a
uint8 tensor [num_blocks, block_bytes]), vectorized over all blocks; ``BLOCK_FORMATS`` builds
float dequantizers on it. Both mirror ggml's reference dequantizers (and the ``gguf`` package's
numpy port, their test oracle): the scales are formed in float32 the same way, so packing the
codes elsewhere (quant/packed.py) loses nothing.

Layouts (bytes): Q4_0 = f16 d | 16 nibble pairs; Q5_0 = f16 d | u32 high bits | 16 pairs;
Q8_0 = f16 d | 32 int8; Q4_1 and Q5_1 as Q4_0 and Q5_0 with an f16 min m after d, unsigned
codes, w = d · code + m (so the offset is -m). K-quants are 256-element super-blocks of 8 (Q4_K/Q5_K, 6-bit scales and
mins packed in 12 bytes) or 16 (Q6_K, int8 scales) sub-blocks. Q2_K (84 bytes) = 16 bytes of
sub-block scale | min << 4 | 64 bytes of 2-bit codes | f16 d | f16 dmin, w = d · scale · code -
dmin · min per 16 elements; Q3_K (110 bytes) = 32 bytes of high code bits | 64 bytes of low
2-bit pairs | 12 bytes of 6-bit scales | f16 d, w = d · (scale - 32) · (code - 4), code 0..7
(q3_k_scales). In both, 2-bit pair j of byte i of a 32-byte plane is element 32 j + i of
its 128 (k_quant_planes). IQ4_NL is Q4_0's layout whose
4-bit indices pick a code from a fixed non-uniform table (IQ4_KVALUES); IQ4_XS puts 8 such
32-element sub-blocks in a 256-element super-block: f16 d | u16 high scale bits | 4 bytes low
scale bits | 128 bytes of nibble pairs, sub-block scale d · (ls - 32) with a 6-bit ls.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

QK_K = 256
# IQ4_NL / IQ4_XS: the code each 4-bit index stands for (ggml's kvalues_iq4nl), ascending.
IQ4_KVALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)


@dataclass(slots=True)
class BlockCodes:
    """w = scales · codes - offsets, group by group, for ``n`` blocks."""

    codes: torch.Tensor  # [n, block_elems] int16, in ggml's element order
    scales: torch.Tensor  # [n, block_elems // group] float32
    offsets: torch.Tensor | None  # same shape as scales, or None
    group: int

    def dequantize(self) -> torch.Tensor:
        n, elems = self.codes.shape
        q = self.codes.float().reshape(n, -1, self.group)
        w = self.scales[:, :, None] * q
        if self.offsets is not None:
            w = w - self.offsets[:, :, None]
        return w.reshape(n, elems)


def _f16(b: torch.Tensor) -> torch.Tensor:
    """[n, 2] uint8 -> [n, 1] float32."""
    return b.contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor, group: int) -> torch.Tensor:
    """Low nibbles of each ``group`` bytes, then their high nibbles: [n, g*group] -> [n, 2*...]."""
    n = qs.shape[0]
    qs = qs.reshape(n, -1, 1, group)
    shifts = torch.tensor([0, 4], dtype=torch.uint8).view(1, 1, 2, 1)
    return ((qs >> shifts) & 0x0F).reshape(n, -1)


def _bits(b: torch.Tensor) -> torch.Tensor:
    """[n, k] uint8 -> [n, 8k] bits, little-endian within each byte."""
    shifts = torch.arange(8, dtype=torch.uint8).view(1, 1, 8)
    return ((b.unsqueeze(-1) >> shifts) & 1).reshape(b.shape[0], -1)


def codes_q4_0(blocks: torch.Tensor) -> BlockCodes:
    q = _nibbles(blocks[:, 2:], 16).to(torch.int16) - 8
    return BlockCodes(q, _f16(blocks[:, :2]), None, 32)


def codes_q5_0(blocks: torch.Tensor) -> BlockCodes:
    high = _bits(blocks[:, 2:6])  # [n, 32]: bit j is element j's fifth bit
    low = _nibbles(blocks[:, 6:], 16)
    q = (low | (high << 4)).to(torch.int16) - 16
    return BlockCodes(q, _f16(blocks[:, :2]), None, 32)


def codes_q4_1(blocks: torch.Tensor) -> BlockCodes:
    q = _nibbles(blocks[:, 4:], 16).to(torch.int16)
    return BlockCodes(q, _f16(blocks[:, :2]), -_f16(blocks[:, 2:4]), 32)


def codes_q5_1(blocks: torch.Tensor) -> BlockCodes:
    high = _bits(blocks[:, 4:8])
    low = _nibbles(blocks[:, 8:], 16)
    q = (low | (high << 4)).to(torch.int16)
    return BlockCodes(q, _f16(blocks[:, :2]), -_f16(blocks[:, 2:4]), 32)


def codes_q8_0(blocks: torch.Tensor) -> BlockCodes:
    q = blocks[:, 2:].contiguous().view(torch.int8).to(torch.int16)
    return BlockCodes(q, _f16(blocks[:, :2]), None, 32)


def k_scales(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K: 12 bytes -> 8 six-bit scales and 8 six-bit mins per super-block."""
    s = scales.reshape(-1, 3, 4)
    d, m, m_d = s[:, 0], s[:, 1], s[:, 2]
    sc = torch.cat([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], dim=-1)
    mn = torch.cat([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return sc.float(), mn.float()


def k_quant_planes(qs: torch.Tensor) -> torch.Tensor:
    """Q2_K / Q3_K: [n, 64] bytes of 2-bit codes -> [n, 256] codes 0..3 in element order (bytes
    0..31 hold elements 0..127, bits 2j..2j+1 of byte i element 32 j + i; bytes 32..63 the rest)."""
    n = qs.shape[0]
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8).view(1, 1, 4, 1)
    return ((qs.reshape(n, 2, 1, 32) >> shifts) & 3).reshape(n, QK_K)


def q2_k_scales(sub: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q2_K: [n, 16] bytes -> each sub-block's 4-bit scale and 4-bit min (float32 [n, 16])."""
    return (sub & 0x0F).float(), (sub >> 4).float()


def q3_k_scales(packed: torch.Tensor) -> torch.Tensor:
    """Q3_K: [n, 12] bytes -> its 16 sub-block scales, 6-bit less 32 (int16 [n, 16]): the low 4
    bits of scale s in byte s mod 8 (high nibble from s = 8), its top 2 in byte 8 + s mod 4,
    bits 2 (s / 4) .. + 1."""
    low = torch.cat([packed[:, :8] & 0x0F, packed[:, :8] >> 4], dim=1)  # [n, 16]
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=packed.device).view(1, 4, 1)
    high = ((packed[:, 8:12].reshape(-1, 1, 4) >> shifts) & 3).reshape(-1, 16)
    return (low | (high << 4)).to(torch.int16) - 32


def codes_q2_k(blocks: torch.Tensor) -> BlockCodes:
    sc, mn = q2_k_scales(blocks[:, :16])
    q = k_quant_planes(blocks[:, 16:80]).to(torch.int16)
    return BlockCodes(q, _f16(blocks[:, 80:82]) * sc, _f16(blocks[:, 82:84]) * mn, 16)


def codes_q3_k(blocks: torch.Tensor) -> BlockCodes:
    n = blocks.shape[0]
    high = (
        blocks[:, :32].reshape(n, 1, 32) >> torch.arange(8, dtype=torch.uint8).view(1, 8, 1)
    ) & 1
    q = (k_quant_planes(blocks[:, 32:96]) | (high.reshape(n, QK_K) << 2)).to(torch.int16) - 4
    scales = q3_k_scales(blocks[:, 96:108]).float()
    return BlockCodes(q, _f16(blocks[:, 108:110]) * scales, None, 16)


def codes_q4_k(blocks: torch.Tensor) -> BlockCodes:
    d, dmin = _f16(blocks[:, 0:2]), _f16(blocks[:, 2:4])
    sc, mn = k_scales(blocks[:, 4:16])
    q = _nibbles(blocks[:, 16:144], 32).to(torch.int16)
    return BlockCodes(q, d * sc, dmin * mn, 32)


def codes_q5_k(blocks: torch.Tensor) -> BlockCodes:
    n = blocks.shape[0]
    d, dmin = _f16(blocks[:, 0:2]), _f16(blocks[:, 2:4])
    sc, mn = k_scales(blocks[:, 4:16])
    qh = blocks[:, 16:48].reshape(n, 1, 1, 32)
    high = (qh >> torch.arange(8, dtype=torch.uint8).view(1, 1, 8, 1)) & 1  # [n, 1, 8, 32]
    low = _nibbles(blocks[:, 48:176], 32)
    q = (low | (high.reshape(n, QK_K) << 4)).to(torch.int16)
    return BlockCodes(q, d * sc, dmin * mn, 32)


def codes_q6_k(blocks: torch.Tensor) -> BlockCodes:
    n = blocks.shape[0]
    low = _nibbles(blocks[:, :128], 64).reshape(n, 8, 32)
    qh = blocks[:, 128:192].reshape(n, 2, 1, 32)
    high = (qh >> torch.tensor([0, 2, 4, 6], dtype=torch.uint8).view(1, 1, 4, 1)) & 3
    q = (low | (high.reshape(n, 8, 32) << 4)).to(torch.int16).reshape(n, QK_K) - 32
    scales = blocks[:, 192:208].contiguous().view(torch.int8).float()  # [n, 16]
    return BlockCodes(q, _f16(blocks[:, 208:210]) * scales, None, 16)


def iq4_values(idx: torch.Tensor) -> torch.Tensor:
    """IQ4 indices 0..15 (any integer dtype) -> their codes, int16."""
    table = torch.tensor(IQ4_KVALUES, dtype=torch.int16, device=idx.device)
    return table[idx.long()]


def codes_iq4_nl(blocks: torch.Tensor) -> BlockCodes:
    q = iq4_values(_nibbles(blocks[:, 2:], 16))
    return BlockCodes(q, _f16(blocks[:, :2]), None, 32)


def iq4_xs_scales(sub: torch.Tensor) -> torch.Tensor:
    """IQ4_XS's 6 sub-block scale bytes [n, 6] (scales_h, a little-endian uint16 of 2 bits a
    sub-block; scales_l, 4 bytes of 4 bits a sub-block) -> its 8 signed scales, int32 [n, 8]."""
    low = _nibbles(sub[:, 2:6], 1).to(torch.int32)  # [n, 8]: sub-block j in byte j / 2
    high = sub[:, 0:2].contiguous().view(torch.int16).to(torch.int32)  # [n, 1]: 2 bits each
    high = (high >> torch.arange(0, 16, 2, dtype=torch.int32).view(1, 8)) & 3
    return (low | (high << 4)) - 32


def codes_iq4_xs(blocks: torch.Tensor) -> BlockCodes:
    q = iq4_values(_nibbles(blocks[:, 8:], 16))
    return BlockCodes(q, _f16(blocks[:, :2]) * iq4_xs_scales(blocks[:, 2:8]).float(), None, 32)


# ggml type id -> (elements per block, bytes per block, code unpacker)
BLOCK_CODES: dict[int, tuple[int, int, Callable[[torch.Tensor], BlockCodes]]] = {
    2: (32, 18, codes_q4_0),
    3: (32, 20, codes_q4_1),
    6: (32, 22, codes_q5_0),
    7: (32, 24, codes_q5_1),
    8: (32, 34, codes_q8_0),
    10: (QK_K, 84, codes_q2_k),
    11: (QK_K, 110, codes_q3_k),
    12: (QK_K, 144, codes_q4_k),
    13: (QK_K, 176, codes_q5_k),
    14: (QK_K, 210, codes_q6_k),
    20: (32, 18, codes_iq4_nl),
    23: (QK_K, 136, codes_iq4_xs),
}


def _dequantizer(codes_fn: Callable[[torch.Tensor], BlockCodes]):
    return lambda blocks: codes_fn(blocks).dequantize()


# ggml type id -> (elements per block, bytes per block, float32 dequantizer)
BLOCK_FORMATS: dict[int, tuple[int, int, Callable[[torch.Tensor], torch.Tensor]]] = {
    t: (elems, nbytes, _dequantizer(fn)) for t, (elems, nbytes, fn) in BLOCK_CODES.items()
}
