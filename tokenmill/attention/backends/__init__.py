"""Attention backends, created by name through a lazy registry.

    torch  attention/backends/torch_backend.py  pure torch: any device, and the oracle
    cpu    attention/backends/cpu_backend.py    C kernels for K/V writes and decodes where they
                                                fit, the torch code otherwise
    triton attention/backends/triton_backend.py Triton kernels: CUDA (CPU in Triton's interpreter)

A new backend (Triton, CUDA) is a new file and one line in ``_BACKENDS``; its imports stay
inside its module, which loads only when picked.
"""

from __future__ import annotations

import importlib

from tokenmill.attention.backends.base import AttentionBackend
from tokenmill.attention.backends.torch_backend import TorchAttentionBackend

__all__ = [
    "ATTENTION_BACKENDS",
    "AttentionBackend",
    "TorchAttentionBackend",
    "create_attention_backend",
]

# name -> (module, class), imported when created
_BACKENDS: dict[str, tuple[str, str]] = {
    "torch": ("tokenmill.attention.backends.torch_backend", "TorchAttentionBackend"),
    "cpu": ("tokenmill.attention.backends.cpu_backend", "CpuAttentionBackend"),
    "triton": ("tokenmill.attention.backends.triton_backend", "TritonAttentionBackend"),
}
ATTENTION_BACKENDS = tuple(_BACKENDS)


def create_attention_backend(name: str) -> AttentionBackend:
    """The attention backend called ``name`` (one of ATTENTION_BACKENDS). ValueError for an
    unknown name, or for one that cannot run here ("cpu" without the C kernels)."""
    if name not in _BACKENDS:
        raise ValueError(f"attention backend must be one of {', '.join(_BACKENDS)}; got {name!r}")
    module_name, class_name = _BACKENDS[name]
    return getattr(importlib.import_module(module_name), class_name)()
