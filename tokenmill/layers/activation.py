"""Activation functions by their Hugging Face names, and the gated act(gate) * up."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from tokenmill.kernels.base import KernelBackend
from tokenmill.kernels.torch_backend import ACTIVATIONS, TorchKernelBackend

# Hugging Face's names -> the kernel backends' (kernels/torch_backend.py: ACTIVATIONS).
_ACT_NAMES = {
    "silu": "silu",
    "swish": "silu",
    "gelu": "gelu",
    "gelu_pytorch_tanh": "gelu_tanh",
    "gelu_new": "gelu_tanh",
}


def backend_act(name: str) -> str:
    """The kernel backends' name of a Hugging Face activation."""
    if name not in _ACT_NAMES:
        raise ValueError(f"unsupported activation {name!r}; supported: {', '.join(_ACT_NAMES)}")
    return _ACT_NAMES[name]


def get_act_fn(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    return ACTIVATIONS[backend_act(name)]


class ActAndMul(nn.Module):
    """act(gate) * up over a fused gate/up projection's output [tokens, 2d] = [gate | up]
    (vLLM's SiluAndMul / GeluAndMul), computed by the kernel backend bound at load."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.act = backend_act(name)
        self.kernels: KernelBackend = TorchKernelBackend()

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        return self.kernels.act_and_mul(gate_up, self.act)
