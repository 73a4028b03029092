"""Triton kernels of the paged KV cache (issue 24): K/V writes, prefill and decode attention.

Each module holds one kernel and its Python launcher; ``paged.py`` the device helpers they
share. Every module imports triton at its top, so this package loads only when the "triton"
attention backend is picked (attention/backends/triton_backend.py). On CPU tensors the kernels
run in Triton's interpreter (``TRITON_INTERPRET=1``), which is how the tests check them.
"""

from __future__ import annotations

from tokenmill.attention.triton.cache_write import store_kv
from tokenmill.attention.triton.decode import decode_attention
from tokenmill.attention.triton.prefill import prefill_attention

__all__ = ["decode_attention", "prefill_attention", "store_kv"]
