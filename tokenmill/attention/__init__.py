"""Attention over the paged KV cache: per-step metadata, the layer, and backends."""

from tokenmill.attention.kv_cache import (
    dequantize_kv,
    is_quantized_kv,
    kv_bytes_per_token,
    kv_storage_dtype,
    quantize_kv,
)
from tokenmill.attention.layer import Attention
from tokenmill.attention.metadata import (
    AttentionMetadata,
    ForwardBatch,
    PrefillSeq,
    decode_forward_batch,
)

__all__ = [
    "Attention",
    "AttentionMetadata",
    "ForwardBatch",
    "PrefillSeq",
    "decode_forward_batch",
    "dequantize_kv",
    "is_quantized_kv",
    "kv_bytes_per_token",
    "kv_storage_dtype",
    "quantize_kv",
]
