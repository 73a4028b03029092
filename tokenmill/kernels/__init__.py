"""Kernel backends: the ops a model step calls outside attention (norms, RoPE, gated
activations, adds, embeddings, packed matmuls, argmax), one implementation per kernel library.

    torch  kernels/torch_backend.py  pure torch: any device, and the oracle of the others
    cpu    kernels/cpu_backend.py    the C kernels (cpu_library.py) where inputs fit, else torch
    triton kernels/triton_backend.py Triton kernels (kernels/triton/) on CUDA, else torch

A backend is created by name through a lazy registry: a new one (Triton, CUDA) is a new file and
one line in ``_BACKENDS``; its imports stay inside its module, which loads only when picked.
``recording.py`` and ``graph.py`` record and replay the C kernels' calls (decode-step graphs).
"""

from __future__ import annotations

import importlib

import torch

from tokenmill.config import KERNEL_BACKENDS
from tokenmill.kernels.base import KernelBackend

__all__ = ["KERNEL_BACKENDS", "KernelBackend", "create_kernel_backend", "default_kernel_backend"]

# name (config.KERNEL_BACKENDS, which EngineArgs.kernel_backend takes) -> (module, class),
# imported when created
_BACKENDS: dict[str, tuple[str, str]] = {
    "torch": ("tokenmill.kernels.torch_backend", "TorchKernelBackend"),
    "cpu": ("tokenmill.kernels.cpu_backend", "CpuKernelBackend"),
    "triton": ("tokenmill.kernels.triton_backend", "TritonKernelBackend"),
}
assert tuple(_BACKENDS) == KERNEL_BACKENDS, "config.KERNEL_BACKENDS names every backend"


def create_kernel_backend(name: str) -> KernelBackend:
    """The kernel backend called ``name`` (one of KERNEL_BACKENDS). ValueError for an unknown
    name, or for one that cannot run here ("cpu" without the C kernels)."""
    if name not in _BACKENDS:
        raise ValueError(f"kernel backend must be one of {', '.join(_BACKENDS)}; got {name!r}")
    module_name, class_name = _BACKENDS[name]
    return getattr(importlib.import_module(module_name), class_name)()


def default_kernel_backend(device: torch.device) -> str:
    """The backend to pick: "cpu" on a CPU device where the C kernels load (built, and the CPU
    has AVX2/FMA), "triton" on a CUDA device where triton imports, "torch" everywhere else."""
    if device.type == "cuda":
        return "triton" if _has_triton() else "torch"
    if device.type != "cpu":
        return "torch"
    from tokenmill.kernels import cpu_library

    return "cpu" if cpu_library.available() else "torch"


def _has_triton() -> bool:
    try:
        import triton  # noqa: F401  (the optional "cuda" extra)
    except ImportError:
        return False
    return True
