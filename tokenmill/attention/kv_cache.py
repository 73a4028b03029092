"""The KV cache's storage format: its dtype, its size per token, and (de)quantization.

``kv_cache_dtype`` "auto" stores K and V in the model dtype, "float16" in float16 (llama.cpp's
default cache type: half the bytes of float32, rounded to nearest). "int8" and "fp8" (float8_e4m3fn)
store them quantized, symmetric, with one float32 scale per token per KV head over head_dim
(scale = max|x| / qmax) in a separate tensor next to the cache::

    payload  [num_blocks, block_size, num_kv_heads, head_dim]  int8 | float8_e4m3fn
    scales   [num_blocks, block_size, num_kv_heads]            float32

A slot's scale lives at the same flat index as its payload row, so whatever moves or shares
blocks (prefix caching, preemption) carries the scales along for free.
"""

from __future__ import annotations

import torch

from tokenmill.config import KV_CACHE_DTYPES

# kv_cache_dtype -> (storage dtype, largest magnitude a quantized element takes)
_QUANT_FORMATS: dict[str, tuple[torch.dtype, float]] = {
    "int8": (torch.int8, 127.0),
    "fp8": (torch.float8_e4m3fn, 448.0),
}
_QMAX = {dtype: qmax for dtype, qmax in _QUANT_FORMATS.values()}
_SCALE_DTYPE = torch.float32


def is_quantized_kv(kv_cache_dtype: str) -> bool:
    return kv_cache_dtype in _QUANT_FORMATS


def kv_storage_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The dtype of the K/V payload tensors."""
    if kv_cache_dtype == "auto":
        return model_dtype
    if kv_cache_dtype == "float16":
        return torch.float16
    if kv_cache_dtype not in _QUANT_FORMATS:
        raise ValueError(
            f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}; got {kv_cache_dtype!r}"
        )
    return _QUANT_FORMATS[kv_cache_dtype][0]


def kv_bytes_per_token(
    num_kv_heads: int, head_dim: int, kv_cache_dtype: str, model_dtype: torch.dtype
) -> int:
    """Bytes one token takes in one layer's cache: K and V payload, plus their scales."""
    elem = torch.empty((), dtype=kv_storage_dtype(kv_cache_dtype, model_dtype)).element_size()
    per_head = head_dim * elem
    if is_quantized_kv(kv_cache_dtype):
        per_head += torch.empty((), dtype=_SCALE_DTYPE).element_size()
    return 2 * num_kv_heads * per_head


def quantize_kv(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., head_dim] -> (payload [..., head_dim] in ``dtype``, scale [...] float32).

    int8 rounds to nearest (|error| <= scale / 2); fp8 rounds to e4m3fn's 3 mantissa bits
    (relative error <= 2^-4 above its subnormal range). All-zero rows get scale 0.
    """
    qmax = _QMAX[dtype]
    xf = x.float()
    scale = xf.abs().amax(dim=-1) / qmax
    y = xf / scale.clamp_min(torch.finfo(_SCALE_DTYPE).tiny).unsqueeze(-1)
    if dtype == torch.int8:
        y = y.round_()
    # NOTE: clamped also for fp8: rounding in the division can overshoot qmax by an ulp.
    return y.clamp_(-qmax, qmax).to(dtype), scale


def dequantize_kv(payload: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """payload [..., head_dim], scale [...] -> [..., head_dim] in ``dtype``."""
    # NOTE: float8 does not promote in arithmetic, so convert first (one float temporary).
    return payload.to(_SCALE_DTYPE).mul_(scale.unsqueeze(-1)).to(dtype)


def write_kv(
    cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim] int8 | fp8
    scale_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads] float32
    slot_mapping: torch.Tensor,  # [num_tokens] long
    x: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
) -> None:
    """Quantize new K or V rows and store them, with their scales, at their slots."""
    num_kv_heads, head_dim = x.shape[1], x.shape[2]
    payload, scale = quantize_kv(x, cache.dtype)
    # NOTE: through uint8 views: index_copy_ has no float8 kernel on CPU (torch 2.13).
    rows = cache.view(torch.uint8).view(-1, num_kv_heads, head_dim)
    rows.index_copy_(0, slot_mapping, payload.view(torch.uint8))
    scale_cache.view(-1, num_kv_heads).index_copy_(0, slot_mapping, scale)
