"""tokenmill's C kernels (tokenmill/csrc), loaded through ctypes.

qgemm.c: the packed-weight matmul; decode_ops.c: RMSNorm, RoPE and paged decode attention for
float32 CPU tensors. The extension is built by ``pip install`` where a C compiler exists; it
needs AVX2 and FMA at run time. ``available()`` says whether it can be used; every caller has a
pure-torch path it takes otherwise (and that tests compare against), so everything runs
everywhere. Callers check shapes and dtypes (``fits``) before calling.
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
    lib.tm_rmsnorm.argtypes = [_ptr, _ptr, ctypes.c_float, _ptr, _ptr, _i64, _i64, ctypes.c_float]
    lib.tm_rmsnorm.restype = None
    lib.tm_rope_neox.argtypes = [_ptr, _ptr, _ptr, _ptr, _i64, _i64, _i64]
    lib.tm_rope_neox.restype = None
    lib.tm_decode_attn.argtypes = [_ptr] * 8 + [_i64] * 7 + [ctypes.c_float, _ptr]
    lib.tm_decode_attn.restype = _int
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
    assert lib is not None  # callers checked available() and supports(w)
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
    assert lib is not None  # callers checked available() and supports(w)
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


def fits(*tensors: torch.Tensor) -> bool:
    """Float32, contiguous CPU tensors, with the kernels built: the decode ops may run."""
    return available() and all(
        t.dtype == torch.float32 and t.device.type == "cpu" and t.is_contiguous() for t in tensors
    )


def rmsnorm(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_offset: float,
    eps: float,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """residual + x / rms(x) · (weight + weight_offset) over the last dim (a multiple of 8)."""
    lib = _library()
    assert lib is not None
    out = torch.empty_like(x)
    dim = x.shape[-1]
    lib.tm_rmsnorm(
        x.data_ptr(),
        weight.data_ptr(),
        weight_offset,
        None if residual is None else residual.data_ptr(),
        out.data_ptr(),
        x.numel() // dim,
        dim,
        eps,
    )
    return out


def rope_neox_(
    x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> torch.Tensor:
    """Rotate-half RoPE of x [tokens, heads, head_dim] in place; positions int64 [tokens]."""
    lib = _library()
    assert lib is not None
    tokens, heads, dim = x.shape
    lib.tm_rope_neox(
        x.data_ptr(), positions.data_ptr(), cos.data_ptr(), sin.data_ptr(), tokens, heads, dim
    )
    return x


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    window: int | None,
    scale: float,
    kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """One query per sequence (q [nd, heads, head_dim]) against its paged K/V (float32, or int8 /
    fp8 e4m3 with per-token-per-head scales); int64 tables."""
    lib = _library()
    assert lib is not None
    nd, heads, dim = q.shape
    _, bs, kv_heads, _ = k_cache.shape
    out = torch.empty_like(q)
    rc = lib.tm_decode_attn(
        q.data_ptr(),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        None if kv_scales is None else kv_scales[0].data_ptr(),
        None if kv_scales is None else kv_scales[1].data_ptr(),
        _fp8_table().data_ptr() if k_cache.dtype == torch.float8_e4m3fn else None,
        block_table.data_ptr(),
        seq_lens.data_ptr(),
        nd,
        heads,
        kv_heads,
        dim,
        bs,
        block_table.shape[1],
        window or 0,
        scale,
        out.data_ptr(),
    )
    if rc != 0:
        raise MemoryError("decode attention could not allocate its score buffer")
    return out


@functools.cache
def _fp8_table() -> torch.Tensor:
    """The float32 value of each of the 256 e4m3 bytes (the kernel decodes fp8 through it)."""
    return torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float()
