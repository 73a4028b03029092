"""K/V written into the paged cache at each token's slot (one program per token and KV head).

A float cache stores the rows cast to its dtype. An int8 / fp8 cache stores them quantized
exactly as ``quantize_kv`` (attention/kv_cache.py) does: scale = max|x| / qmax per token per KV
head, y = x / max(scale, tiny) with IEEE division (``div_rn``: Triton's plain ``/`` is an
approximate division on NVIDIA GPUs), clamped to +-qmax, then rounded half to even: int8 like
``torch.round``, fp8 onto e4m3's grid like torch's conversion. Payload and scales equal torch's
bit for bit (tested in the interpreter; a GPU runs the same IEEE operations). Slots below 0 are
skipped (padding rows a runner may mark that way).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenmill.attention.triton.paged import head_block

_QMAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}
_TINY = torch.finfo(torch.float32).tiny


@triton.jit
def _round_half_even(y):
    """torch.round's rounding, from floor only (exact for |y| < 2^23; here |y| <= ~127)."""
    f = tl.floor(y)
    frac = y - f
    is_odd = (f - 2.0 * tl.floor(f * 0.5)) == 1.0
    return tl.where((frac > 0.5) | ((frac == 0.5) & is_odd), f + 1.0, f)


@triton.jit
def _round_to_e4m3(y):
    """y (0 <= y <= 448) rounded half to even onto float8_e4m3fn's grid, in float32: 3 mantissa
    bits, subnormal steps of 2^-9 below 2^-6. Then the conversion to fp8 is exact, whatever its
    rounding. NOTE: the interpreter's own float32 -> fp8 conversion drops the carry when
    rounding up crosses a power of two (-127.05 became -64, not -128)."""
    exponent = ((y.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    step_exponent = tl.maximum(exponent, -6) - 3
    step = ((step_exponent + 127) << 23).to(tl.float32, bitcast=True)  # 2^step_exponent
    inv_step = ((127 - step_exponent) << 23).to(tl.float32, bitcast=True)  # 2^-step_exponent
    # NOTE: a product by the exact inverse, not ``/ step``: a GPU's plain division is
    # approximate (div.full.f32), and one ulp off a half-way tie rounds it the other way.
    return _round_half_even(y * inv_step) * step  # exact: powers of two


@triton.jit
def _store_row(
    x_ptr,  # this token's row of K or V for this head
    cache_ptr,  # its slot's row in the cache
    scale_ptr,  # its slot's scale (QUANTIZED)
    offs_d,
    d_mask,
    QUANTIZED: tl.constexpr,
    IS_INT8: tl.constexpr,
    QMAX: tl.constexpr,
    TINY: tl.constexpr,
):
    cache_dtype = cache_ptr.dtype.element_ty
    if QUANTIZED:
        x = tl.load(x_ptr + offs_d, mask=d_mask, other=0.0).to(tl.float32)
        scale = tl.math.div_rn(tl.max(tl.abs(x), axis=0), QMAX)
        y = tl.math.div_rn(x, tl.maximum(scale, TINY))
        y = tl.minimum(tl.maximum(y, -QMAX), QMAX)
        if IS_INT8:
            q = _round_half_even(y).to(cache_dtype)
        else:
            # The magnitude, on e4m3's grid, converts exactly; the sign bit goes onto the byte
            # itself, so a negative value that rounds to zero is -0.0 as in torch (on an H200,
            # negating the float zero gave +0.0: the compiler assumes no signed zeros).
            mag = _round_to_e4m3(tl.abs(y)).to(cache_dtype).to(tl.uint8, bitcast=True)
            sign = (((y.to(tl.int32, bitcast=True) >> 31) & 1) << 7).to(tl.uint8)
            q = (mag | sign).to(cache_dtype, bitcast=True)
        tl.store(cache_ptr + offs_d, q, mask=d_mask)
        tl.store(scale_ptr, scale)
    else:
        # NOTE: no float32 round trip: a same-dtype store stays bit-exact, and the
        # interpreter's float32 -> 16-bit conversion truncates.
        x = tl.load(x_ptr + offs_d, mask=d_mask)
        tl.store(cache_ptr + offs_d, x.to(cache_dtype), mask=d_mask)


@triton.jit
def _store_kv_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    k_scale_ptr,
    v_scale_ptr,
    slot_ptr,
    stride_x_tok,
    stride_x_head,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_sb,
    stride_ss,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    QUANTIZED: tl.constexpr,
    IS_INT8: tl.constexpr,
    QMAX: tl.constexpr,
    TINY: tl.constexpr,
):
    tok = tl.program_id(0)
    head = tl.program_id(1)
    slot = tl.load(slot_ptr + tok).to(tl.int64)
    if slot < 0:
        return
    block_id = slot // BLOCK_SIZE
    in_block = slot % BLOCK_SIZE
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    x_off = tok.to(tl.int64) * stride_x_tok + head * stride_x_head
    c_off = block_id * stride_cb + in_block * stride_cs + head * stride_ch
    s_off = block_id * stride_sb + in_block * stride_ss + head
    _store_row(
        k_ptr + x_off,
        k_cache_ptr + c_off,
        k_scale_ptr + s_off,
        offs_d,
        d_mask,
        QUANTIZED,
        IS_INT8,
        QMAX,
        TINY,
    )
    _store_row(
        v_ptr + x_off,
        v_cache_ptr + c_off,
        v_scale_ptr + s_off,
        offs_d,
        d_mask,
        QUANTIZED,
        IS_INT8,
        QMAX,
        TINY,
    )


def store_kv(
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    v: torch.Tensor,
    slot_mapping: torch.Tensor,  # [num_tokens] long
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    kv_scales: tuple[torch.Tensor, torch.Tensor] | None,  # [num_blocks, block_size, nkv] f32
) -> None:
    """Store each token's K and V at its slot (quantized, with its scales, for int8 / fp8)."""
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    k, v = k.contiguous(), v.contiguous()
    quantized = kv_scales is not None
    k_scale, v_scale = kv_scales if quantized else (k_cache, v_cache)  # unused when float
    assert k_cache.stride(-1) == 1 and v_cache.stride() == k_cache.stride()
    _store_kv_kernel[(num_tokens, num_kv_heads)](
        k,
        v,
        k_cache,
        v_cache,
        k_scale,
        v_scale,
        slot_mapping,
        k.stride(0),
        k.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        k_scale.stride(0) if quantized else 0,
        k_scale.stride(1) if quantized else 0,
        HEAD_DIM=head_dim,
        BLOCK_D=head_block(head_dim),
        BLOCK_SIZE=k_cache.shape[1],
        QUANTIZED=quantized,
        IS_INT8=k_cache.dtype == torch.int8,
        QMAX=_QMAX.get(k_cache.dtype, 0.0),
        TINY=_TINY,
    )
