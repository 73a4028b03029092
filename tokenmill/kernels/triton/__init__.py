"""Triton kernels of the "triton" kernel backend (kernels/triton_backend.py), one module per op.

Every module here imports triton at its top, so this package loads only when that backend is
picked (``create_kernel_backend("triton")``); nothing else in tokenmill imports it. Without a GPU
the kernels run in Triton's interpreter (``TRITON_INTERPRET=1``) on CPU tensors, which is how
the tests check them against the torch backend.
"""

from __future__ import annotations

__all__: list[str] = []
