"""TorchKernelBackend: every op in plain torch, no C call. It runs on any device and dtype, and is
the readable twin and test oracle of each fast kernel."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from tokenmill.kernels.base import KernelBackend
from tokenmill.quant.fp8 import FP8_KIND, fp8_matmul
from tokenmill.quant.packed import PackedWeight, reference_matmul

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
        if w.kind == FP8_KIND:  # fp8 checkpoints: torch._scaled_mm on CUDA (quant/fp8.py)
            return fp8_matmul(x, w, bias)
        # Float activations whatever ``act_int8`` says: the int8 mode's emulation in torch
        # (reference_matmul's act_int8) is exact to the kernel but slow, for tests only.
        return reference_matmul(x, w, bias, act_int8=False)

    def packed_embedding(
        self, w: PackedWeight, ids: torch.Tensor, scale: float | None
    ) -> torch.Tensor:
        h = w.dequantize(ids.reshape(-1)).reshape(*ids.shape, -1)
        return h if scale is None else h * torch.tensor(scale, dtype=h.dtype)

    def moe_route(
        self, x: torch.Tensor, router: torch.Tensor, top_k: int, renormalize: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        probs = torch.softmax(F.linear(x.float(), router.float()), dim=-1)
        # A stable sort, not torch.topk: topk does not break ties to the lower index on CPU.
        weights, ids = probs.sort(dim=-1, descending=True, stable=True)
        weights, ids = weights[..., :top_k].contiguous(), ids[..., :top_k].contiguous()
        if renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, ids

    def moe_experts(
        self,
        x: torch.Tensor,
        weights: torch.Tensor,
        ids: torch.Tensor,
        gate_up: PackedWeight,
        down: PackedWeight,
        act: str,
        act_int8: bool,
        counts: torch.Tensor | None = None,
        shared: torch.Tensor | None = None,
        shared_gate: torch.Tensor | None = None,
    ) -> torch.Tensor:
        hidden, inter = x.shape[1], down.shape[1]
        num_experts = down.shape[0] // hidden

        def expert(e: int, xs: torch.Tensor) -> torch.Tensor:
            gu = self.packed_matmul(xs, expert_rows(gate_up, e, 2 * inter), None, act_int8)
            h = self.act_and_mul(gu, act)
            return self.packed_matmul(h, expert_rows(down, e, hidden), None, act_int8)

        y = grouped_experts(x.float(), weights, ids, num_experts, expert, counts)
        if shared is not None:
            gate = torch.sigmoid(x.float() @ shared_gate.float())
            y = y + gate[:, None] * shared.float()
        return y

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


def expert_rows(w: PackedWeight, expert: int, rows: int) -> PackedWeight:
    """Expert ``expert``'s ``rows`` rows of a stacked packed weight: views, no copy."""
    part = slice(expert * rows, (expert + 1) * rows)
    offsets = None if w.offsets is None else w.offsets[part]
    return PackedWeight(
        w.kind, w.codes[part], w.scales[part], offsets, w.group, (rows, w.shape[1]), w.zero
    )


def grouped_experts(
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    num_experts: int,
    expert: Callable[[int, torch.Tensor], torch.Tensor],
    counts: torch.Tensor | None = None,
) -> torch.Tensor:
    """Σ_j weights[t, j] · expert(ids[t, j], x_t) over x [T, H]: the (token, choice) pairs are
    sorted by expert, each expert that any token chose runs once on its tokens' rows
    (``expert(e, rows)``), and the weighted outputs are added back to their tokens. A Python loop
    over the active experts, never over tokens."""
    flat = ids.reshape(-1)
    per_expert = torch.bincount(flat, minlength=num_experts)
    if counts is not None:
        counts += per_expert
    order = torch.argsort(flat, stable=True)
    tokens = order // ids.shape[1]
    rows = x[tokens]
    outputs = torch.empty_like(rows)
    start = 0
    for e, n in enumerate(per_expert.tolist()):
        if n:
            outputs[start : start + n] = expert(e, rows[start : start + n])
            start += n
    outputs *= weights.reshape(-1)[order, None].to(outputs.dtype)
    return torch.zeros_like(x).index_add_(0, tokens, outputs)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.float().chunk(2, dim=-1)
    out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return out.to(x.dtype)
