"""Paged attention in Triton kernels (attention/triton/): the CUDA backend of issue 24.

A step is three launches at most: the K/V write of every token, the split-K decode of the
decodes (two kernels), and one prefill launch for all prefill chunks. Every kernel reads K/V
from the paged cache, dequantizing int8 / fp8 as it loads, and accumulates in float32; the
output is in q's dtype. Unlike the torch backend, a fresh prompt also reads its K/V back from
the cache, so with a float16 cache under a float32 model it sees float16-rounded keys.

NOTE: imports triton at its top; the registry (attention/backends/__init__.py) imports this
module only when "triton" is picked. On CPU tensors the kernels need ``TRITON_INTERPRET=1``
(set before triton first launches a kernel), which is how CI tests them without a GPU.
"""

from __future__ import annotations

import torch

from tokenmill.attention.backends.base import AttentionBackend
from tokenmill.attention.backends.torch_backend import TorchAttentionBackend
from tokenmill.attention.metadata import AttentionMetadata
from tokenmill.attention.triton import decode_attention, prefill_attention, store_kv


class TritonAttentionBackend(AttentionBackend):
    """Attention through Triton kernels, on CUDA tensors (or CPU ones in the interpreter).

    Args:
        partition_size: keys per decode program (a power of two); smaller splits a long
            context over more programs. None: chosen per launch from the batch
            (attention/triton/decode.py's decode_partition_size).
    """

    name = "triton"

    def __init__(self, partition_size: int | None = None) -> None:
        self.partition_size = partition_size

    def forward(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        v: torch.Tensor,
        k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        window: int | None,
        kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None,  # [num_blocks, bs, nkv] f32
        softcap: float | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if softcap is not None or sinks is not None:  # the torch backend's explicit matmuls
            return TorchAttentionBackend().forward(
                q, k, v, k_cache, v_cache, meta, scale, window, kv_scales, softcap, sinks
            )
        store_kv(k, v, meta.slot_mapping, k_cache, v_cache, kv_scales)
        q = q if q.stride(-1) == 1 else q.contiguous()
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        nd = meta.num_decodes
        if nd:  # | decode tokens | prefill chunks |: the decodes' rows come first
            decode_attention(
                q[:nd],
                k_cache,
                v_cache,
                kv_scales,
                meta.decode_block_table,
                meta.decode_seq_lens,
                out[:nd],
                scale,
                window,
                self.partition_size,
            )
        prefill_attention(q, k_cache, v_cache, kv_scales, meta.prefills, out, scale, window)
        return out
