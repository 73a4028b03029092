"""Attention over the paged KV cache: per-step metadata, the layer, and backends."""

from tokenmill.attention.layer import Attention
from tokenmill.attention.metadata import AttentionMetadata, ForwardBatch, PrefillSeq

__all__ = ["Attention", "AttentionMetadata", "ForwardBatch", "PrefillSeq"]
