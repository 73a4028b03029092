"""TorchKernelBackend: every op in plain torch, no C call. It runs on any device and dtype, and is
the readable twin and test oracle of each fast kernel."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from tokenmill.kernels.base import KernelBackend
from tokenmill.quant.packed import reference_matmul

if TYPE_CHECKING:
    from tokenmill.quant.packed import PackedWeight

# Byte value -> its 8 bits as flags: a bitmask row is unpacked by one gather of its bytes.
_BYTE_BITS = ((torch.arange(256)[:, None] >> torch.arange(8)) & 1).bool()  # [256, 8]


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


# The gated activations by the names the backends take (layers/activation.py maps Hugging
# Face's names onto these).
ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_tanh": _gelu_tanh,
}


class TorchKernelBackend(KernelBackend):
    name = "torch"

    def rmsnorm(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        weight_offset: float,
        eps: float,
        residual: torch.Tensor | None = None,
    ) -> torch.Tensor:
        # Computed in float32 as the reference implementations do, whatever the model dtype.
        gain = weight.float() + weight_offset
        y = F.rms_norm(x.float(), (x.shape[-1],), gain, eps).to(x.dtype)
        return y if residual is None else residual + y

    def rotary(
        self,
        positions: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        cos = cos[positions].unsqueeze(1)  # [num_tokens, 1, head_dim / 2]
        sin = sin[positions].unsqueeze(1)
        return _rotate(q, cos, sin), _rotate(k, cos, sin)

    def act_and_mul(self, gate_up: torch.Tensor, act: str) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return ACTIVATIONS[act](gate) * up

    def add(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return x + y

    def embedding(
        self, table: torch.Tensor, ids: torch.Tensor, scale: float | None
    ) -> torch.Tensor:
        h = F.embedding(ids, table)
        # NOTE: HF multiplies by the scale cast to the model dtype; do the same for parity.
        return h if scale is None else h * torch.tensor(scale, dtype=h.dtype)

    def packed_matmul(
        self,
        x: torch.Tensor,
        w: PackedWeight,
        bias: torch.Tensor | None,
        act_int8: bool,
        out: torch.Tensor | None = None,
        q8_unsigned: bool = False,
    ) -> torch.Tensor:
        # Float activations whatever ``act_int8`` says: the int8 mode's emulation in torch
        # (reference_matmul's act_int8) is exact to the kernel but slow, for tests only.
        return reference_matmul(x, w, bias, act_int8=False)

    def packed_embedding(
        self, w: PackedWeight, ids: torch.Tensor, scale: float | None
    ) -> torch.Tensor:
        h = w.dequantize(ids.reshape(-1)).reshape(*ids.shape, -1)
        return h if scale is None else h * torch.tensor(scale, dtype=h.dtype)

    def argmax(self, x: torch.Tensor) -> torch.Tensor:
        return x.argmax(dim=-1)

    def apply_token_bitmask_(
        self, logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]
    ) -> None:
        # torch.where over the unpacked mask (~0.5 ms a 262k row; masked_fill_ took ~9 ms).
        vocab = logits.shape[-1]
        for row in rows:  # little endian: byte b of word w holds tokens 32 w + 8 b ..
            allowed = _BYTE_BITS[bitmask[row].view(torch.uint8).long()].view(-1)[:vocab]
            out = logits[row]
            torch.where(allowed.to(out.device), out, out.new_tensor(float("-inf")), out=out)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.float().chunk(2, dim=-1)
    out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return out.to(x.dtype)
