"""Packed weights: integer codes with a float32 scale (and optional offset) per group.

    w[n, k] = scales[n, k // G] · code[n, k] - offsets[n, k // G]

One layout serves every packed scheme: GGUF's block formats are repacked into it at load with
their own scales (no extra error; kept float16 where the file's are: Q8_0, Q5_0, Q4_0,
IQ4_NL, so the output head reads half the scale bytes), and int8 / int4 are quantized into it.
``kind`` says how codes are stored:
  "q8": int8 codes [N, K] (GGUF Q8_0; int8);
  "u8": bytes code + ``zero``, 0..63 [N, K] (GGUF Q6_K: zero 32): the kernel multiplies them
        unsigned, cheaper than signed codes (csrc/qgemm.c);
  "q5": 5-bit codes + ``zero``, 0..31 (GGUF Q5_0: zero 16, Q5_1 and Q5_K: 0), in rows of a
        multiple of 64 elements, as few bytes as the file's: per block of t code vectors
        (below), a 32-byte plane of their fifth bits (vector u in bit u), then their low 4
        bits as "q4" keeps them: 0.625 bytes a code where "u8" took 1, which batch-1 decode,
        bound by the bytes it reads, turns into speed;
  "q4": 4-bit codes + ``zero``, 0..15, two per byte [N, K/2] (GGUF Q4_0: zero 8, Q4_1; int4);
  "n4": 4-bit indices stored as "q4", each standing for the int8 code IQ4_KVALUES[index]
        (GGUF IQ4_NL); the kernel looks the codes up and multiplies them as "q8";
  "m4": the same with MXFP4's doubled e2m1 values (E2M1_DOUBLED: gpt-oss's experts, whose
        power-of-two block scales the scales hold, quant/mxfp4.py);
  "q2", "q3", "q4k", "q5k", "q6k", "n4k": GGUF Q2_K / Q3_K / Q4_K / Q5_K / Q6_K / IQ4_XS kept
        as their 256-element super-blocks, exactly as many bytes as the file's (K_QUANT_KINDS):
        the codes ("q2": 2-bit 0..3; "q3": and a third bit, code + ``zero`` 4; "q4k": 4-bit
        0..15; "q5k": 5-bit 0..31; "q6k": 4 bits and 2 more, code + ``zero`` 32; "n4k": "n4"'s
        4-bit indices into IQ4_KVALUES) and the file's own sub-block
        scale bytes in ``codes``, the float16 d (and "q2", "q4k", "q5k": dmin) of each
        super-block in ``scales`` [N, K/256] ([N, K/128], d and dmin in turn); ``group`` is the
        sub-block's (16, "q4k" and "q5k" 32), and
        ``group_scales`` gives its float32 scales (d · scale) and offsets (dmin · min) as the
        other kinds hold them. The kernel forms those in registers as it reads each block.
Within a row the codes are stored in the C kernel's "lane order" (``lane_order``; why, in
csrc/qgemm.c): rows of a multiple of 64 elements are permuted in blocks of 8 chunks of 32 so
that one 32-byte vector holds 4 codes of each of 8 chunks. "q4" and "n4" then pack each pair
of 32-code vectors into 32 bytes (the first in the low nibbles). Rows of other lengths keep
element order ("q4", "n4": per 32-element chunk, byte j holds elements j and j + 16, as ggml's
Q4_0) and are computed by the torch reference only ("q5" rows are always lane ordered: other
lengths stay "u8"). ``codes_int`` gives codes in element order
("n4": the table's codes, not the indices). K-quant rows (K_QUANT_KINDS), whole super-blocks,
always fill blocks of 8 chunks, one a super-block. "q2" and "q3": its 8 code vectors' low 2-bit
pairs go in two 32-byte planes (vectors 0..3, the first halves of the 8 chunks, then 4..7;
vector 4p + s in bits 2s of plane p), "q3"'s third bits in one more (vector u in bit u). "q4k",
"n4k": its 8 code vectors as "q4" keeps them (pairs in 32 bytes, the first in the low nibbles). "q5k":
their low 4 bits so, then their fifth bits in one plane (vector u in bit u). "q6k": their low 4
bits so, then their top 2 bits in two planes as "q2"'s. Then the sub-block scale bytes.
The matmul runs in the C kernel (kernels/cpu_library.py) where it is built;
``reference_matmul`` is its pure-torch twin, the torch kernel backend's path and the oracle of
the tests.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch

from tokenmill.quant.gguf_blocks import (
    BLOCK_CODES,
    IQ4_KVALUES,
    QK_K,
    BlockCodes,
    iq4_values,
    iq4_xs_scales,
    k_scales,
    q2_k_scales,
    q3_k_scales,
)

# A "q4" weight converted for torch's int4 CUDA kernel at load (kernels/torch_int4.py): its
# ``codes`` are torch's tiles, its ``scales`` the kernel's bfloat16 scales and zeros
# [K / G, N, 2]. Only that kernel reads it.
TORCH_INT4_KIND = "t4"


@dataclass(slots=True)
class PackedWeight:
    # PACKED_KINDS | "f16" | "bf16" | "t4"
    kind: str
    # int8 [N, K], uint8 [N, K] ("u8"), uint8 [N, K // 2] ("q4", "n4"), uint8 [N, K // 2 + 32 ·
    # blocks] ("q5"), or uint8 [N, K / 256 · super-block bytes] (K_QUANT_KINDS)
    codes: torch.Tensor
    scales: torch.Tensor  # float32 or float16 [N, K // G] (K_QUANT_KINDS: float16 d, dmin)
    offsets: torch.Tensor | None  # float32 [N, K // G] or None
    group: int  # G: 16, or a multiple of 32
    shape: tuple[int, int]  # (N, K)
    zero: int = 0  # "u8", "q5", "q4", K_QUANT_ZERO: stored code = code + zero

    @property
    def nbytes(self) -> int:
        tensors = [self.codes, self.scales] + ([self.offsets] if self.offsets is not None else [])
        return sum(t.numel() * t.element_size() for t in tensors)

    def to(self, device: torch.device) -> PackedWeight:
        offsets = None if self.offsets is None else self.offsets.to(device)
        return PackedWeight(
            self.kind,
            self.codes.to(device),
            self.scales.to(device),
            offsets,
            self.group,
            self.shape,
            self.zero,
        )

    def select_rows(self, index: torch.Tensor) -> PackedWeight:
        """The rows ``index``, in its order (a permutation undoing llama.cpp's q/k row order, or
        a part of rows interleaved with others: Qwen3-Next's [b|a])."""
        offsets = None if self.offsets is None else self.offsets[index].contiguous()
        return PackedWeight(
            self.kind,
            self.codes[index].contiguous(),
            self.scales[index].contiguous(),
            offsets,
            self.group,
            (len(index), self.shape[1]),
            self.zero,
        )

    def split_rows(self, sizes: list[int]) -> list[PackedWeight]:
        """Consecutive blocks of ``sizes`` rows, each its own weight (a checkpoint's fused
        q/k/v or gate/up, split into the parts a model's layers load)."""
        parts, start = [], 0
        for size in sizes:
            rows = slice(start, start + size)
            offsets = None if self.offsets is None else self.offsets[rows]
            parts.append(PackedWeight(self.kind, self.codes[rows], self.scales[rows], offsets,
                                      self.group, (size, self.shape[1]), self.zero))  # fmt: skip
            start += size
        return parts

    def permute_rows_(self, index: torch.Tensor) -> None:
        """Put rows ``index`` (a permutation) in place of rows 0.., in the same tensors (as
        select_rows, for a weight whose tensors are views into a joined weight's: the loader's
        parts, see concat_rows)."""
        for t in (self.codes, self.scales, self.offsets):
            if t is not None:
                t.copy_(t[index])

    def codes_int(self, rows: slice | torch.Tensor = slice(None)) -> torch.Tensor:
        """Codes of ``rows`` as int16 [n, K] in element order."""
        return unpack_codes(self.codes[rows], self.kind, self.shape[1], self.zero)

    def group_scales(
        self, rows: slice | torch.Tensor = slice(None)
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Float32 scales [n, K // G] and offsets (or None) of ``rows``, one per group: the
        K_QUANT_KINDS form theirs from the super-block and sub-block scales, as ggml does."""
        if self.kind not in K_QUANT_KINDS:
            offsets = None if self.offsets is None else self.offsets[rows]
            return self.scales[rows].float(), offsets
        _, sub = unpack_k_quant(self.codes[rows], self.kind, self.shape[1])
        n, num_super = sub.shape[:2]
        d = self.scales[rows].float().reshape(n, num_super, -1)  # [n, super-blocks, 1 or 2]
        per = QK_K // self.group  # sub-blocks a super-block
        if self.kind in ("q3", "q6k"):  # signed scales, no mins
            if self.kind == "q6k":
                sc = sub.reshape(-1, 16).view(torch.int8)
            else:
                sc = q3_k_scales(sub.reshape(-1, 12))
            scales = d[:, :, :1] * sc.float().reshape(n, -1, per)
            return scales.reshape(n, -1), None
        if self.kind == "n4k":  # IQ4_XS: signed 6-bit scales, no mins
            sc = iq4_xs_scales(sub.reshape(-1, 6)).float().reshape(n, -1, per)
            return (d[:, :, :1] * sc).reshape(n, -1), None
        if self.kind in ("q4k", "q5k"):  # Q5_K's scales and mins are Q4_K's
            sc, mn = k_scales(sub.reshape(-1, 12))
        else:
            sc, mn = q2_k_scales(sub.reshape(-1, 16))
        scales = d[:, :, :1] * sc.reshape(n, -1, per)
        offsets = d[:, :, 1:] * mn.reshape(n, -1, per)
        return scales.reshape(n, -1), offsets.reshape(n, -1)

    def dequantize(self, rows: slice | torch.Tensor = slice(None)) -> torch.Tensor:
        """Float32 rows of W (all of them by default)."""
        if self.kind in HALF_KINDS:  # the weights themselves, as halves
            return self.codes[rows].view(HALF_KINDS[self.kind]).float()
        if self.kind == "f8":  # fp8 checkpoints' e4m3 codes (quant/fp8.py), times their scales
            values = self.codes[rows].view(torch.float8_e4m3fn).float()
            n, k = values.shape
            scales = self.scales[rows][:, :, None]
            return (values.reshape(n, k // self.group, self.group) * scales).reshape(n, k)
        q = self.codes_int(rows).float()
        n, k = q.shape
        scales, offsets = self.group_scales(rows)
        w = scales[:, :, None] * q.reshape(n, -1, self.group)
        if offsets is not None:
            w = w - offsets[:, :, None]
        return w.reshape(n, k)


# Weights kept as the file's halves (GGUF F16 / BF16), widened to float32 as the kernel reads
# them (csrc/half.c): "codes" holds the raw 16-bit values [N, K], there are no scales (an
# empty [N, 0]) and no lane order; float activations only.
HALF_KINDS = {"f16": torch.float16, "bf16": torch.bfloat16}
HALF_GGML_TYPES = {1: "f16", 30: "bf16"}  # ggml type id -> kind


def pack_half(raw: torch.Tensor, ggml_type: int, shape: tuple[int, int]) -> PackedWeight:
    """A GGUF F16 / BF16 tensor's bytes (uint8) -> a half PackedWeight (one copy)."""
    kind = HALF_GGML_TYPES[ggml_type]
    rows, cols = shape
    codes = raw.view(torch.int16).reshape(rows, cols).clone()
    scales = torch.empty(rows, 0, dtype=torch.float32)
    return PackedWeight(kind, codes, scales, None, cols, (rows, cols))


def concat_rows(weights: list[PackedWeight]) -> PackedWeight | None:
    """One weight whose rows are those of ``weights`` in order (q/k/v or gate/up computed in one
    pass over x), or None when their layouts differ. Unsigned codes beside a "q8" part ("q5"
    or "u8", as Q5_0 q/k beside a Q8_0 v) are joined as "q8". Parts that already lie one after
    the other in one tensor (the loader re-lays a GGUF's parts so) are joined as a view of it,
    with no copy; others are copied into a new one."""
    kinds = {w.kind for w in weights}
    if "q8" in kinds and kinds <= {"q8", "u8", "q5"}:
        weights = [as_signed(w) for w in weights]
    first = weights[0]
    layout = (first.kind, first.zero, first.group, first.shape[1], first.scales.dtype)
    if any((w.kind, w.zero, w.group, w.shape[1], w.scales.dtype) != layout for w in weights):
        return None
    offsets = None
    if any(w.offsets is not None for w in weights):  # scale·code - 0 where a part has none
        offsets = _join_rows(
            [w.offsets if w.offsets is not None else torch.zeros_like(w.scales) for w in weights]
        )
    rows = sum(w.shape[0] for w in weights)
    return PackedWeight(
        first.kind,
        _join_rows([w.codes for w in weights]),
        _join_rows([w.scales for w in weights]),
        offsets,
        first.group,
        (rows, first.shape[1]),
        first.zero,
    )


def _join_rows(parts: list[torch.Tensor]) -> torch.Tensor:
    """torch.cat of 2-D ``parts`` along rows; a view when they are contiguous and adjacent in
    one storage, in order."""
    first = parts[0]
    adjacent = all(t.is_contiguous() and t.dtype == first.dtype for t in parts) and all(
        a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
        and a.storage_offset() + a.numel() == b.storage_offset()
        for a, b in zip(parts, parts[1:])
    )
    if not adjacent:
        return torch.cat(parts)
    rows = sum(t.shape[0] for t in parts)
    joined = torch.empty(0, dtype=first.dtype, device=first.device)
    return joined.set_(first.untyped_storage(), first.storage_offset(), (rows, first.shape[1]))


def as_signed(w: PackedWeight) -> PackedWeight:
    """A "u8" or "q5" weight as "q8" (int8 codes): the same values."""
    if w.kind not in ("u8", "q5"):
        return w
    codes = pack_codes(w.codes_int(), "q8")
    return PackedWeight("q8", codes, w.scales, w.offsets, w.group, w.shape)


def lane_blocks(k: int) -> list[tuple[int, int]]:
    """(first chunk, chunks) of each block of a K-element row (K a multiple of 64): blocks of
    8 chunks of 32, then 4, then 2 at the tail."""
    nc, c0, blocks = k // 32, 0, []
    while c0 < nc:
        t = 8 if nc - c0 >= 8 else 4 if nc - c0 >= 4 else 2
        blocks.append((c0, t))
        c0 += t
    return blocks


@lru_cache(maxsize=64)
def lane_order(k: int) -> torch.Tensor | None:
    """Element index of each stored code of a K-element row, or None (element order) where K is
    not a multiple of 64. Blocks of t = 8 chunks (then 4, 2); in code vector u of a block, lane
    l's 4 codes are elements 4·(u·8/t + l/t) .. +3 of the block's chunk l mod t."""
    if k % 64:
        return None
    parts = []
    for c0, t in lane_blocks(k):
        u = torch.arange(t).view(t, 1, 1)
        lane = torch.arange(8).view(1, 8, 1)
        byte = torch.arange(4).view(1, 1, 4)
        parts.append(((c0 + lane % t) * 32 + (u * (8 // t) + lane // t) * 4 + byte).reshape(-1))
    return torch.cat(parts)


@lru_cache(maxsize=64)
def _element_order(k: int, device: torch.device) -> torch.Tensor | None:
    order = lane_order(k)
    return None if order is None else torch.argsort(order).to(device)


def pack_codes(codes: torch.Tensor, kind: str, zero: int = 0) -> torch.Tensor:
    """Integer codes [N, K] in element order -> stored codes ("q8": int8 [N, K]; "u8": code +
    zero as uint8 [N, K]; "q5": code + zero, 0..31, in planes [N, K/2 + 32 · blocks]; "q4":
    codes 0..15 as uint8 [N, K/2]; "n4": codes of IQ4_KVALUES, stored as their indices as
    "q4")."""
    n, k = codes.shape
    if kind == "n4":
        codes = _iq4_indices(codes)
    elif kind == "m4":
        codes = _e2m1_indices(codes)
    order = lane_order(k)
    if order is not None:
        codes = codes[:, order.to(codes.device)]
    if kind == "q8":
        return codes.to(torch.int8)
    if kind == "u8":
        return (codes.to(torch.int16) + zero).to(torch.uint8)
    if kind == "q5":
        if order is None:
            raise ValueError(f'"q5" rows must be a multiple of 64 elements long, not {k}')
        stored = codes.to(torch.int16) + zero
        if stored.numel() and not 0 <= int(stored.min()) <= int(stored.max()) <= 31:
            raise ValueError(f'"q5" codes + zero must lie in 0..31 (zero {zero})')
        return _pack_q5(stored.to(torch.uint8))
    c = codes.to(torch.uint8)
    # lane order: 32 bytes hold a pair of 32-code vectors; element order: 16 bytes a chunk
    half = 32 if order is not None else 16
    c = c.reshape(n, -1, 2, half)
    return (c[:, :, 0] | (c[:, :, 1] << 4)).reshape(n, k // 2)


def unpack_codes(stored: torch.Tensor, kind: str, k: int, zero: int = 0) -> torch.Tensor:
    """``pack_codes`` (or ``pack_k_quant``) undone: int16 codes [N, K] in element order."""
    if kind == TORCH_INT4_KIND:
        raise ValueError("a weight in torch's int4 tiles (CUDA) has no portable codes")
    n = stored.shape[0]
    if kind in K_QUANT_KINDS:
        codes = unpack_k_quant(stored, kind, k)[0] - zero
        return iq4_values(codes) if kind == "n4k" else codes
    if kind == "q5":
        codes = _unpack_q5(stored, k) - zero
    elif kind not in ("q4", *TABLE_KINDS):
        codes = stored.to(torch.int16) - zero
    else:
        half = 32 if k % 64 == 0 else 16
        pairs = stored.reshape(n, -1, 1, half)
        shifts = torch.tensor([0, 4], dtype=torch.uint8, device=stored.device).view(1, 1, 2, 1)
        codes = ((pairs >> shifts) & 0x0F).reshape(n, k).to(torch.int16) - zero
        if kind == "n4":
            codes = iq4_values(codes)
        elif kind == "m4":
            table = torch.tensor(E2M1_DOUBLED, dtype=torch.int16, device=stored.device)
            codes = table[codes.long()]
    inverse = _element_order(k, stored.device)
    return codes if inverse is None else codes[:, inverse]


def _pack_q5(codes: torch.Tensor) -> torch.Tensor:
    """Codes 0..31 [N, K] in lane order -> "q5" bytes: each block's plane of fifth bits, then
    its low nibbles in pairs of vectors (as "q4")."""
    n, k = codes.shape
    parts = []
    for c0, t in lane_blocks(k):
        vectors = codes[:, c0 * 32 : (c0 + t) * 32].reshape(n, t, 32)
        plane = torch.zeros(n, 32, dtype=torch.uint8, device=codes.device)
        for u in range(t):
            plane |= ((vectors[:, u] >> 4) & 1) << u
        low = (vectors & 0x0F).reshape(n, t // 2, 2, 32)
        parts += [plane, (low[:, :, 0] | low[:, :, 1] << 4).reshape(n, 16 * t)]
    return torch.cat(parts, dim=1)


def _unpack_q5(stored: torch.Tensor, k: int) -> torch.Tensor:
    """``_pack_q5`` undone: int16 codes 0..31 [N, K] in lane order."""
    n, at, parts = stored.shape[0], 0, []
    shifts = torch.tensor([0, 4], dtype=torch.uint8, device=stored.device).view(1, 1, 2, 1)
    for _, t in lane_blocks(k):
        plane = stored[:, at : at + 32].unsqueeze(1)  # [n, 1, 32]
        nibbles = stored[:, at + 32 : at + 32 + 16 * t].reshape(n, t // 2, 1, 32)
        low = ((nibbles >> shifts) & 0x0F).reshape(n, t, 32)
        bits = torch.arange(t, dtype=torch.uint8, device=stored.device).view(1, t, 1)
        parts.append((low | ((plane >> bits) & 1) << 4).reshape(n, 32 * t))
        at += 32 + 16 * t
    return torch.cat(parts, dim=1).to(torch.int16)


def _iq4_indices(codes: torch.Tensor) -> torch.Tensor:
    """Codes of IQ4_KVALUES -> their indices 0..15 (ValueError for any other code)."""
    table = torch.tensor(IQ4_KVALUES, dtype=torch.int16, device=codes.device)
    codes = codes.to(torch.int16)
    idx = torch.searchsorted(table, codes).clamp_(max=15)
    if not torch.equal(table[idx], codes):
        raise ValueError('"n4" codes must be values of IQ4_KVALUES')
    return idx


# MXFP4's e2m1 values, doubled to integers ("m4"; quant/mxfp4.py's table): index i's code.
# Indices 0 and 8 both stand for 0 (e2m1's ±0).
E2M1_DOUBLED = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)
_E2M1_INDEX = {v: i for i, v in reversed(list(enumerate(E2M1_DOUBLED)))}  # 0 -> index 0


def _e2m1_indices(codes: torch.Tensor) -> torch.Tensor:
    """Codes of E2M1_DOUBLED -> their indices 0..15 (ValueError for any other code)."""
    lookup = torch.full((25,), -1, dtype=torch.int16, device=codes.device)
    for value, index in _E2M1_INDEX.items():
        lookup[value + 12] = index
    codes = codes.to(torch.int16)
    if codes.numel() and (int(codes.min()) < -12 or int(codes.max()) > 12):
        raise ValueError('"m4" codes must be values of E2M1_DOUBLED')
    idx = lookup[(codes + 12).long()]
    if codes.numel() and int(idx.min()) < 0:
        raise ValueError('"m4" codes must be values of E2M1_DOUBLED')
    return idx


# K-quant kind -> (bytes of a stored 256-element super-block, where its sub-block scale bytes
# start): "q2" 2 planes of 2-bit pairs and Q2_K's 16 scale | min bytes (with d and dmin: the
# file's 84 bytes), "q3" 2 planes, 1 of third bits and Q3_K's 12 bytes of 6-bit scales (110),
# "q4k" 128 bytes of nibble pairs and Q4_K's 12 bytes of 6-bit scales and mins (with d and
# dmin: 144), "q5k" those 128, a plane of fifth bits and Q5_K's 12 bytes, as Q4_K's (176), "q6k"
# 128 of nibble pairs, 2 planes of top 2-bit pairs and Q6_K's 16 int8 scales (with d: 210),
# "n4k" 128 bytes of index pairs and IQ4_XS's 6 bytes of 6-bit scales (with d: 136).
K_QUANT_KINDS = {"q2": (80, 64), "q3": (108, 96), "q4k": (140, 128), "q5k": (172, 160)}
K_QUANT_KINDS |= {"q6k": (208, 192), "n4k": (134, 128)}
# ggml type id -> kind
K_QUANT_TYPES = {10: "q2", 11: "q3", 12: "q4k", 13: "q5k", 14: "q6k", 23: "n4k"}
# stored code = code + zero ("n4k": its indices, the table's codes once looked up)
K_QUANT_ZERO = {"q2": 0, "q3": 4, "q4k": 0, "q5k": 0, "q6k": 32, "n4k": 0}
# elements a sub-block
K_QUANT_GROUP = {"q2": 16, "q3": 16, "q4k": 32, "q5k": 32, "q6k": 16, "n4k": 32}
K_QUANT_KINDS_WITH_MIN = ("q2", "q4k", "q5k")  # their scales: d and dmin a super-block
# The kinds the packed matmul computes (csrc/qgemm.c), a row each of csrc/tokenmill.h's
# TM_LAYOUTS (kernels/cpu_library.check_layouts holds the two to each other).
PACKED_KINDS = ("q8", "q4", "u8", "n4", "q5", *K_QUANT_KINDS, "m4")
# The kinds of 4-bit indices into a table of int8 codes.
TABLE_KINDS = ("n4", "m4")
# Where the file's float16 d (and dmin) and sub-block scale bytes lie in a block of each type.
_K_QUANT_FILE = {10: ((80, 84), (0, 16)), 11: ((108, 110), (96, 108)), 12: ((0, 4), (4, 16))}
_K_QUANT_FILE |= {13: ((0, 4), (4, 16)), 14: ((208, 210), (192, 208)), 23: ((0, 2), (2, 8))}


def _pairs(c: torch.Tensor, shift: int) -> torch.Tensor:
    """Code vectors [..., 8, 32] -> 4 vectors of 32 bytes, vector 2v in the low nibbles of the
    v-th ("q4"'s pairs), of each code's bits shift..shift + 3."""
    low = ((c >> shift) & 0x0F).reshape(*c.shape[:-2], 4, 2, 32)
    return (low[..., 0, :] | low[..., 1, :] << 4).reshape(*c.shape[:-2], 128)


def _planes(c: torch.Tensor, shift: int) -> torch.Tensor:
    """Code vectors [..., 8, 32] -> 2 planes of 32 bytes: vector 4p + s's bits shift..shift + 1
    in bits 2s of plane p."""
    low = ((c >> shift) & 3).reshape(*c.shape[:-2], 2, 4, 32)
    planes = low[..., 0, :] | low[..., 1, :] << 2 | low[..., 2, :] << 4 | low[..., 3, :] << 6
    return planes.reshape(*c.shape[:-2], 64)


def _bit_plane(c: torch.Tensor, bit: int) -> torch.Tensor:
    """Code vectors [..., 8, 32] -> one 32-byte plane: vector u's bit ``bit`` in bit u."""
    plane = torch.zeros_like(c[..., 0, :])
    for u in range(8):
        plane |= ((c[..., u, :] >> bit) & 1) << u
    return plane


def _unbit_plane(b: torch.Tensor) -> torch.Tensor:
    """``_bit_plane`` undone: [..., 32] bytes -> code vectors [..., 8, 32] of one bit."""
    bits = torch.arange(8, dtype=torch.uint8, device=b.device).view(8, 1)
    return (b.unsqueeze(-2) >> bits) & 1


def pack_k_quant(codes: torch.Tensor, sub: torch.Tensor, kind: str) -> torch.Tensor:
    """Stored codes [N, K] (code + zero: "q2" 0..3, "q3" 0..7, "q4k" 0..15, "q5k" 0..31, "q6k"
    0..63; "n4k" indices 0..15) in element order and each super-block's sub-block scale bytes [N, K / 256, bytes] -> the
    kind's codes [N, K / 256 · super-block bytes]."""
    n, k = codes.shape
    c = codes[:, lane_order(k).to(codes.device)].to(torch.uint8).reshape(n, k // QK_K, 8, 32)
    if kind in ("q4k", "n4k"):
        parts = [_pairs(c, 0)]
    elif kind == "q5k":
        parts = [_pairs(c, 0), _bit_plane(c, 4)]
    elif kind == "q6k":
        parts = [_pairs(c, 0), _planes(c, 4)]
    else:
        parts = [_planes(c, 0)]
    if kind == "q3":
        parts.append(_bit_plane(c, 2))
    parts.append(sub.to(torch.uint8))
    return torch.cat(parts, dim=2).reshape(n, -1)


def _unpairs(b: torch.Tensor) -> torch.Tensor:
    """``_pairs`` undone: [..., 128] bytes -> code vectors [..., 8, 32] of 4 bits."""
    shifts = torch.tensor([0, 4], dtype=torch.uint8, device=b.device).view(2, 1)
    return ((b.reshape(*b.shape[:-1], 4, 1, 32) >> shifts) & 0x0F).reshape(*b.shape[:-1], 8, 32)


def _unplanes(b: torch.Tensor) -> torch.Tensor:
    """``_planes`` undone: [..., 64] bytes -> code vectors [..., 8, 32] of 2 bits."""
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=b.device).view(4, 1)
    return ((b.reshape(*b.shape[:-1], 2, 1, 32) >> shifts) & 3).reshape(*b.shape[:-1], 8, 32)


def unpack_k_quant(stored: torch.Tensor, kind: str, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``pack_k_quant`` undone: stored codes int16 [N, K] in element order and the sub-block
    scale bytes [N, K / 256, 16 or 12]."""
    n, num_super = stored.shape[0], k // QK_K
    sb_bytes, sub_at = K_QUANT_KINDS[kind]
    blocks = stored.reshape(n, num_super, sb_bytes)
    if kind in ("q4k", "n4k"):
        c = _unpairs(blocks[:, :, :128])
    elif kind == "q5k":
        c = _unpairs(blocks[:, :, :128]) | _unbit_plane(blocks[:, :, 128:160]) << 4
    elif kind == "q6k":
        c = _unpairs(blocks[:, :, :128]) | _unplanes(blocks[:, :, 128:192]) << 4
    else:
        c = _unplanes(blocks[:, :, :64])
    if kind == "q3":
        c = c | _unbit_plane(blocks[:, :, 64:96]) << 2
    codes = c.reshape(n, k).to(torch.int16)[:, _element_order(k, stored.device)]
    return codes, blocks[:, :, sub_at:]


def _from_k_quant_blocks(
    blocks: torch.Tensor, ggml_type: int, rows: int, cols: int
) -> PackedWeight:
    """Q2_K / Q3_K / Q4_K / Q5_K / Q6_K / IQ4_XS blocks [rows · cols / 256, bytes] of a
    [rows, cols] tensor -> their kind (K_QUANT_TYPES), the file's bytes rearranged."""
    kind = K_QUANT_TYPES[ggml_type]
    zero, num_super = K_QUANT_ZERO[kind], cols // QK_K
    codes = (BLOCK_CODES[ggml_type][2](blocks).codes + zero).reshape(rows, cols)
    if kind == "n4k":  # the file's indices, not the codes they stand for
        codes = _iq4_indices(codes)
    (d0, d1), (s0, s1) = _K_QUANT_FILE[ggml_type]
    stored = pack_k_quant(codes, blocks[:, s0:s1].reshape(rows, num_super, -1), kind)
    scales = blocks[:, d0:d1].contiguous().view(torch.float16).reshape(rows, -1)
    group = K_QUANT_GROUP[kind]
    return PackedWeight(kind, stored, scales, None, group, (rows, cols), zero)


# ggml types whose codes are 4-bit (Q4_0 signed -8..7, Q4_1 unsigned 0..15): packed two a
# byte. (The k-quants keep their super-blocks: K_QUANT_TYPES.)
FOUR_BIT_TYPES = (2, 3)
# ggml types whose 4-bit indices pick a code from a table, in blocks of 32 (IQ4_NL): "n4".
# (IQ4_XS keeps its super-blocks: "n4k".)
IQ4_TYPES = (20,)
# ggml types whose block scale is a float16 (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL): kept
# float16, exactly (Q4_1's and Q5_1's float16 mins become float32 offsets, exactly too).
FLOAT16_SCALE_TYPES = (2, 3, 6, 7, 8, 20)
# ggml types whose codes fit 5 bits, stored as code + zero: Q5_0 (-16..15), Q5_1 and Q5_K
# (0..31); "q5" (rows of a multiple of 64), else "u8" bytes.
BYTE_ZERO = {6: 16, 7: 0, 13: 0}
FIVE_BIT_TYPES = (6, 7, 13)


def from_block_codes(
    bc: BlockCodes,
    rows: int,
    cols: int,
    four_bit: bool,
    f16_scales: bool = False,
    zero: int | None = None,
    table: bool = False,
    five_bit: bool = False,
) -> PackedWeight:
    """Repack unpacked GGUF blocks of a [rows, cols] tensor (blocks in row-major order); codes
    with ``zero`` (6-bit codes) as "u8", or as "q5" with ``five_bit`` (5-bit codes, rows of a
    multiple of 64); other byte codes as "q8"; with ``table`` (IQ4) the codes, values of
    IQ4_KVALUES, as "n4"."""
    codes = bc.codes.reshape(rows, cols)
    scales = bc.scales.reshape(rows, -1).contiguous()
    offsets = None if bc.offsets is None else bc.offsets.reshape(rows, -1).contiguous()
    if table:
        scales = scales.half() if f16_scales else scales
        return PackedWeight("n4", pack_codes(codes, "n4"), scales, offsets, bc.group, (rows, cols))
    if not four_bit:
        scales = scales.half() if f16_scales else scales
        if zero is not None:
            kind = "q5" if five_bit else "u8"
            stored = pack_codes(codes, kind, zero)
            return PackedWeight(kind, stored, scales, offsets, bc.group, (rows, cols), zero)
        return PackedWeight("q8", pack_codes(codes, "q8"), scales, offsets, bc.group, (rows, cols))
    # Signed 4-bit (Q4_0): store code + 8, a zero point as "u8"'s (no offsets: the file's bytes).
    zero = 8 if offsets is None else 0
    if f16_scales:
        scales = scales.half()
    stored = pack_codes(codes + zero, "q4")
    return PackedWeight("q4", stored, scales, offsets, bc.group, (rows, cols), zero)


def pack_gguf(raw: torch.Tensor, ggml_type: int, shape: tuple[int, int]) -> PackedWeight:
    """A GGUF tensor's raw bytes (uint8) -> PackedWeight, in row chunks to bound temporaries."""
    elems, nbytes, unpack = BLOCK_CODES[ggml_type]
    rows, cols = shape
    if cols % elems:
        raise ValueError(f"row length {cols} is not a whole number of {elems}-element blocks")
    blocks = raw.reshape(rows, cols // elems * nbytes)
    chunk = max(1, (1 << 22) // cols)  # ~4M elements of int16/float temporaries at a time
    four_bit, f16_scales = ggml_type in FOUR_BIT_TYPES, ggml_type in FLOAT16_SCALE_TYPES
    zero, table = BYTE_ZERO.get(ggml_type), ggml_type in IQ4_TYPES
    five_bit = ggml_type in FIVE_BIT_TYPES and cols % 64 == 0
    out: PackedWeight | None = None
    for start, part in zip(range(0, rows, chunk), blocks.split(chunk)):
        if ggml_type in K_QUANT_TYPES:
            p = _from_k_quant_blocks(part.reshape(-1, nbytes), ggml_type, len(part), cols)
        else:
            bc = unpack(part.reshape(-1, nbytes))
            p = from_block_codes(bc, len(part), cols, four_bit, f16_scales, zero, table, five_bit)
        if out is None:  # filled in place: a list of parts and a cat held the tensor twice
            out = PackedWeight(
                p.kind,
                p.codes.new_empty((rows, p.codes.shape[1])),
                p.scales.new_empty((rows, p.scales.shape[1])),
                None if p.offsets is None else p.offsets.new_empty((rows, p.offsets.shape[1])),
                p.group,
                (rows, cols),
                p.zero,
            )
        end = start + len(part)
        out.codes[start:end] = p.codes
        out.scales[start:end] = p.scales
        if p.offsets is not None:
            out.offsets[start:end] = p.offsets
    assert out is not None  # rows >= 1
    return out


# Starting grids of the int4 search: a group's [min, max] spread over this many steps. 15
# spans the range exactly; fewer clips its extremes for finer steps, more leaves room for the
# least-squares refit (llama.cpp's k-quants search the same way, make_qkx2_quants).
INT4_SPANS = tuple(14.0 + 0.1 * i for i in range(21))


def quantize_int4(
    weight: torch.Tensor, group: int, importance: torch.Tensor | None = None
) -> PackedWeight:
    """Group-wise asymmetric int4: w ≈ s · q + lo with q in 0..15 per group of ``group``.

    For each starting grid of INT4_SPANS, codes are rounded, (s, lo) refit by least squares,
    codes rounded again to the refit grid and (s, lo) refit once more; each group keeps the
    grid with the least squared error. A group that already lies on a 16-level grid using 15 or
    16 of its levels (a dequantized Q4_K / Q4_1 weight, nearly always) is recovered exactly.
    ``importance`` [in]: a weight per input element (the mean square of its activations) for
    the squared errors, so the grid fits best where the inputs are large: an error in w_j
    reaches the output times x_j.
    """
    n, k = weight.shape
    if k % group or group % 32:
        raise ValueError(
            f"int4_group_size {group} must be a multiple of 32 dividing every weight row; "
            f"this model has rows of {k} elements (try 32)"
        )
    if importance is None:
        importance = torch.ones(k, device=weight.device)
    # A floor keeps never-active inputs (importance 0) from leaving a group's grid unfit.
    importance = importance.float() + 1e-6 * importance.float().mean().clamp_min(1e-30)
    importance = importance.reshape(1, k // group, group)
    codes = torch.empty((n, k // 2), dtype=torch.uint8, device=weight.device)
    scales = torch.empty((n, k // group), dtype=torch.float32, device=weight.device)
    offsets = torch.empty_like(scales)
    step = max(1, (1 << 16) // k)  # rows per chunk: its temporaries stay in cache
    for r in range(0, n, step):
        w = weight[r : r + step].float().reshape(-1, k // group, group)
        q, s, lo = _int4_groups(w, importance)
        codes[r : r + step] = pack_codes(q.reshape(-1, k), "q4")
        scales[r : r + step] = s.squeeze(-1)
        offsets[r : r + step] = -lo.squeeze(-1)
    return PackedWeight("q4", codes, scales, offsets, group, (n, k))


def _int4_groups(w: torch.Tensor, a: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Codes [..., group], scales and offsets [..., 1] of w [..., group] whose squared errors
    count a times each (quantize_int4)."""
    w_min, w_max = w.amin(-1, keepdim=True), w.amax(-1, keepdim=True)
    inv_range = 1.0 / (w_max - w_min).clamp_min(torch.finfo(torch.float32).tiny)
    aw = a * w
    sums = (a.sum(-1, keepdim=True), aw.sum(-1, keepdim=True), (aw * w).sum(-1, keepdim=True))
    best: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    for span in INT4_SPANS:
        q = torch.round((w - w_min) * (inv_range * span)).clamp_(0, 15)
        s, lo, _ = _fit_grid(q, a, aw, sums)
        s, lo, err = _fit_grid(_round_to_grid(w, s, lo), a, aw, sums)
        if best is None:
            best = (err, s, lo)
            continue
        better = err < best[0]
        best = tuple(torch.where(better, new, old) for new, old in zip((err, s, lo), best))
    _, s, lo = best
    s = s.clamp_min(0)
    return _round_to_grid(w, s, lo), s, lo


def _fit_grid(
    q: torch.Tensor, a: torch.Tensor, aw: torch.Tensor, sums: tuple[torch.Tensor, ...]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Weighted least-squares (s, lo) of w ≈ s·q + lo for fixed codes q, per group (the last
    dim), and its error Σ a (s·q + lo - w)², from sums (no pass over w)."""
    sum_a, sum_aw, sum_aww = sums
    aq = a * q
    sum_aq, sum_aqq, sum_aqw = aq.sum(-1, True), (aq * q).sum(-1, True), (q * aw).sum(-1, True)
    det = sum_a * sum_aqq - sum_aq * sum_aq
    flat = det <= 0  # every code equal: the group is one level, its (weighted) mean
    det = torch.where(flat, torch.ones_like(det), det)
    s = torch.where(flat, torch.zeros_like(det), (sum_a * sum_aqw - sum_aq * sum_aw) / det)
    lo = torch.where(flat, sum_aw / sum_a, (sum_aqq * sum_aw - sum_aq * sum_aqw) / det)
    err = (
        sum_aww
        - 2 * s * sum_aqw
        - 2 * lo * sum_aw
        + s * s * sum_aqq
        + 2 * s * lo * sum_aq
        + lo * lo * sum_a
    )
    return s, lo, err


def _round_to_grid(w: torch.Tensor, s: torch.Tensor, lo: torch.Tensor) -> torch.Tensor:
    """The nearest code 0..15 of each w on the grid s·q + lo (0 where s <= 0: w is lo)."""
    positive = s > 0
    q = torch.round((w - lo) / torch.where(positive, s, torch.ones_like(s))).clamp_(0, 15)
    return q.mul_(positive)


def activation_levels(w: PackedWeight, q8_unsigned: bool) -> int:
    """The largest int8 activation code the kernel's int8 mode uses against ``w``: 64 for "q8"
    (and "n4", whose table codes run as "q8") weights run unsigned (codes + 128, no sign flip
    per product; csrc/qgemm.c), else 127."""
    return 64 if q8_unsigned and w.kind in ("q8", *TABLE_KINDS) else 127


def quantize_activations(x: torch.Tensor, levels: int = 127) -> tuple[torch.Tensor, torch.Tensor]:
    """Each 32-element chunk of x [M, K] -> int8 codes in [-levels, levels] and a scale (the
    kernel's int8 mode)."""
    m, k = x.shape
    chunks = x.float().reshape(m, k // 32, 32)
    amax = chunks.abs().amax(dim=-1)
    inv = torch.where(amax > 0, levels / amax, torch.zeros_like(amax))
    q = torch.round(chunks * inv[:, :, None])
    return q.reshape(m, k), amax / levels


def reference_matmul(
    x: torch.Tensor,
    w: PackedWeight,
    bias: torch.Tensor | None,
    act_int8: bool,
    q8_unsigned: bool = False,
) -> torch.Tensor:
    """y = x Wᵀ + b in float32, as the kernel computes it (incl. its int8 activations).

    The int8 mode is emulated in float (exact integer sums, then the chunk scales), for tests;
    without the kernel the model runs the float mode, which is a plain tiled matmul.
    """
    x = x.float()
    m, k = x.shape
    # halves and fp8 always meet float activations
    act_int8 = act_int8 and w.kind not in HALF_KINDS and w.kind != "f8"
    tile = max(1, (1 << 24) // k)  # bound the float weight tile (~16M elements)
    out = torch.empty(m, w.shape[0], dtype=torch.float32, device=x.device)
    if act_int8:
        xq, xd = quantize_activations(x, activation_levels(w, q8_unsigned))
        xq = xq.reshape(m, k // 32, 32)
        sums = x.reshape(m, -1, w.group).sum(-1)
    for r in range(0, w.shape[0], tile):
        rows = slice(r, r + tile)
        if not act_int8:
            out[:, rows] = x @ w.dequantize(rows).T
            continue
        codes = w.codes_int(rows).float()
        n = codes.shape[0]
        scales, offsets = w.group_scales(rows)
        scaled = (scales[:, :, None] * codes.reshape(n, -1, w.group)).reshape(n, k // 32, 32)
        y = (torch.einsum("mcj,ncj->mnc", xq, scaled) * xd[:, None, :]).sum(-1)
        if offsets is not None:
            y = y - sums @ offsets.T
        out[:, rows] = y
    if bias is not None:
        out += bias.float()
    return out


@dataclass(slots=True)
class GGUFBlocks:
    """A GGUF weight's raw blocks before packing, for a tensor-parallel rank to cut its shard
    from: rows split anywhere, columns (a row-parallel layer's K) only on block boundaries.
    ``pack`` then packs the shard alone, in its own lane order."""

    raw: torch.Tensor  # uint8 [N, K // block elements * block bytes], a view of the file
    ggml_type: int
    shape: tuple[int, int]  # (N, K)

    @property
    def block_elems(self) -> int:
        return 1 if self.ggml_type in HALF_GGML_TYPES else BLOCK_CODES[self.ggml_type][0]

    def select_rows(self, index: torch.Tensor) -> GGUFBlocks:
        return GGUFBlocks(self.raw[index], self.ggml_type, (len(index), self.shape[1]))

    def split_rows(self, sizes: list[int]) -> list[GGUFBlocks]:
        """Consecutive blocks of ``sizes`` rows (as PackedWeight.split_rows)."""
        starts = [sum(sizes[:i]) for i in range(len(sizes))]
        return [GGUFBlocks(self.raw[a : a + n], self.ggml_type, (n, self.shape[1]))
                for a, n in zip(starts, sizes)]  # fmt: skip

    def shard(self, dim: int, idx: int, count: int) -> GGUFBlocks:
        """Slice ``idx`` of ``count`` equal slices along ``dim`` (ValueError where they do not
        divide, or a column slice would cut a block)."""
        rows, cols = self.shape
        if dim == 0:
            if rows % count:
                raise ValueError(
                    f"(packed) has {rows} rows, which do not split into {count} shards"
                )
            size = rows // count
            return GGUFBlocks(self.raw[idx * size : (idx + 1) * size], self.ggml_type, (size, cols))
        elems = self.block_elems
        if cols % count or (cols // count) % elems:
            raise ValueError(
                f"(packed) rows of {cols} elements do not split into {count} shards on block "
                f"boundaries ({elems}-element blocks)"
            )
        size = cols // count
        per_block = self.raw.shape[1] // (cols // elems)  # bytes of one block
        start, width = idx * size // elems * per_block, size // elems * per_block
        return GGUFBlocks(self.raw[:, start : start + width], self.ggml_type, (rows, size))

    def pack(self) -> PackedWeight:
        raw = self.raw.contiguous().reshape(-1)
        if self.ggml_type in HALF_GGML_TYPES:
            return pack_half(raw, self.ggml_type, self.shape)
        return pack_gguf(raw, self.ggml_type, self.shape)
