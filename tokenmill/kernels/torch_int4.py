"""torch's own int4 weight-only matmul (``torch._weight_int4pack_mm``, "tinygemm") for the
"q4" weights of a CUDA model (``--quantization int4``).

Why: on an H200 it beat the Triton dequant-matmul (kernels/triton/quant_matmul.py) 1.5-4.5x at
256 rows on gemma-3-270m's projections: gate/up 60 vs 94 us, down 30 vs 134, o 17 vs 72
(benchmarks/gpu_quant_matmul.py, benchmarks/results/h200-2026-12-04-async/quant_matmul.json).

Its layout: codes q in 0..15, tiled by torch for its tensor cores (``_convert_weight_to_int4pack``
of the codes two a byte, the even element in the high nibble; CUDA only), and a bfloat16 scale
and zero per group, [K / G, N, 2], with w = (q - 8) · scale + zero. tokenmill's "q4" holds
w = scale · q - offset, so the same weight has zero = 8 · scale - offset. The kernel takes
bfloat16 activations only: a float32 model's are rounded to bfloat16 on the way in.

A weight converted at load (``convert``) is checked there against the "q4" weight it came from
(random rows through both, on its first 256 output channels: the tiling is the same for every
group of channels); one that disagrees (a torch whose layout is not the one above) keeps the
Triton kernel, with a warning, rather than compute wrong answers.
"""

from __future__ import annotations

import logging

import torch

from tokenmill.quant.packed import TORCH_INT4_KIND, PackedWeight

logger = logging.getLogger(__name__)

GROUPS = (32, 64, 128, 256)  # the group sizes the kernel takes
# How far the kernel's output may sit from the float reference on the load-time check, as a
# fraction of the reference's largest value: bfloat16 activations, scales and zeros round at
# ~0.4% each; a wrong layout is off by the whole output.
_CHECK_TOLERANCE = 0.03


def inner_k_tiles(k: int) -> int | None:
    """The kernel's tiles along K for rows of ``k`` (K must be a multiple of 16 · tiles): the
    largest of 8, 4, 2 that divides, None when none does."""
    return next((t for t in (8, 4, 2) if k % (16 * t) == 0), None)


def takes(w: PackedWeight) -> bool:
    """Whether the kernel can compute this packed weight."""
    n, k = w.shape
    if w.kind != "q4" or w.zero or w.group not in GROUPS:  # GGUF Q4_0's zero point: not read
        return False
    return n % 8 == 0 and inner_k_tiles(k) is not None


def operands(w: PackedWeight) -> tuple[torch.Tensor, torch.Tensor]:
    """A "q4" weight as the kernel's inputs before tiling: codes int32 [N, K] in element order,
    and the bfloat16 scales and zeros [K / G, N, 2]."""
    scales, offsets = w.group_scales()
    zeros = 8 * scales - (offsets if offsets is not None else 0)
    scales_and_zeros = torch.stack([scales, zeros], dim=-1).transpose(0, 1).contiguous()
    return w.codes_int().to(torch.int32), scales_and_zeros.to(torch.bfloat16)


def convert(w: PackedWeight) -> PackedWeight | None:
    """The weight in torch's int4 layout on its CUDA device (kind TORCH_INT4_KIND: ``codes``
    torch's tiles, ``scales`` the scales and zeros); None when the kernel does not take it or
    its output disagrees with the "q4" weight's (see the module docstring)."""
    if not takes(w) or w.codes.device.type != "cuda":
        return None
    device = w.codes.device
    codes, scales_and_zeros = operands(w)
    nibbles = (codes[:, ::2] << 4 | codes[:, 1::2]).to(torch.uint8)
    try:
        tiles = torch._convert_weight_to_int4pack(nibbles, inner_k_tiles(w.shape[1]))
        converted = PackedWeight(TORCH_INT4_KIND, tiles, scales_and_zeros, None, w.group, w.shape)
        # The check: 4 random rows through both, against the first 256 output channels.
        probe = torch.randn(4, w.shape[1], device=device, generator=_generator(device))
        rows = slice(0, min(w.shape[0], 256))
        want = probe @ w.dequantize(rows).T
        got = matmul(probe, converted)[:, rows]
    except RuntimeError as e:  # a torch whose kernel takes other shapes or dtypes
        logger.warning("torch's int4 kernel refused a q4 weight %s: %s", tuple(w.shape), e)
        return None
    error = float((got - want).abs().max() / want.abs().max().clamp_min(1e-30))
    if not error <= _CHECK_TOLERANCE:
        logger.warning(
            "torch's int4 kernel disagrees with the q4 weight %s (relative error %.3g): it "
            "keeps the Triton kernel",
            tuple(w.shape),
            error,
        )
        return None
    return converted


def _generator(device: torch.device) -> torch.Generator:
    generator = torch.Generator(device=device)
    generator.manual_seed(0)
    return generator


def matmul(
    x: torch.Tensor,
    w: PackedWeight,
    bias: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """y = x Wᵀ + b in float32 [rows, N] for a weight ``convert`` made."""
    y = torch._weight_int4pack_mm(x.to(torch.bfloat16), w.codes, w.group, w.scales)
    if out is None:
        out = y.float()
    else:
        out.copy_(y)
    return out if bias is None else out.add_(bias)
