"""The packed-weight matmul kernel (tokenmill/csrc/qgemm.c), loaded through ctypes.

The extension is built by ``pip install`` where a C compiler exists; it needs AVX2 and FMA at
run time. ``available()`` says whether it can be used; callers fall back to the pure-torch
reference (quant/packed.py) otherwise, so every path runs everywhere.
"""

from __future__ import annotations

import ctypes
import functools
import logging

import torch

from tokenmill.quant.packed import PackedWeight

logger = logging.getLogger(__name__)

_KINDS = {"q8": 0, "q4": 1}
_i64, _ptr, _int = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int


@functools.cache
def _library() -> ctypes.CDLL | None:
    try:
        from tokenmill import _qgemm
    except ImportError:
        logger.info("packed-weight kernel not built; using the torch reference")
        return None
    lib = ctypes.CDLL(_qgemm.__file__)
    if not lib.tm_cpu_supported():
        logger.info("CPU lacks AVX2/FMA; packed weights use the torch reference")
        return None
    lib.tm_qgemm.argtypes = [_i64, _i64, _i64, _ptr, _int, _ptr, _ptr, _ptr, _i64, _ptr, _ptr, _int]
    lib.tm_qgemm.restype = _int
    lib.tm_dequant_rows.argtypes = [_i64, _i64, _i64, _int, _ptr, _ptr, _ptr, _i64, _ptr]
    lib.tm_dequant_rows.restype = None
    return lib


def available() -> bool:
    return _library() is not None


def supports(w: PackedWeight) -> bool:
    """Whether the kernel handles this weight's layout (else the torch reference runs)."""
    n, k = w.shape
    chunks = w.group // 32  # the kernel needs G = 16 or 32 · 2^j
    group_ok = w.group == 16 or (w.group % 32 == 0 and chunks & (chunks - 1) == 0)
    return k % w.group == 0 and k % 32 == 0 and group_ok and w.codes.device.type == "cpu"


def qgemm(
    x: torch.Tensor, w: PackedWeight, bias: torch.Tensor | None, act_int8: bool
) -> torch.Tensor:
    """y[M, N] = x[M, K] · Wᵀ (+ bias) in float32 with the C kernel (callers check available)."""
    lib = _library()
    assert lib is not None and supports(w)
    x = x.float().contiguous()
    m, k = x.shape
    y = torch.empty(m, w.shape[0], dtype=torch.float32)
    rc = lib.tm_qgemm(
        m,
        w.shape[0],
        k,
        x.data_ptr(),
        _KINDS[w.kind],
        w.codes.data_ptr(),
        w.scales.data_ptr(),
        None if w.offsets is None else w.offsets.data_ptr(),
        w.group,
        None if bias is None else bias.data_ptr(),
        y.data_ptr(),
        int(act_int8),
    )
    if rc != 0:
        raise MemoryError("packed matmul could not allocate its activation buffer")
    return y


def dequantize_rows(w: PackedWeight, start: int, end: int) -> torch.Tensor:
    """Float32 rows [start, end) of W with the C kernel (a tile for a float GEMM)."""
    lib = _library()
    assert lib is not None and supports(w)
    out = torch.empty(end - start, w.shape[1], dtype=torch.float32)
    lib.tm_dequant_rows(
        start,
        end,
        w.shape[1],
        _KINDS[w.kind],
        w.codes.data_ptr(),
        w.scales.data_ptr(),
        None if w.offsets is None else w.offsets.data_ptr(),
        w.group,
        out.data_ptr(),
    )
    return out
