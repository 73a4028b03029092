"""gpt-oss (OpenAI, 2025): a mixture-of-experts decoder on Llama's pre-norm block.

    h = x + Attn(RMSNorm(x));  out = h + MoE(RMSNorm(h))
    MoE(h) = Σ_{e ∈ top-k(h Rᵀ + b)} softmax_top-k(h Rᵀ + b)_e · Expert_e(h)
    Expert_e(h) = W_down GLU(W_gate h + b_gate, W_up h + b_up) + b_down
    GLU(g, u) = g · σ(1.702 · g) · (u + 1),  with g ≤ limit and |u| ≤ limit

Attention: q/k/v and output projections with biases; every head has a learned sink logit that
joins its softmax (weight that goes nowhere: the torch backend's explicit attention computes
it); local (128-token window) and global layers alternate; YaRN-scaled RoPE.

Each chosen expert runs once on its tokens (as transformers does). Their weights are kept as
the checkpoint holds them: float, or MXFP4 (quant/mxfp4.py; the released checkpoints and
llama.cpp's GGUFs). On a CPU, MXFP4 experts are laid out once loaded (``pack_``) in the packed
kernels' "m4" layout, exactly, at about the file's bytes, and run on the packed C kernels; elsewhere they are dequantized in torch an
expert at a time as a step chooses it. Each
checkpoint layout is translated here into one: per expert, gate and up [I, H] and down [H, I]
(rows are outputs). Hugging Face stores gate and up interleaved (``gate_up_proj``: the even
columns gate, the odd up; its float tensors transposed, [E, H, 2I]); llama.cpp apart.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.config import ModelConfig
from tokenmill.kernels.base import KernelBackend
from tokenmill.kernels.torch_backend import TorchKernelBackend, expert_rows
from tokenmill.models.llama import LlamaForCausalLM
from tokenmill.quant.mxfp4 import BLOCK, Mxfp4Weight, to_packed
from tokenmill.quant.packed import PackedWeight

Weight = torch.Tensor | Mxfp4Weight

SWIGLU_ALPHA = 1.702


class GptOssRouter(nn.Module):
    """The router: logits h Rᵀ + b, the top k, softmax over them."""

    def __init__(self, num_experts: int, hidden_size: int, top_k: int) -> None:
        super().__init__()
        self.top_k = top_k
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(num_experts), requires_grad=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = F.linear(x, self.weight, self.bias)
        top, ids = torch.topk(logits, self.top_k, dim=-1)
        return torch.softmax(top, dim=-1), ids  # [tokens, k] weights and expert ids


class GptOssExperts(nn.Module):
    """The experts' weights, per expert: gate, up [E, I, H] and down [E, H, I], float
    (``*_weight``) or MXFP4 (``*_scales`` and ``*_codes``), and their biases."""

    def __init__(self, num: int, hidden: int, width: int, limit: float, mxfp4: bool) -> None:
        super().__init__()
        self.limit = limit
        self.mxfp4 = mxfp4
        self.width = width
        self.rows = {"gate": width, "up": width, "down": hidden}  # per expert
        # MXFP4 laid out for the packed kernels (``pack_``): "gate_up" [E·2I, H] (each expert's
        # gate rows then its up rows: one matmul) and "down" [E·H, I].
        self.packed: dict[str, PackedWeight] = {}
        self.act_int8 = False  # the packed matmuls' activations (the load's packed method's)
        self.kernels: KernelBackend = TorchKernelBackend()  # bound at load
        shapes = {"gate": (num, width, hidden), "up": (num, width, hidden),
                  "down": (num, hidden, width)}  # fmt: skip
        for name, (e, n, k) in shapes.items():
            if mxfp4:
                self._add(f"{name}_scales", (e, n, k // BLOCK), torch.uint8)
                self._add(f"{name}_codes", (e, n, k // BLOCK, BLOCK // 2), torch.uint8)
            else:
                self._add(f"{name}_weight", (e, n, k))
            self._add(f"{name}_bias", (e, n))

    def _add(self, name: str, shape: tuple[int, ...], dtype: torch.dtype | None = None) -> None:
        """A parameter of ``dtype`` (None: the model's, as it is built)."""
        setattr(self, name, nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False))

    def pack_(self, act_int8: bool) -> None:
        """The MXFP4 stacks as packed weights (quant/mxfp4.py: to_packed), their bytes
        dropped: the packed kernels compute each chosen expert."""
        if not self.mxfp4:
            return
        widths = [getattr(self, f"{n}_scales").shape[-1] * BLOCK for n in self.rows]
        if any(k % 64 for k in widths):  # the kernels' lane order: rows in 64s
            return
        stacks = {n: Mxfp4Weight(getattr(self, f"{n}_scales").data,
                                 getattr(self, f"{n}_codes").data) for n in self.rows}  # fmt: skip
        gate, up = stacks["gate"], stacks["up"]
        gate_up = Mxfp4Weight(torch.cat([gate.scales, up.scales], 1),
                              torch.cat([gate.codes, up.codes], 1))  # fmt: skip
        self.packed = {"gate_up": to_packed(gate_up), "down": to_packed(stacks["down"])}
        for name in self.rows:
            delattr(self, f"{name}_scales")
            delattr(self, f"{name}_codes")
        self.act_int8 = act_int8

    def packed_nbytes(self) -> int:
        return sum(w.nbytes for w in self.packed.values())

    def packed_numel(self) -> int:
        return sum(w.shape[0] * w.shape[1] for w in self.packed.values())

    def linear(self, name: str, expert: int, x: torch.Tensor) -> torch.Tensor:
        """x · W_{name, expert}ᵀ + b_{name, expert}."""
        bias = getattr(self, f"{name}_bias")[expert]
        if self.packed:
            w = expert_rows(self.packed[name], expert, self.rows[name])
            return self.kernels.packed_matmul(x, w, None, self.act_int8).to(x.dtype) + bias
        return F.linear(x, self.weight(name, expert, x.dtype), bias)

    def gate_and_up(self, expert: int, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The gate's and up's outputs with their biases (packed: from one matmul)."""
        if not self.packed:
            return self.linear("gate", expert, x), self.linear("up", expert, x)
        w = expert_rows(self.packed["gate_up"], expert, 2 * self.width)
        both = self.kernels.packed_matmul(x, w, None, self.act_int8).to(x.dtype)
        gate, up = both.split(self.width, dim=-1)
        return gate + self.gate_bias[expert], up + self.up_bias[expert]

    def weight(self, name: str, expert: int, dtype: torch.dtype) -> torch.Tensor:
        """One expert's matrix [rows, K] in ``dtype``."""
        if not self.mxfp4:
            return getattr(self, f"{name}_weight")[expert]
        scales, codes = getattr(self, f"{name}_scales"), getattr(self, f"{name}_codes")
        return Mxfp4Weight(scales[expert], codes[expert]).dequantize(dtype)

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(x)
        for expert in ids.unique().tolist():  # each chosen expert once, on its tokens' rows
            tokens, slot = torch.where(ids == expert)
            h = x[tokens]
            gate, up = self.gate_and_up(expert, h)
            gate, up = gate.clamp(max=self.limit), up.clamp(-self.limit, self.limit)
            glu = gate * torch.sigmoid(gate * SWIGLU_ALPHA) * (up + 1)
            y = self.linear("down", expert, glu)
            out.index_add_(0, tokens, y * weights[tokens, slot, None])
        return out


class GptOssMoE(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        moe = config.moe
        assert moe is not None and moe.swiglu_limit is not None
        self.router = GptOssRouter(moe.num_experts, config.hidden_size, moe.top_k)
        self.experts = GptOssExperts(
            moe.num_experts, config.hidden_size, moe.intermediate_size, moe.swiglu_limit,
            moe.expert_format == "mxfp4",
        )  # fmt: skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.router(x)
        return self.experts(x, weights, ids)


class GptOssForCausalLM(LlamaForCausalLM):
    def make_mlp(self, layer_idx: int) -> nn.Module | None:
        return GptOssMoE(self.config)

    def checkpoint_tensors(
        self, weights: Iterable[tuple[str, Weight]]
    ) -> Iterator[tuple[str, Weight]]:
        return _one_layout(weights)

    def after_load(self, device: torch.device, quant_method: object | None) -> None:
        """On a CPU, MXFP4 experts laid out for the packed C kernels (exactly), activations as
        the load's packed method quantizes them (float without one)."""
        if device.type != "cpu":
            return
        act_int8 = bool(getattr(quant_method, "act_int8", False))
        for module in self.modules():
            if isinstance(module, GptOssExperts):
                module.pack_(act_int8)


def _one_layout(weights: Iterable[tuple[str, Weight]]) -> Iterator[tuple[str, Weight]]:
    """The checkpoint's tensors by the names and layout of the modules here."""
    pending: dict[str, dict[str, torch.Tensor]] = {}  # MXFP4 blocks waiting for their scales
    for name, w in weights:
        prefix, _, leaf = name.rpartition(".")
        if prefix.endswith(".mlp.gate"):  # llama.cpp's name of the router
            yield prefix.removesuffix("gate") + f"router.{leaf}", w
        elif name.endswith(".self_attn.sinks.weight"):  # llama.cpp's name of the sinks
            yield prefix, w
        elif prefix.endswith(".mlp.experts") and leaf.endswith(("_blocks", "_scales")):
            key, _, part = leaf.rpartition("_")
            pair = pending.setdefault(f"{prefix}.{key}", {})
            pair[part] = w
            if len(pair) == 2:
                del pending[f"{prefix}.{key}"]
                packed = Mxfp4Weight.from_hf(pair["blocks"], pair["scales"])
                yield from _experts(prefix, key, packed)
        elif prefix.endswith(".mlp.experts"):  # Hugging Face's float tensors and biases
            yield from _experts(prefix, leaf, w)
        elif ".mlp.experts." in name:  # llama.cpp's: gate_proj.weight, gate_proj.bias, ...
            experts, _, part = prefix.rpartition(".")
            part = part.removesuffix("_proj")
            if leaf == "bias":
                yield f"{experts}.{part}_bias", w
            else:
                yield from _packed_or_float(f"{experts}.{part}", w)
        else:
            yield name, w
    if pending:
        raise ValueError(f"MXFP4 tensors without their pair: {', '.join(sorted(pending))}")


def _experts(prefix: str, leaf: str, w: Weight) -> Iterator[tuple[str, Weight]]:
    """Hugging Face's expert tensors (``gate_up_proj`` and ``down_proj``, float [E, H, 2I] /
    [E, I, H] or MXFP4 [E, 2I, ...] / [E, H, ...], and their ``_bias``) as gate, up, down."""
    if leaf == "gate_up_proj_bias":
        yield f"{prefix}.gate_bias", w[:, ::2]
        yield f"{prefix}.up_bias", w[:, 1::2]
    elif leaf == "down_proj_bias":
        yield f"{prefix}.down_bias", w
    elif leaf == "gate_up_proj" and isinstance(w, Mxfp4Weight):
        yield from _packed_or_float(f"{prefix}.gate", w.rows(slice(0, None, 2)))
        yield from _packed_or_float(f"{prefix}.up", w.rows(slice(1, None, 2)))
    elif leaf == "gate_up_proj":
        yield f"{prefix}.gate_weight", w[..., ::2].transpose(1, 2)
        yield f"{prefix}.up_weight", w[..., 1::2].transpose(1, 2)
    elif leaf == "down_proj":
        yield from _packed_or_float(
            f"{prefix}.down", w if isinstance(w, Mxfp4Weight) else w.transpose(1, 2)
        )
    else:
        raise ValueError(f"unexpected gpt-oss expert tensor {prefix}.{leaf}")


def _packed_or_float(name: str, w: Weight) -> Iterator[tuple[str, Weight]]:
    if isinstance(w, Mxfp4Weight):
        yield f"{name}_scales", w.scales
        yield f"{name}_codes", w.codes
    else:
        yield f"{name}_weight", w
