"""fp8 weights (e4m3, a byte a weight), as Hugging Face fp8 checkpoints store them: each matrix's
``weight`` in float8_e4m3fn with its float32 scale, per tensor, per output channel
(``weight_scale`` [N] or [N, 1]) or per block (``weight_scale_inv`` [⌈N/bn⌉, ⌈K/bk⌉], with the
config's ``weight_block_size`` [bn, bk], as DeepSeek's and Qwen's are).

    W[n, k] = float(code[n, k]) · scale(n, k)

They stay a byte a weight (a PackedWeight of kind "f8": the codes, and a float32 scale per row
and group of ``group`` inputs). On a CUDA device with per-channel scales the matmul runs through
``torch._scaled_mm`` with x quantized to e4m3 per row as it comes (vLLM's dynamic scheme);
elsewhere (and on the CPU) the reference: the rows dequantized to float32 and multiplied,
exactly the checkpoint's values. ``fp8_matmul(..., scaled=True)`` runs the first on any device
(torch's CPU has it too), which is how CI tests it.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from tokenmill.quant.gguf import PackedQuantMethod, PackedState
from tokenmill.quant.packed import PackedWeight

FP8_KIND = "f8"
E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0


def pack_fp8(
    weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None = None
) -> PackedWeight:
    """A checkpoint's fp8 matrix [N, K] and its scale as an "f8" PackedWeight; ``block``: the
    [bn, bk] of a block-scaled checkpoint (its scale [⌈N/bn⌉, ⌈K/bk⌉])."""
    if weight.dtype != E4M3 or weight.dim() != 2:
        raise ValueError(f"an fp8 weight is float8_e4m3fn [N, K]; got {weight.dtype} "
                         f"{tuple(weight.shape)}")  # fmt: skip
    n, k = weight.shape
    scale = scale.float()
    if block is not None:
        bn, bk = block
        if scale.shape != (-(-n // bn), -(-k // bk)) or k % bk:
            raise ValueError(f"a block-scaled fp8 weight {n}x{k} in {bn}x{bk} blocks needs a "
                             f"scale of {-(-n // bn)}x{k // bk}; got {tuple(scale.shape)}")  # fmt: skip
        scales, group = scale.repeat_interleave(bn, dim=0)[:n], bk
    elif scale.numel() == 1:
        scales, group = scale.reshape(1, 1).expand(n, 1), k
    elif scale.numel() == n:
        scales, group = scale.reshape(n, 1), k
    else:
        raise ValueError(f"an fp8 weight {n}x{k} needs a scale per tensor or per row; got "
                         f"{tuple(scale.shape)}")  # fmt: skip
    codes = weight.contiguous().view(torch.uint8)
    return PackedWeight(FP8_KIND, codes, scales.contiguous(), None, group, (n, k))


def fp8_matmul(
    x: torch.Tensor, w: PackedWeight, bias: torch.Tensor | None, scaled: bool | None = None
) -> torch.Tensor:
    """y = x Wᵀ + b in float32. ``scaled``: through ``torch._scaled_mm`` with x quantized to e4m3
    per row (None: on CUDA where the scales allow it: one per row)."""
    n, k = w.shape
    if scaled is None:  # CUDA's fp8 matmul: a scale a row, and dimensions in 16s
        scaled = x.device.type == "cuda" and w.group == k and n % 16 == 0 and k % 16 == 0
    if not scaled:
        y = x.float() @ w.dequantize().T
        return y if bias is None else y + bias.float()
    x = x.float()
    amax = x.abs().amax(dim=1, keepdim=True).clamp(min=1e-12)
    x_scale = amax / E4M3_MAX
    xq = (x / x_scale).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)
    # CUDA's row-scaled fp8 matmul writes bfloat16 only; torch's CPU one takes float32 too.
    out_dtype = torch.bfloat16 if x.device.type == "cuda" else torch.float32
    y = torch._scaled_mm(
        xq, w.codes.view(E4M3).T, scale_a=x_scale, scale_b=w.scales.reshape(1, -1).float(),
        out_dtype=out_dtype,
    ).float()  # fmt: skip
    return y if bias is None else y + bias.float()


class Fp8QuantMethod(PackedQuantMethod):
    """``--quantization fp8``: an fp8 checkpoint's matrices kept as stored (a byte a weight)."""

    name = "fp8"

    def __init__(self) -> None:
        super().__init__(act_int8=False)

    def quantize(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        importance: torch.Tensor | None = None,
    ) -> PackedState:
        raise ValueError("fp8 keeps an fp8 checkpoint's weights as stored; a float checkpoint "
                         "is quantized by int8 or int4")  # fmt: skip


def fp8_tensors(
    tensors: Iterator[tuple[str, torch.Tensor]],
    block: tuple[int, int] | None,
    packed: bool,
) -> Iterator[tuple[str, torch.Tensor | PackedWeight]]:
    """A checkpoint's tensors with each fp8 ``weight`` paired with its scale: as an "f8"
    PackedWeight (``packed``), else dequantized to float32. Static activation scales
    (``input_scale``) are dropped: activations are scaled as they come."""
    held: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in tensors:
        prefix, _, leaf = name.rpartition(".")
        if leaf == "input_scale":
            continue
        if leaf in ("weight_scale", "weight_scale_inv") or (
            leaf == "weight" and tensor.dtype == E4M3
        ):
            pair = held.setdefault(prefix, {})
            pair["weight" if leaf == "weight" else "scale"] = tensor
            if len(pair) < 2:
                continue
            del held[prefix]
            w = pack_fp8(pair["weight"], pair["scale"], block)
            yield f"{prefix}.weight", w if packed else w.dequantize()
            continue
        yield name, tensor
    if held:
        raise ValueError(f"fp8 weights without their scale (or scales without a weight): "
                         f"{', '.join(sorted(held)[:4])}")  # fmt: skip
