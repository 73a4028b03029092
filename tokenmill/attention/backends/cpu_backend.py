"""Paged attention on the CPU with the C kernels (tokenmill/csrc): K/V cache writes and decode
attention where the tensors fit, the torch backend's code otherwise (and for every prefill).

The decode kernel reads each sequence's blocks in place: no gather, no padding, no mask. It
takes float32 or float16 caches, or int8 / fp8 with their scales, and at most
MAX_ATTENTION_GROUP query heads per KV head.
"""

from __future__ import annotations

import torch

from tokenmill.attention.backends.torch_backend import TorchAttentionBackend
from tokenmill.attention.metadata import AttentionMetadata
from tokenmill.kernels import cpu_library as lib


class CpuAttentionBackend(TorchAttentionBackend):
    name = "cpu"

    def __init__(self) -> None:
        if not lib.available():
            raise ValueError("the C kernels are not built here or this CPU lacks AVX2/FMA")

    def store_kv(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        slot_mapping: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        kv_scales: tuple[torch.Tensor, torch.Tensor] | None,
    ) -> None:
        if _kernel_writes(k, v, k_cache, v_cache, kv_scales, slot_mapping):
            lib.kv_write(k, v, slot_mapping, (k_cache, v_cache), kv_scales)
            return
        super().store_kv(k, v, slot_mapping, k_cache, v_cache, kv_scales)

    def attend_decodes(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        window: int | None,
        kv_scales: tuple[torch.Tensor, torch.Tensor] | None,
    ) -> torch.Tensor:
        _, _, nkv, hd = k_cache.shape
        group_ok = q.shape[1] // nkv <= lib.MAX_ATTENTION_GROUP
        if hd % 8 == 0 and group_ok and _kernel_reads(q, k_cache, v_cache, kv_scales):
            return lib.decode_attention(
                q,
                k_cache,
                v_cache,
                meta.decode_block_table,
                meta.decode_seq_lens,
                window,
                scale,
                kv_scales,
            )
        return super().attend_decodes(q, k_cache, v_cache, meta, scale, window, kv_scales)


def _kernel_writes(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    kv_scales: tuple[torch.Tensor, torch.Tensor] | None,
    slot_mapping: torch.Tensor,
) -> bool:
    """Whether the C kernel can store k and v (float32, each token's row dense: they may be
    views into a fused q/k/v projection) into this cache: float32 or float16, or one-byte with
    its scales."""
    row_dense = all(t.stride(2) == 1 and t.stride(1) == t.shape[2] for t in (k, v))
    if kv_scales is None:
        cache_ok = lib.is_dense_f32(k_cache, v_cache) or _float16_caches(k_cache, v_cache)
    else:
        cache_ok = (
            k_cache.dtype == v_cache.dtype
            and k_cache.is_contiguous()
            and v_cache.is_contiguous()
            and k.shape[2] % 8 == 0
            and lib.is_dense_f32(*kv_scales)
        )
    return (
        row_dense
        and cache_ok
        and slot_mapping.dtype == torch.int64
        and slot_mapping.is_contiguous()
        and k.dtype == v.dtype == torch.float32
        and k.device.type == "cpu"
    )


def _kernel_reads(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    kv_scales: tuple[torch.Tensor, torch.Tensor] | None,
) -> bool:
    """Whether the C decode kernel handles this cache: float32 or float16, or int8 / fp8 with
    its scales."""
    if not lib.has_dense_heads(q):
        return False
    if kv_scales is None:
        return lib.is_dense_f32(k_cache, v_cache) or _float16_caches(k_cache, v_cache)
    return (
        k_cache.dtype in (torch.int8, torch.float8_e4m3fn)
        and v_cache.dtype == k_cache.dtype
        and k_cache.is_contiguous()
        and v_cache.is_contiguous()
        and lib.is_dense_f32(*kv_scales)
    )


def _float16_caches(k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """float16 caches (--kv-cache-dtype float16) the C kernels read and write: contiguous, on
    the CPU, rows of a multiple of 8 elements."""
    return (
        k_cache.dtype == v_cache.dtype == torch.float16
        and all(t.device.type == "cpu" and t.is_contiguous() for t in (k_cache, v_cache))
        and k_cache.shape[-1] % 8 == 0
    )
