"""Activation functions by their Hugging Face names."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from tokenmill import kernels


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


_ACTS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": _gelu_tanh,
    "gelu_new": _gelu_tanh,
}


def get_act_fn(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    if name not in _ACTS:
        raise ValueError(f"unsupported activation {name!r}; supported: {', '.join(_ACTS)}")
    return _ACTS[name]


# The activations the C kernel computes (graph.c), by their Hugging Face names.
_KERNEL_ACTS = {
    "silu": "silu",
    "swish": "silu",
    "gelu_pytorch_tanh": "gelu_tanh",
    "gelu_new": "gelu_tanh",
}


class ActAndMul:
    """act(gate) * up over a fused gate/up projection's output [tokens, 2d] = [gate | up]
    (vLLM's SiluAndMul / GeluAndMul): one C kernel on float32 CPU tensors, torch otherwise."""

    def __init__(self, name: str) -> None:
        self.act = get_act_fn(name)
        self.kernel_act = _KERNEL_ACTS.get(name)

    def __call__(self, gate_up: torch.Tensor) -> torch.Tensor:
        d = gate_up.shape[-1] // 2
        if self.kernel_act and gate_up.dim() == 2 and d % 8 == 0 and kernels.fits(gate_up):
            return kernels.act_mul(gate_up, self.kernel_act)
        gate, up = gate_up.chunk(2, dim=-1)
        return self.act(gate) * up
