"""Paged attention on the CPU with the C kernels (tokenmill/csrc): K/V cache writes, decode
attention and prefill attention where the tensors fit, the torch backend's code otherwise.

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

    def attend_prompts(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, n: int, scale: float
    ) -> torch.Tensor:
        length = q.shape[0] // n
        if not _prefill_kernel_takes(q, length, None, 0, 0):
            return super().attend_prompts(q, k, v, n, scale)
        parts = [
            lib.prefill_attention(q[a : a + length], k[a : a + length], v[a : a + length], 0, 0, None, scale)
            for a in range(0, q.shape[0], length)
        ]  # fmt: skip
        return torch.cat(parts)

    def attend_run(
        self,
        q: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        q0: int,
        k0: int,
        scale: float,
        window: int | None,
    ) -> torch.Tensor:
        if _prefill_kernel_takes(q, keys.shape[0], window, q0, k0):
            return lib.prefill_attention(q, keys, values, q0, k0, window, scale)
        return super().attend_run(q, keys, values, q0, k0, scale, window)


# A chunk with no window on top of more context than this attends through torch's flash
# kernel (attend_run's parts): on AMD EPYC Zen 4 (2 threads) a 2,048-token chunk on 6,144
# cached tokens took 0.36 s there and 0.40 s in the C kernel, which wins below (a 512-token
# prompt 3.4 ms a layer against 6.4, a 2,048-token one 51 ms against 62).
PREFILL_KERNEL_MAX_KEYS = 2048


def _prefill_kernel_takes(
    q: torch.Tensor, num_keys: int, window: int | None, q0: int, k0: int
) -> bool:
    """Whether the C prefill kernel runs this chunk: float32 CPU, head_dim a multiple of 16,
    and windowed or within PREFILL_KERNEL_MAX_KEYS keys."""
    return (
        q.dtype == torch.float32
        and q.device.type == "cpu"
        and q.shape[-1] % 16 == 0
        and (window is not None or num_keys <= PREFILL_KERNEL_MAX_KEYS)
        and k0 <= q0
    )


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
