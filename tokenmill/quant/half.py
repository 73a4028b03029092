"""Float checkpoints kept as 16-bit halves: a bf16 / fp16 safetensors checkpoint's matmul
weights stay as stored (2 bytes a weight, not float32's 4) and run on the packed kernel's half
path (csrc/half.c widens them to float32 as it reads them), as a GGUF's F16 / BF16 tensors do.

Lossless for a checkpoint stored in that dtype: the values are the file's; only the float32
sums' order differs from a float32 matmul. Activations stay float32 (no int8 path for halves).
"""

from __future__ import annotations

import torch

from tokenmill.config import ModelConfig
from tokenmill.modelfile import safetensors_tensors
from tokenmill.quant.gguf import PackedQuantMethod, PackedState
from tokenmill.quant.packed import HALF_KINDS, PackedWeight

# safetensors dtype names -> the half kind that keeps them exactly
SAFETENSORS_HALF_KINDS = {"BF16": "bf16", "F16": "f16"}


def stored_half_kind(config: ModelConfig) -> str | None:
    """The half kind that keeps a Hugging Face checkpoint's matrices exactly ("bf16" / "f16"),
    or None when they are not all stored in one 16-bit float dtype (float32, mixed, a GGUF)."""
    if config.source is None or config.source.format != "hf":
        return None
    dtypes = {
        dtype for _, _, shape, dtype in safetensors_tensors(config.source.path) if len(shape) == 2
    }
    if len(dtypes) != 1:
        return None
    return SAFETENSORS_HALF_KINDS.get(dtypes.pop())


class HalfQuantMethod(PackedQuantMethod):
    """``--quantization half``: each Linear (and a tied embedding) packed as ``kind`` halves."""

    name = "half"

    def __init__(self, kind: str = "bf16") -> None:
        if kind not in HALF_KINDS:
            raise ValueError(f"half kind must be one of {', '.join(HALF_KINDS)}; got {kind!r}")
        super().__init__(act_int8=False)
        self.kind = kind

    def quantize(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        importance: torch.Tensor | None = None,
    ) -> PackedState:
        n, k = weight.shape
        codes = weight.to(HALF_KINDS[self.kind]).contiguous().view(torch.int16)
        scales = torch.empty(n, 0, dtype=torch.float32, device=weight.device)
        packed = PackedWeight(self.kind, codes, scales, None, k, (n, k))
        return PackedState(packed, None if bias is None else bias.float().contiguous())
